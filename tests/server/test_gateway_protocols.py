"""What inference gateways read from a pagedecode server: vLLM-named gauges (--metrics-compat
vllm) and KV events in vLLM's ZeroMQ format (--kv-events), replayed by a real SUB / REQ
subscriber to exactly the pool's cached pages."""
import re
import time

import httpx
import pytest

from .conftest import start_server, stop_server

zmq = pytest.importorskip("zmq", reason="pyzmq is not installed (pip install 'pagedecode[ray]')")
msgpack = pytest.importorskip("msgpack", reason="msgpack is not installed (pip install 'pagedecode[ray]')")

GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


def test_metrics_compat_vllm_exports_the_gateway_gauges(stories_path):
    s = start_server(stories_path, template=None, metrics_compat="vllm")
    try:
        httpx.post(s.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 2}, timeout=60).raise_for_status()
        text = httpx.get(s.url + "/metrics", timeout=30).text
    finally:
        stop_server(s)
    for name in GAUGES:
        m = re.search(rf'^{re.escape(name)}{{model_name="stories260k"}} ([0-9.e+-]+)$', text, re.M)
        assert m is not None, name
        assert 0 <= float(m.group(1)) <= 1 or name != "vllm:kv_cache_usage_perc"
    assert "vllm:lora_requests_info" not in text           # no adapters: the LoRA gauge is absent
    assert "pagedecode:num_requests_waiting" in text        # the own names stay


def test_without_compat_no_vllm_names(server):
    text = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer sekret"}, timeout=30).text
    assert "vllm:" not in text


def _apply(cached, tokens_of, batch):
    ts, events, rank = batch
    assert isinstance(ts, float) and rank == 0
    for ev in events:
        if ev[0] == "BlockStored":
            _, hashes, parent, token_ids, block_size, lora_id, medium, lora_name = ev
            assert parent is None or parent in cached, "a stored block's parent is a cached block"
            assert len(token_ids) == len(hashes) * block_size and lora_id is None and medium == "CPU"
            for k, h in enumerate(hashes):
                cached.add(h)
                tokens_of[h] = token_ids[k * block_size:(k + 1) * block_size]
        elif ev[0] == "BlockRemoved":
            _, hashes, medium = ev
            for h in hashes:
                cached.remove(h)          # only what was stored is removed
        else:
            assert ev == ["AllBlocksCleared"]
            cached.clear()


def _replay(ctx, address, start):
    """Ask the replay socket for the batches from seq `start` (a DEALER: one request, many
    replies, each [empty delimiter, seq, payload]; [-1, b""] ends them), asking again from the
    next seq while an answer (bounded in batches and bytes) brings any."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    out = []
    try:
        while True:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            answer = []
            while True:
                assert dealer.poll(10_000), "no replay answer"
                empty, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if int.from_bytes(seq, "big", signed=True) == -1:
                    assert payload == b""
                    break
                answer.append((int.from_bytes(seq, "big"), payload))
            if not answer:
                return out
            out += answer
            start = answer[-1][0] + 1
    finally:
        dealer.close(0)


def test_kv_events_replay_to_exactly_the_pools_cached_pages(stories_path):
    from pagedecode.kv_events import KVEventPublisher
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    # a small pool (48 pages of 16 tokens): the prompts below evict each other's pages
    s = start_server(stories_path, template=None, engine_options={"max_cache_tokens": 48 * 16, "max_batch_size": 4})
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", "tcp://127.0.0.1:*", block_size=16, topic="kv").attach(s.engine)
    try:
        live = []
        with httpx.Client(timeout=60) as c:
            # ZeroMQ's slow joiner: what is published before the PUB has connected to the SUB is
            # lost (the replay has it); a request at a time until a batch comes through
            deadline = time.monotonic() + 30
            while not sub.poll(200):
                assert time.monotonic() < deadline, "no KV event reached the subscriber"
                c.post(s.url + "/v1/completions", json={"prompt": list(range(3, 40)), "max_tokens": 1})
            for k in range(12):
                prompt = [(k * 31 + i * 7) % 400 + 3 for i in range(150)]
                for _ in range(2):     # the second time hits the cache
                    r = c.post(s.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 20, "ignore_eos": True})
                    r.raise_for_status()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            while sub.poll(100):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv"
                live.append((int.from_bytes(seq, "big"), payload))
            kept = _replay(ctx, pub.replay_address, 0)
            if live and kept[-1][0] == live[-1][0]:
                break
        assert [q for q, _ in kept] == list(range(len(kept))), "seq counts batches from 0, no gap"
        assert dict(live).items() <= dict(kept).items(), "the replay holds the very batches published"
        cached, tokens_of = set(), {}
        for _, payload in kept:
            _apply(cached, tokens_of, msgpack.unpackb(payload))
        assert msgpack.unpackb(kept[0][1])[1] == [["AllBlocksCleared"]]
        kinds = {ev[0] for _, p in kept for ev in msgpack.unpackb(p)[1]}
        assert {"BlockStored", "BlockRemoved"} <= kinds, "the pool evicted pages: removals were published"
        pool = s.engine.pool
        assert cached == set(pool.page_hash.values())
        assert all(tuple(tokens_of[key]) == pool._tokens[page] for page, key in pool.page_hash.items())
        # a replay from the middle starts there
        assert [q for q, _ in _replay(ctx, pub.replay_address, 3)] == [q for q, _ in kept if q >= 3]
    finally:
        pub.close()
        stop_server(s)
        sub.close(0)
        ctx.term()


def test_serve_flags_publish_kv_events_and_vllm_gauges(serve):
    s = serve("--metrics-compat", "vllm", "--kv-events", "tcp://127.0.0.1:*", "--kv-events-replay", "tcp://127.0.0.1:*",
              "--kv-events-topic", "kv")
    m = re.search(r"KV events on (tcp://\S+) \(replay: (tcp://\S+)\)", s.output)
    assert m is not None, s.output
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(m.group(1))
    try:
        deadline = time.monotonic() + 30
        with httpx.Client(timeout=60) as c:
            while not sub.poll(200):      # a request at a time until the subscription has joined
                assert time.monotonic() < deadline, "no KV event reached the subscriber"
                c.post(s.url + "/v1/completions", json={"prompt": list(range(3, 60)), "max_tokens": 1})
            assert "vllm:num_requests_waiting" in c.get(s.url + "/metrics").text
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and any(ev[0] == "BlockStored" for ev in msgpack.unpackb(payload)[1])
        kept = _replay(ctx, m.group(2), 0)
        assert kept[0][0] == 0 and msgpack.unpackb(kept[0][1])[1] == [["AllBlocksCleared"]]
    finally:
        sub.close(0)
        ctx.term()
        assert s.stop() == 0


def test_serve_connecting_to_a_bound_subscriber_sends_every_batch_from_seq_0(serve):
    """llm-d's way: the indexer binds, `serve --kv-events tcp://host:port` connects. A subscriber
    there before the server starts receives every batch live from seq 0 (the engine's first
    AllBlocksCleared, the first requests' pages), and the replay socket is offered in connect
    mode too (--kv-events-replay)."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    s = serve("--kv-events", f"tcp://127.0.0.1:{port}", "--kv-events-replay", "tcp://127.0.0.1:*",
              "--kv-events-topic", "kv")
    m = re.search(r"KV events on (tcp://\S+) \(replay: (tcp://\S+)\)", s.output)
    assert m is not None, s.output
    try:
        with httpx.Client(timeout=60) as c:
            for k in range(2):                        # the first requests, at once: no warm-up
                c.post(s.url + "/v1/completions", json={"prompt": [3 + k, *range(10, 60)], "max_tokens": 1}
                       ).raise_for_status()
        live: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            while sub.poll(100):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv"
                live.append((int.from_bytes(seq, "big"), payload))
            kept = _replay(ctx, m.group(2), 0)
            if live and kept[-1][0] == live[-1][0]:
                break
        assert live, "no batch reached the subscriber"
        assert [q for q, _ in live] == list(range(len(live))), "every batch from seq 0, none lost"
        assert live == kept, "the replay socket (connect mode) holds the very batches published"
        assert msgpack.unpackb(live[0][1])[1] == [["AllBlocksCleared"]]
        stored = [ev for _, p in live for ev in msgpack.unpackb(p)[1] if ev[0] == "BlockStored"]
        for k in range(2):
            head = [3 + k, 10, 11, 12]
            assert any(ev[3][i:i + 4] == head for ev in stored for i in range(3)), f"request {k}'s pages never came"
    finally:
        sub.close(0)
        ctx.term()
        assert s.stop() == 0
