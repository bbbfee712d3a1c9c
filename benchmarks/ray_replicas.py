"""Replicas on Ray Serve (pagedecode.ray) on this machine: one replica against two, and
prefix-affinity routing against round-robin, with 64 concurrent streaming clients.

Workloads (each client streams its requests one after another; TTFT is the time to the first
data chunk):
  independent    short distinct prompts: requests/s and TTFT, 1 replica vs 2
  shared-prefix  --prefixes prompts of --prefix-tokens tokens, each asked --uses times with a
                 distinct tail, in a shuffled order: the prefix-cache hit rate (prompt tokens
                 served from the cache / prompt tokens looked up, summed over the replicas'
                 /metrics) with prefix-affinity routing and with round-robin
Routing cost: the router's own time choosing a replica (tokenizing and keying the prompt, the
hash ring) per request, from GET /v1/replicas; and the whole Ray path (Serve's proxy, the router,
the handle call to the replica) as the median latency of a 1-token request through Ray with
one replica minus the same request to a plain in-process server over the same model.

The machine's load average is recorded before and after: on a shared 2-core VM the figures are
what that machine gave, not a capacity. JSON under benchmarks/results/ and a PNG beside it.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import plot, result_path, write_json  # noqa: E402

APP = "pagedecode-bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def stream_one(client: Any, url: str, body: dict, ttfts: list[float]) -> None:
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                first = time.perf_counter() - t0
    ttfts.append(first if first is not None else time.perf_counter() - t0)


async def run_clients(url: str, per_client: list[list[dict]]) -> dict:
    import httpx
    ttfts: list[float] = []
    limits = httpx.Limits(max_connections=len(per_client) + 8, max_keepalive_connections=len(per_client) + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker(bodies: list[dict]) -> None:
            for b in bodies:
                await stream_one(client, url, b, ttfts)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(b) for b in per_client))
        wall = time.perf_counter() - t0
    n = sum(len(b) for b in per_client)
    ttfts.sort()
    return {"requests": n, "wall_s": wall, "requests_per_s": n / wall, "ttft_p50_s": ttfts[len(ttfts) // 2],
            "ttft_p90_s": ttfts[int(len(ttfts) * 0.9)], "ttft_mean_s": statistics.fmean(ttfts)}


def cache_counters(url: str, replicas: int) -> tuple[float, float]:
    import httpx
    hits = queries = 0.0
    for i in range(replicas):
        text = httpx.get(url + "/metrics", headers={"X-Pagedecode-Replica": f"replica-{i}"}, timeout=60).text
        hits += metric(text, "pagedecode:prefix_cache_hits_total")
        queries += metric(text, "pagedecode:prefix_cache_queries_total")
    return hits, queries


def independent(args: argparse.Namespace, rng: random.Random) -> list[list[dict]]:
    return [[{"prompt": [rng.randrange(3, 500) for _ in range(24)], "max_tokens": args.max_tokens,
              "ignore_eos": True, "temperature": 0} for _ in range(args.per_client)] for _ in range(args.clients)]


def shared_prefix(args: argparse.Namespace, rng: random.Random) -> list[list[dict]]:
    prefixes = [[rng.randrange(3, 500) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)]
    bodies = [{"prompt": p + [rng.randrange(3, 500) for _ in range(8)], "max_tokens": args.max_tokens,
               "ignore_eos": True, "temperature": 0} for p in prefixes for _ in range(args.uses)]
    rng.shuffle(bodies)
    return [bodies[c::args.clients] for c in range(args.clients)]


def latency(url: str, n: int, headers: dict | None = None) -> float:
    import httpx
    times = []
    with httpx.Client(timeout=60) as c:
        for k in range(n + 3):
            t0 = time.perf_counter()
            c.post(url + "/v1/completions", json={"prompt": [5, 6, 7, 8 + k % 50], "max_tokens": 1},
                   headers=headers or {}).raise_for_status()
            if k >= 3:                   # the first few warm the path up
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def plain_server_latency(args: argparse.Namespace) -> float:
    """The same 1-token request to `pagedecode serve`'s app in this process (uvicorn, no Ray)."""
    import torch
    import uvicorn

    import pagedecode as pd
    from pagedecode.model.default_model import default_model_path
    from pagedecode.server import build_app
    from pagedecode.server.serve import lifespan
    torch.set_num_threads(1)
    engine = pd.Engine.from_pretrained(args.model or default_model_path(), max_batch_size=args.max_batch_size)
    ae = pd.AsyncEngine(engine)
    app = build_app(ae)
    app.router.lifespan_context = lifespan(ae, app, 1.0)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        return latency(f"http://127.0.0.1:{port}", args.latency_requests)
    finally:
        server.should_exit = True
        thread.join(30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in tiny Llama")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--per-client", type=int, default=2, help="independent requests per client")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prefixes", type=int, default=32)
    ap.add_argument("--prefix-tokens", type=int, default=256)
    ap.add_argument("--uses", type=int, default=4, help="requests per shared prefix")
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--latency-requests", type=int, default=40)
    ap.add_argument("--cpus", type=float, default=None, help="Ray's CPUs (default: this machine's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import httpx
    import ray
    from ray import serve

    import pagedecode.ray as pdray
    load_before = os.getloadavg()
    cpus = args.cpus or os.cpu_count() or 2
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    runs: list[dict] = []
    try:
        for replicas, routing in ((1, "prefix"), (2, "prefix"), (2, "round_robin")):
            per = cpus / replicas
            app = pdray.build_app(args.model, replicas, ray_actor_options={"num_cpus": min(1.0, per)},
                                  torch_threads=max(1, int(per)), max_batch_size=args.max_batch_size, routing=routing)
            t0 = time.perf_counter()
            serve.run(app, name=APP, route_prefix="/", blocking=False)
            started = time.perf_counter() - t0
            for i in range(replicas):        # each replica warm (first request loads kernels)
                httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 1}, timeout=120,
                           headers={"X-Pagedecode-Replica": f"replica-{i}"}).raise_for_status()
            rng = random.Random(0)
            run: dict[str, Any] = {"replicas": replicas, "routing": routing, "start_s": started}
            if routing == "prefix":
                run["independent"] = asyncio.run(run_clients(url, independent(args, rng)))
            h0, q0 = cache_counters(url, replicas)
            run["shared_prefix"] = asyncio.run(run_clients(url, shared_prefix(args, rng)))
            h1, q1 = cache_counters(url, replicas)
            run["shared_prefix"]["hit_rate"] = (h1 - h0) / max(1.0, q1 - q0)
            if replicas == 1:
                run["latency_1token_p50_s"] = latency(url, args.latency_requests)
            view = httpx.get(url + "/v1/replicas", timeout=60).json()
            run["routing_us_per_request"] = 1e6 * view["routing_s"] / max(1, view["routed"])
            run["affinity_hits"], run["routed"] = view["affinity_hits"], view["routed"]
            runs.append(run)
            print(run, flush=True)
            serve.delete(APP)
    finally:
        serve.shutdown()
        ray.shutdown()
    plain = plain_server_latency(args)
    ray_path = runs[0]["latency_1token_p50_s"]
    result = {"benchmark": "ray_replicas", "model": args.model or "built-in", "cpus": cpus,
              "machine_cores": os.cpu_count(), "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
              "args": vars(args), "runs": runs,
              "plain_server_latency_1token_p50_s": plain, "ray_path_latency_1token_p50_s": ray_path,
              "ray_path_adds_s": ray_path - plain}
    path = result_path("ray_replicas", args.out)
    write_json(path, result)

    def draw(axes: Any) -> None:
        a, b, c = axes
        ind = [r for r in runs if "independent" in r]
        a.bar([f"{r['replicas']} replica(s)" for r in ind], [r["independent"]["requests_per_s"] for r in ind])
        a.set_title(f"independent, {args.clients} clients: requests/s")
        b.bar([f"{r['replicas']} replica(s)" for r in ind], [r["independent"]["ttft_p50_s"] for r in ind])
        b.set_title("independent: TTFT p50 (s)")
        two = [r for r in runs if r["replicas"] == 2]
        c.bar([r["routing"] for r in two], [r["shared_prefix"]["hit_rate"] for r in two])
        c.set_title(f"shared prefix, 2 replicas: cache hit rate")
    plot(path, draw, size=(13, 4), ncols=3)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
