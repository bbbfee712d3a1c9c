"""The KV-event replay's bounds (issue 34, item 7): replay requests are answered by a thread of
their own (live publishing is never late for them), each answer is bounded in batches and bytes,
the kept batches in bytes, and a peer that does not read has its answers cut, not queued. Connect
mode (issue 38): a subscriber bound before the publisher connects gets every batch from seq 0,
and the replay socket is there when named."""
import hashlib
import socket
import time

import pytest

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from pagedecode.kv_events import KVEventPublisher, default_replay  # noqa: E402


class Engine:
    """What the publisher needs of an engine: a place to hand its sink."""

    def publish_cache_events(self, sink):
        self.sink = sink


def stored(i, tokens=256):
    key = hashlib.sha256(i.to_bytes(8, "big")).digest()
    return [("stored", i, key, None, list(range(tokens)))]


@pytest.fixture
def published():
    """A publisher holding 2000 batches of ~600 bytes, a SUB that receives it, and a context."""
    ctx = zmq.Context()
    made = []

    def make(**options):
        pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", block_size=16, topic="kv",
                               **options).attach(Engine())
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.address)
        made.append((pub, sub))
        deadline = time.monotonic() + 10
        while not sub.poll(50):                    # ZeroMQ's slow joiner: until one batch comes through
            assert time.monotonic() < deadline
            pub.submit(stored(0))
        for i in range(2000):
            pub.submit(stored(i))
        while pub._seq < 2000:
            time.sleep(0.01)
        while sub.poll(100):
            sub.recv_multipart()
        return pub, sub
    yield make, ctx
    for pub, sub in made:
        sub.close(0)
        pub.close()
    ctx.term()


def dealer(ctx, address, options=()):
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    for k, v in options:
        d.setsockopt(k, v)
    d.connect(address)
    return d


def test_replay_requests_do_not_delay_live_publishing(published):
    make, ctx = published
    pub, sub = make()
    peers = [dealer(ctx, pub.replay_address) for _ in range(100)]
    for d in peers:                                # each asks for everything and never reads
        for _ in range(5):
            d.send_multipart([b"", (0).to_bytes(8, "big")])
    time.sleep(0.05)
    started = time.monotonic()
    pub.submit(stored(99_999))
    assert sub.poll(5000), "the live batch never came"
    late = time.monotonic() - started
    for d in peers:
        d.close(0)
    assert late < 0.5, f"a live batch was {late:.2f} s late behind replay requests"


def test_an_answer_is_bounded_and_the_rest_comes_from_the_next_seq(published):
    make, ctx = published
    pub, _ = make(replay_max_bytes=64 << 10, replay_peer_hwm=1000)
    d = dealer(ctx, pub.replay_address)
    got, start, answers = [], 0, 0
    while True:
        d.send_multipart([b"", start.to_bytes(8, "big")])
        answer = []
        while True:
            assert d.poll(5000)
            _, seq, payload = d.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            answer.append((int.from_bytes(seq, "big"), payload))
        if not answer:
            break
        answers += 1
        assert sum(len(p) for _, p in answer) <= 64 << 10
        got += answer
        start = answer[-1][0] + 1
    d.close(0)
    assert [s for s, _ in got] == list(range(pub._seq)) and answers > 10


def test_kept_batches_are_bounded_in_bytes(published):
    make, _ = published
    pub, _ = make(buffer_bytes=100 << 10)
    kept = pub.replayed(0)
    assert 0 < pub._kept_bytes <= 100 << 10 and kept[-1][0] == pub._seq - 1 and len(pub._kept) < 2000
    assert sum(len(p) for _, p in pub._kept) == pub._kept_bytes


def test_a_peer_that_does_not_read_has_its_answers_cut(published):
    make, ctx = published
    pub, _ = make(replay_peer_hwm=16)
    d = dealer(ctx, pub.replay_address, [(zmq.RCVHWM, 1), (zmq.RCVBUF, 4096)])
    for _ in range(200):
        d.send_multipart([b"", (0).to_bytes(8, "big")])
    deadline = time.monotonic() + 5
    while pub.replies_cut == 0:
        assert time.monotonic() < deadline, "every answer was queued for a peer that does not read"
        time.sleep(0.02)
    d.close(0)


def test_the_default_replay_endpoint_is_loopback():
    assert default_replay("tcp://*:5557") == "tcp://127.0.0.1:5558"
    assert default_replay("tcp://indexer:5557") is None            # connected: no replay unless named


def sub_bound(ctx, topic=b"kv"):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    return sub, sub.bind_to_random_port("tcp://127.0.0.1")


def test_a_subscriber_bound_first_gets_every_batch_from_seq_0():
    """The llm-d way: the subscriber binds, the publisher connects and publishes at once. A PUB
    would drop what it sends before the subscription has come back over the new connection."""
    ctx = zmq.Context()
    sub, port = sub_bound(ctx)
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", block_size=16, topic="kv").attach(Engine())
    try:
        for i in range(5):                   # at once: the connection is not made yet
            pub.submit(stored(i))
        got = []
        while len(got) < 6:
            assert sub.poll(10_000), f"batches after {[s for s, _ in got]} never came"
            topic, seq, payload = sub.recv_multipart()
            got.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)[1]))
        assert [s for s, _ in got] == list(range(6)) and pub.subscribed
        assert got[0][1] == [["AllBlocksCleared"]] and all(ev[0][0] == "BlockStored" for _, ev in got[1:])
    finally:
        pub.close()
        sub.close(0)
        ctx.term()


def test_connect_mode_without_a_subscriber_publishes_after_the_wait_and_replays():
    """Nobody listens where the publisher connects: after connect_wait_s the batches flow anyway
    (no unbounded queue), and the replay socket, named in connect mode, holds them from seq 0."""
    ctx = zmq.Context()
    with socket.socket() as free:            # a port nobody listens on: a plain socket's, closed at once
        free.bind(("127.0.0.1", 0))          # (a zmq SUB's close is asynchronous: its I/O thread could
        port = free.getsockname()[1]         # still take the connection and send its subscription)
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", "tcp://127.0.0.1:*", block_size=16, topic="kv",
                           connect_wait_s=0.3).attach(Engine())
    try:
        for i in range(3):
            pub.submit(stored(i))
        deadline = time.monotonic() + 10
        while pub._seq < 4:
            assert time.monotonic() < deadline, "the batches waited past connect_wait_s"
            time.sleep(0.02)
        assert not pub.subscribed and pub.replay_address is not None
        d = dealer(ctx, pub.replay_address)
        d.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            assert d.poll(5000)
            _, seq, _ = d.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            seqs.append(int.from_bytes(seq, "big"))
        d.close(0)
        assert seqs == [0, 1, 2, 3]
    finally:
        pub.close()
        ctx.term()
