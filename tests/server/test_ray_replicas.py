"""Replicas on a real local Ray cluster (pagedecode.ray): two replicas of the built-in model behind
Ray Serve's HTTP proxy, driven by the official openai client (httpx where the frames themselves
are checked). One cluster for the module (Ray's start-up is most of the cost); the last test shuts
it down and checks that no Ray process is left."""
import json
import os
import signal
import socket
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'pagedecode[ray]')")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

from .conftest import TEMPLATE

APP = "pagedecode"
PREFIX = [(7 * i + 3) % 500 + 2 for i in range(512)]        # 512 token ids: 32 full pages


class Cluster:
    def __init__(self, url, pids, sub=None, others=frozenset()):
        self.url, self.pids, self.sub = url, pids, sub
        self.others = others           # this process' children that Ray did not start (other tests')
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        self.stopped = False

    def replicas(self):
        return httpx.get(self.url + "/v1/replicas", timeout=30).json()["replicas"]

    def ping(self, i):
        from ray import serve
        return serve.get_deployment_handle(f"replica-{i}", APP).ping.remote().result(timeout_s=120)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from ray import serve

    import pagedecode.ray as pdray
    others = frozenset(p.pid for p in psutil.Process().children(recursive=True))
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    except Exception as e:       # noqa: BLE001 - whatever keeps Ray from starting here is the reason
        pytest.skip(f"Ray cannot start on this machine: {type(e).__name__}: {e}")
    port = _free_port()
    ctx = sub = None
    try:
        import zmq
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        kv = f"tcp://127.0.0.1:{sub.bind_to_random_port('tcp://127.0.0.1')}"     # the replicas connect to it
    except ImportError:
        kv = None
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        template = tmp_path_factory.mktemp("ray") / "chat.jinja"        # the Responses API needs one
        template.write_text(TEMPLATE)
        app = pdray.build_app(None, 2, ray_actor_options={"num_cpus": 0.5}, torch_threads=1, max_batch_size=16,
                              health_check_period_s=1.0, grace_s=1.0, kv_events=kv, kv_events_topic="kv", chat_template=str(template))
        serve.run(app, name=APP, route_prefix="/", blocking=False)
        me = psutil.Process()
        pids = {p.pid for p in me.children(recursive=True)} - others
        c = Cluster(f"http://127.0.0.1:{port}", pids, sub, others)
        for i in range(2):
            c.ping(i)
        yield c
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        if sub is not None:
            sub.close(0)
            ctx.term()


# -- the router's choices, without a cluster -------------------------------------------------------
def _router(routing="prefix", cap=8):
    from pagedecode.ray import Router, Spec
    r = Router(Spec(model="m", served_model_name="m", routing=routing, prefix_load_cap=cap), None, None)
    return r


def test_round_robin_alternates_and_prefix_affinity_sticks_up_to_the_load_cap():
    rr = _router("round_robin")
    assert [rr.by_prefix([b"k"], {0, 1}) for _ in range(6)] == [0, 1, 0, 1, 0, 1]
    r = _router(cap=3)
    keys = [bytes([i]) * 32 for i in range(4)]
    first = r.by_prefix(keys, {0, 1})
    r.inflight[first] += 1
    picks = [first]
    for _ in range(4):              # the same prefix: its replica, until it has 3 more in flight
        picks.append(r.by_prefix(keys[:3] + [b"other" * 8], {0, 1}))
        r.inflight[picks[-1]] += 1
    assert picks[:3] == [first] * 3 and picks[3] != first


def test_a_long_prompts_keys_are_computed_off_the_event_loop_and_an_oversized_body_is_not_read():
    """The router keys a prompt in a worker thread: a long one must not hold up the requests it
    is routing meanwhile (the loop went on ticking). A body over the replicas' max_body_bytes
    (they answer 413) is not parsed at all."""
    import asyncio
    r = _router()
    r.routing_info = {"tokenizer": None, "template": (None, None), "page_size": 16}
    ids = [(7 * i + 3) % 500 + 2 for i in range(120_000)]
    body = json.dumps({"prompt": ids}).encode()
    assert len(body) < 1 << 20

    async def run():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1
        t = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        keys = await r.body_keys(body, chat=False)
        t.cancel()
        return keys, ticks
    keys, ticks = asyncio.run(run())
    # computed on the loop, no tick could run until it was done; in a thread the loop gets the GIL
    # at each switch interval (a few ticks; 1 is enough to tell)
    assert len(keys) == (len(ids) - 1) // 16 and ticks >= 1, ticks
    big = json.dumps({"prompt": ids * 2}).encode()
    assert len(big) > 1 << 20 and asyncio.run(r.body_keys(big, chat=False)) == []


def test_the_ring_keeps_a_keys_owner_and_skips_a_dead_one():
    from pagedecode.ray import Ring
    ring = Ring(3)
    owners = {k: ring.owner(f"key:{k}", {0, 1, 2}) for k in range(300)}
    assert set(owners.values()) == {0, 1, 2}
    moved = {k: ring.owner(f"key:{k}", {0, 2}) for k in range(300)}
    assert all(moved[k] == o for k, o in owners.items() if o != 1)      # only replica-1's keys move
    assert all(moved[k] in (0, 2) for k in owners)


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _replica(raw):
    return raw.headers["x-pagedecode-replica"]


def test_both_replicas_serve_and_name_themselves(cluster):
    seen = set()
    for k in range(6):
        raw = cluster.client.completions.with_raw_response.create(
            model="default-model-v2", prompt=f"Once upon a time {k}", max_tokens=4)
        out = raw.parse()
        seen.add(_replica(raw))
        assert out.id.startswith("req-r") and out.id == raw.headers["x-pagedecode-request-id"]
        assert out.id.startswith(f"req-r{_replica(raw).rsplit('-', 1)[1]}-")     # the id names its replica
    assert seen == {"replica-0", "replica-1"}


def test_the_router_refuses_what_no_replica_would_take_and_goes_on(cluster):
    """Answered by the router itself, as a replica would (OpenAI's error body): a body past
    max_body_bytes is 413 (not read whole, not parsed), a pin to no replica is 400 naming the
    header; a completion right after still runs."""
    big = b'{"prompt": "' + b"a" * (2 << 20) + b'", "max_tokens": 1}'
    r = httpx.post(cluster.url + "/v1/completions", content=big, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = httpx.post(cluster.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 1}, timeout=60,
                   headers={"X-Pagedecode-Replica": "replica-9"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Pagedecode-Replica", r.text
    out = cluster.client.completions.create(model="default-model-v2", prompt="Once", max_tokens=2,
                                            temperature=0)      # the server's default 1.0 drew EOS ~1% of runs
    assert out.choices[0].finish_reason == "length"


def test_same_idempotency_key_is_one_generation_over_20_retries(cluster):
    key = f"retry-{time.time_ns()}"
    outs = [cluster.client.completions.with_raw_response.create(
        model="default-model-v2", prompt="Tell me a story", max_tokens=12, temperature=1.0,
        extra_headers={"Idempotency-Key": key}) for _ in range(20)]
    ids = {o.parse().id for o in outs}
    texts = {o.parse().choices[0].text for o in outs}
    assert len(ids) == 1 and len(texts) == 1
    assert len({_replica(o) for o in outs}) == 1


def test_resume_through_the_events_endpoint_on_the_owning_replica(cluster):
    with httpx.stream("POST", cluster.url + "/v1/completions", timeout=60,
                      json={"prompt": "The little dog", "max_tokens": 40, "stream": True, "temperature": 0,
                            "ignore_eos": True, "on_disconnect": "continue"}) as r:
        assert r.status_code == 200
        rid = r.headers["x-pagedecode-request-id"]
        seen = []
        for line in r.iter_lines():
            if line.startswith("id: "):
                seen.append(int(line[4:]))
            if len(seen) == 3:
                break
    resumed, done = [], False
    with httpx.stream("GET", f"{cluster.url}/v1/requests/{rid}/events", headers={"Last-Event-ID": str(seen[-1])},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["x-pagedecode-replica"] == f"replica-{rid[5]}"
        for line in r.iter_lines():
            if line.startswith("id: "):
                resumed.append(int(line[4:]))
            done = done or line == "data: [DONE]"
    assert resumed and resumed[0] == seen[-1] + 1 and resumed == list(range(resumed[0], resumed[-1] + 1))
    assert done


def test_a_stored_response_is_retrieved_and_deleted_on_the_replica_that_made_it(cluster):
    """Responses API ids name their replica (resp_rN-...), as request ids do: retrieving,
    cancelling or deleting one reaches the replica that holds it, whichever replica made it."""
    made = {}
    for k in range(6):
        raw = cluster.client.responses.with_raw_response.create(model="default-model-v2", input=f"Once {k}",
                                                               max_output_tokens=3, temperature=0)
        made[raw.parse().id] = _replica(raw)
    assert len(set(made.values())) == 2, made          # least loaded ties alternate: both made some
    for rid, name in made.items():
        assert rid.startswith(f"resp_r{name[-1]}-"), rid
        raw = cluster.client.responses.with_raw_response.retrieve(rid)
        assert _replica(raw) == name and raw.parse().id == rid and raw.parse().status == "incomplete"   # max_output_tokens
        cluster.client.responses.delete(rid)
        with pytest.raises(openai.NotFoundError):
            cluster.client.responses.retrieve(rid)


def test_prefix_affinity_lands_on_one_replica_and_hits_its_cache(cluster):
    used, cached = [], []
    for k in range(6):
        raw = cluster.client.completions.with_raw_response.create(
            model="default-model-v2", prompt=PREFIX + [10 + k, 20 + k, 30 + k], max_tokens=2, temperature=0)
        used.append(_replica(raw))
        cached.append(raw.parse().usage.prompt_tokens_details.cached_tokens)
    assert len(set(used)) == 1, used
    assert cached[0] == 0 and all(c >= 512 for c in cached[1:]), cached
    other = "replica-1" if used[0] == "replica-0" else "replica-0"
    assert all(r["in_flight"] == 0 for r in cluster.replicas())
    # the other replica never saw the prefix: a pinned request there computes it all
    raw = cluster.client.completions.with_raw_response.create(
        model="default-model-v2", prompt=PREFIX + [1, 2, 3], max_tokens=1, extra_headers={"X-Pagedecode-Replica": other})
    assert _replica(raw) == other and raw.parse().usage.prompt_tokens_details.cached_tokens == 0


def test_each_replica_publishes_kv_events_as_its_data_parallel_rank(cluster):
    msgpack = pytest.importorskip("msgpack")
    if cluster.sub is None:
        pytest.skip("pyzmq is not installed")
    ranks, deadline, n = set(), time.monotonic() + 60, 0
    while ranks != {0, 1}:       # new pages on each replica until both ranks' batches came through
        assert time.monotonic() < deadline, f"KV events only from ranks {ranks}"
        n += 1
        for i in range(2):
            cluster.client.completions.create(model="default-model-v2", prompt=[n % 400 + 3 + i] * 40,
                                              max_tokens=1, extra_headers={"X-Pagedecode-Replica": f"replica-{i}"})
        while cluster.sub.poll(300):
            topic, _, payload = cluster.sub.recv_multipart()
            ts, events, rank = msgpack.unpackb(payload)
            assert topic == b"kv" and events
            ranks.add(rank)


def test_a_replica_killed_mid_stream_ends_its_streams_with_an_error_and_comes_back(cluster):
    key = f"doomed-{time.time_ns()}"
    body = {"prompt": "Once", "max_tokens": 900, "stream": True, "ignore_eos": True}
    lines = []
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, headers={"Idempotency-Key": key},
                      timeout=120) as r:
        assert r.status_code == 200
        name = r.headers["x-pagedecode-replica"]
        index = int(name.rsplit("-", 1)[1])
        it = r.iter_lines()
        while sum(ln.startswith("id: ") for ln in lines) < 2:
            lines.append(next(it))
        pid = cluster.ping(index)["pid"]
        os.kill(pid, signal.SIGKILL)
        lines.extend(it)
    data = [ln[6:] for ln in lines if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    err = json.loads(data[-2])["error"]
    assert err["code"] == "replica_failed" and name in err["message"]
    # the same key again runs anew, to the end, on a live replica
    out = cluster.client.completions.create(model="default-model-v2", prompt="Once", max_tokens=5, temperature=0,
                                            extra_headers={"Idempotency-Key": key})
    assert out.choices[0].finish_reason == "length"
    # Ray Serve starts a replacement; the router routes to it again
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if not any(r["down"] for r in cluster.replicas()):
            break
        time.sleep(0.5)
    assert not any(r["down"] for r in cluster.replicas())
    assert cluster.ping(index)["pid"] != pid
    raw = cluster.client.completions.with_raw_response.create(
        model="default-model-v2", prompt="Once", max_tokens=2, extra_headers={"X-Pagedecode-Replica": name})
    assert _replica(raw) == name and raw.parse().choices[0].text is not None


def test_shutdown_leaves_no_ray_process(cluster):
    from ray import serve
    pids = (cluster.pids | {p.pid for p in psutil.Process().children(recursive=True)}) - cluster.others
    assert pids, "Ray started no process?"
    serve.shutdown()
    ray.shutdown()
    deadline = time.monotonic() + 60
    left = pids
    while time.monotonic() < deadline:
        left = {p for p in pids if _alive(p)}
        if not left:
            break
        time.sleep(0.25)
    assert not left, [_describe(p) for p in left]


def _describe(pid):
    try:
        p = psutil.Process(pid)
        return pid, p.status(), p.name(), " ".join(p.cmdline())[:200], p.ppid()
    except psutil.NoSuchProcess:
        return pid, "gone"
