"""KV-cache events for KV-aware routers (Ray Serve's, NVIDIA Dynamo's, llm-d's), in vLLM's wire
format over ZeroMQ: `pagedecode serve --kv-events tcp://...` (pyzmq and msgpack: pagedecode[ray]).

The prefix cache's changes (runtime/page_pool.py logs them, the engine hands them over once per
step) become one batch per step:

    XPUB socket, multipart  [topic, seq (8 bytes, big-endian), payload]
    payload (msgpack)       [ts, [event, ...], data_parallel_rank]
    BlockStored             ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                             lora_id, medium, lora_name]
    BlockRemoved            ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared        ["AllBlocksCleared"]

that is, vLLM's EventBatch and KVCacheEvent structs encoded array-like with their tag first.
A block hash is the prefix cache's chained page key (32 bytes of sha256, vLLM's bytes form of
ExternalBlockHash); a BlockStored lists the consecutive pages of one chain registered together,
their parent being the hash of the page before the first (None: a chain's first page). seq
counts batches from 0; the first batch is an AllBlocksCleared (a new engine holds nothing,
whatever a subscriber kept from an earlier one). A subscriber that sees a gap asks the replay
socket (ROUTER) for the batches from a seq: it sends [start seq, 8 bytes big-endian] from a REQ
or DEALER socket and gets [seq, payload] for each kept batch from there, then [-1, b""].

Endpoints follow vLLM's convention: one with a wildcard (`tcp://*:5557`), ipc:// or inproc:// is
bound, any other (`tcp://indexer:5557`, the llm-d way) is connected to. The replay endpoint is
always bound; by default on loopback, at the publisher's port + 1 when it binds a numeric port;
in connect mode where --kv-events-replay names one.

Connect mode, a subscriber bound before the server starts: a PUB socket drops what it sends
before the subscriber's subscription has come back over the new connection (ZeroMQ's slow
joiner), which would lose the batches from seq 0. The socket is an XPUB (a PUB that hands up
the subscriptions it receives; the same wire protocol), and the first batch waits, queued, until
a subscription to the topic arrives (at most `connect_wait_s`; then the batches flow to whoever
is there, and the replay socket has them).

Who may listen: the events carry every tenant's prompt token ids (BlockStored's token_ids), and
neither socket asks who is there. A wildcard (`tcp://*:5557`: every interface) exposes them to
whoever reaches the port: use it only on a trusted network (it is logged); the replay socket,
which answers requests, binds loopback unless --kv-events-replay names another address.

What a listener costs (none of it touches publishing, or the engine):
- the kept batches for replay are at most `buffer_bytes` (and `buffer_batches`);
- one replay request is answered with at most `replay_max_bytes` of batches, and at most
  `replay_peer_hwm` - 1 of them (then the end marker; the subscriber asks again from the next
  seq), by a thread of its own, so replay requests never delay the live stream;
- a peer that does not read its replies holds at most `replay_peer_hwm` queued messages (its
  replies are cut, not queued, beyond) and a kernel send buffer of `SEND_BUFFER_BYTES`;
- a subscriber that does not read holds at most `hwm` queued batches and SEND_BUFFER_BYTES.
A batch is one engine step's cache changes: a few KB (a prefill chunk's pages, or a step's
evictions at 32 bytes a page).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

from .runtime.page_pool import CacheEvent

log = logging.getLogger("pagedecode.kv_events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
SEND_BUFFER_BYTES = 256 << 10     # the kernel's send buffer per connection (autotuned: up to 4 MB)


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard, ipc:// or inproc:// endpoint is bound, others are connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def default_replay(endpoint: str) -> str | None:
    """The replay endpoint beside a bound tcp endpoint: its port + 1 (vLLM's 5557 / 5558), on
    loopback (it answers whoever asks; a wider one is asked for by name)."""
    if not endpoint.startswith("tcp://") or not binds(endpoint):
        return None
    _, _, port = endpoint.rpartition(":")
    return f"tcp://127.0.0.1:{int(port) + 1}" if port.isdigit() else None


def offset_port(endpoint: str, n: int) -> str:
    """A tcp endpoint's port + n (data-parallel rank n's, as vLLM offsets them); others get a
    `_dpN` suffix (ipc, inproc); a wildcard port (`*`) stays."""
    if n == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + n}" if port.isdigit() else endpoint
    return f"{endpoint}_dp{n}"


def to_vllm(events: list[CacheEvent], block_size: int, medium: str) -> list[list[Any]]:
    """The pool's log as vLLM events: consecutive pages of one chain in one BlockStored,
    consecutive removals in one BlockRemoved."""
    out: list[list[Any]] = []
    for ev in events:
        last = out[-1] if out else None
        if ev[0] == "stored":
            _, _, key, parent, tokens = ev
            if last is not None and last[0] == "BlockStored" and last[1][-1] == parent:
                last[1].append(key)
                last[3].extend(tokens)
            else:
                out.append(["BlockStored", [key], parent, list(tokens), block_size, None, medium, None])
        elif ev[0] == "removed":
            if last is not None and last[0] == "BlockRemoved":
                last[1].append(ev[1])
            else:
                out.append(["BlockRemoved", [ev[1]], medium])
        else:
            raise ValueError(f"unknown cache event {ev[0]!r}")
    return out


class KVEventPublisher:
    """One engine's prefix-cache events on a ZeroMQ XPUB socket, with a ROUTER socket replaying
    the last batches (see the module doc for the bounds). The sockets are made here (a bad
    endpoint fails at once); the XPUB is used only by the publishing thread, the ROUTER only by
    the replay thread; attach() starts both on an engine. connect_wait_s: in connect mode, how
    long the first batch waits for the subscriber's subscription (module doc)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, block_size: int,
                 medium: str = "CPU", topic: str = "", data_parallel_rank: int = 0,
                 buffer_batches: int = 10_000, buffer_bytes: int = 16 << 20, hwm: int = 1000,
                 replay_max_bytes: int = 1 << 20, replay_peer_hwm: int = 256,
                 connect_wait_s: float = 10.0) -> None:
        import msgpack
        import zmq
        if replay_peer_hwm < 2:
            raise ValueError(f"replay_peer_hwm must be >= 2, got {replay_peer_hwm}")
        self._pack = msgpack.Packer(use_bin_type=True)
        self.block_size, self.medium, self.rank = block_size, medium, data_parallel_rank
        self.topic = topic.encode()
        self.buffer_bytes, self.replay_max_bytes = buffer_bytes, replay_max_bytes
        self.replay_max_batches = replay_peer_hwm - 1      # an answer and its end marker fit a fresh peer's queue
        self.connects = not binds(endpoint)
        self.connect_wait_s = connect_wait_s
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)       # a PUB that hands up subscriptions (_await_subscriber)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.SNDBUF, SEND_BUFFER_BYTES)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: Any = None
        try:
            (self._pub.bind if binds(endpoint) else self._pub.connect)(endpoint)
            self.address: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.SNDHWM, replay_peer_hwm)
                self._replay.setsockopt(zmq.SNDBUF, SEND_BUFFER_BYTES)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)     # a full peer: EAGAIN, not a silent drop
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"KV events: cannot use {endpoint!r} / {replay_endpoint!r}: {e}") from None
        # the replay socket's real address (a `tcp://127.0.0.1:*` endpoint takes any free port)
        self.replay_address: str | None = (self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
                                           if self._replay is not None else None)
        for where in (endpoint, replay_endpoint or ""):
            if where.startswith("tcp://*") or where.startswith("tcp://0.0.0.0") or where.startswith("tcp://[::]"):
                log.warning("KV events: %s listens on every interface; the events carry every tenant's prompt "
                            "token ids", where)
        self._queue: queue.Queue[list[list[Any]] | None] = queue.Queue()
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._kept_bytes = 0
        self._kept_lock = threading.Lock()     # the publishing thread appends, the replay thread reads
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._replay_thread: threading.Thread | None = None
        self._stopping = threading.Event()    # the replay thread's end
        self._closing = threading.Event()     # close() began: the publishing thread waits for no subscriber
        self.subscribed = False               # a subscription to the topic has come (connect mode waits for it)
        self._engine: Any = None
        self.replies_cut = 0                   # replay answers cut short: the peer was not reading

    def attach(self, engine: Any) -> "KVEventPublisher":
        """Publish engine's cache changes from now on; the first batch clears the subscriber."""
        self._queue.put([["AllBlocksCleared"]])
        self._engine = engine
        engine.publish_cache_events(self.submit)
        self._thread = threading.Thread(target=self._run, name="pagedecode-kv-events", daemon=True)
        self._thread.start()
        if self._replay is not None:
            self._replay_thread = threading.Thread(target=self._serve_replay, name="pagedecode-kv-replay",
                                                   daemon=True)
            self._replay_thread.start()
        return self

    def submit(self, events: list[CacheEvent]) -> None:
        """One step's changes (called by the engine under its lock: converts and queues)."""
        self._queue.put(to_vllm(events, self.block_size, self.medium))

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop taking events, publish what is queued, close the sockets."""
        self._closing.set()
        if self._engine is not None:
            self._engine.publish_cache_events(None)
            self._engine = None
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)
            self._thread = None
        self._stopping.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout_s)
            self._replay_thread = None
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()

    def _run(self) -> None:
        if self.connects:
            self._await_subscriber()
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            self._read_subscriptions(0)
            payload = self._pack.pack([time.time(), batch, self.rank])
            seq = self._seq.to_bytes(8, "big")
            try:
                self._pub.send_multipart([self.topic, seq, payload])
            except Exception:        # a PUB socket drops at its high-water mark; anything else is logged
                log.exception("KV events: publishing batch %d failed", self._seq)
            self._keep(self._seq, payload)
            self._seq += 1

    def _await_subscriber(self) -> None:
        """Connect mode: hold the first batch (the engine's batches queue meanwhile) until the
        endpoint's subscriber has subscribed to the topic, connect_wait_s has passed, or close()."""
        deadline = time.monotonic() + self.connect_wait_s
        while not self.subscribed and not self._closing.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("KV events: no subscriber at %s after %.0f s; publishing anyway (a replay socket, "
                            "where named, keeps the batches)", self.address, self.connect_wait_s)
                return
            self._read_subscriptions(min(100, int(left * 1000) + 1))

    def _read_subscriptions(self, timeout_ms: int) -> None:
        """Take what the XPUB hands up (subscribe: 1 and a topic prefix; unsubscribe: 0 and one),
        waiting up to timeout_ms for the first; so they never pile up unread."""
        while self._pub.poll(timeout_ms):
            frame = self._pub.recv()
            if frame[:1] == b"\x01" and self.topic.startswith(frame[1:]):
                self.subscribed = True
            timeout_ms = 0

    def _keep(self, seq: int, payload: bytes) -> None:
        with self._kept_lock:
            if len(self._kept) == self._kept.maxlen:
                self._kept_bytes -= len(self._kept[0][1])
            self._kept.append((seq, payload))
            self._kept_bytes += len(payload)
            while self._kept_bytes > self.buffer_bytes and len(self._kept) > 1:
                self._kept_bytes -= len(self._kept.popleft()[1])

    def replayed(self, first: int) -> list[tuple[int, bytes]]:
        """The kept batches from seq `first`: at most replay_max_batches, and replay_max_bytes
        of them (at least one)."""
        out: list[tuple[int, bytes]] = []
        size = 0
        with self._kept_lock:
            if not self._kept or first > self._kept[-1][0]:
                return out
            skip = max(0, first - self._kept[0][0])          # seqs are consecutive in the deque
            for i in range(skip, len(self._kept)):
                seq, payload = self._kept[i]
                size += len(payload)
                if out and (size > self.replay_max_bytes or len(out) == self.replay_max_batches):
                    break
                out.append((seq, payload))
        return out

    def _serve_replay(self) -> None:
        while not self._stopping.is_set():
            if self._replay.poll(100):
                self._answer_replay()

    def _answer_replay(self) -> None:
        import zmq
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        who, _, start = frames
        try:
            for seq, payload in self.replayed(int.from_bytes(start, "big")):
                self._replay.send_multipart([who, b"", seq.to_bytes(8, "big"), payload], flags=zmq.DONTWAIT)
            self._replay.send_multipart([who, b"", END_SEQ, b""], flags=zmq.DONTWAIT)
        except zmq.Again:             # the peer's queue is full: it does not read, its answer is cut
            self.replies_cut += 1
        except zmq.ZMQError as e:     # EHOSTUNREACH: the peer has gone
            log.debug("KV events: a replay answer dropped: %s", e)
