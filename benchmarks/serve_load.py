"""N concurrent streaming clients (the openai async client) against `pagedecode serve`, and the
same workload through AsyncEngine in-process, in one run: the HTTP layer's cost as a ratio.

    .venv/bin/python benchmarks/serve_load.py [--model DIR] [--clients 64] [--requests 256]
        [--max-tokens 64] [--out FILE]

Reports requests/s, output tokens/s, time to first token and inter-token latency p50/p90/p99
for both; JSON under benchmarks/results/ and a PNG of the latency distributions beside it.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from common import plot, result_path, write_json

PROMPTS = ["Once upon a time", "Lily and Tom", "The little dog", "One day, a girl", "Sam had a red ball"]


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(wall: float, ttft: list[float], itl: list[float], tokens: int, n: int) -> dict:
    return {"wall_s": wall, "requests_per_s": n / wall, "output_tokens_per_s": tokens / wall,
            **{f"ttft_p{int(q * 100)}_ms": 1000 * (pct(ttft, q) or 0) for q in (0.5, 0.9, 0.99)},
            **{f"itl_p{int(q * 100)}_ms": 1000 * (pct(itl, q) or 0) for q in (0.5, 0.9, 0.99)},
            "ttft_ms": [1000 * x for x in ttft], "itl_ms": [1000 * x for x in itl]}


async def run_http(url: str, args, progress) -> dict:
    import openai
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(args.clients)
    ttft, itl, tokens = [], [], 0

    async def one(i: int) -> None:
        nonlocal tokens
        async with sem:
            t0 = time.perf_counter()
            last = None
            stream = await client.completions.create(model="m", prompt=PROMPTS[i % len(PROMPTS)],
                                                     max_tokens=args.max_tokens, temperature=1.0, seed=i,
                                                     stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].text:
                    if last is None:
                        ttft.append(now - t0)
                    else:
                        itl.append(now - last)
                    last = now
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens
            progress()
    t = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(args.requests)))
    return summary(time.perf_counter() - t, ttft, itl, tokens, args.requests)


async def run_inprocess(engine, args, progress) -> dict:
    import pagedecode as pd
    sem = asyncio.Semaphore(args.clients)
    ttft, itl, tokens = [], [], 0
    async with pd.AsyncEngine(engine) as ae:
        async def one(i: int) -> None:
            nonlocal tokens
            async with sem:
                t0 = time.perf_counter()
                last = None
                params = pd.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i)
                async for ev in ae.submit(PROMPTS[i % len(PROMPTS)], params):
                    now = time.perf_counter()
                    if isinstance(ev, pd.DeltaEvent) and ev.text:
                        if last is None:
                            ttft.append(now - t0)
                        else:
                            itl.append(now - last)
                        last = now
                        tokens += len(ev.token_ids)
                progress()
        t = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(args.requests)))
        return summary(time.perf_counter() - t, ttft, itl, tokens, args.requests)


def start_server(model: str, batch: int | None, log_path: Path, extra: list[str] = (),
                 wait_s: float = 120) -> tuple[subprocess.Popen, str]:
    """`pagedecode serve` on a free loopback port, served as "m" (batch: --max-batch-size, None for
    the default; extra: more flags), and its URL once it listens. The server logs to a file (a pipe
    nobody drains would block it once full)."""
    log = open(log_path, "w")
    batch_flags = [] if batch is None else ["--max-batch-size", str(batch)]
    p = subprocess.Popen([sys.executable, "-m", "pagedecode.cli", "serve", "--model", str(model), "--host",
                          "127.0.0.1", "--port", "0", "--served-model-name", "m", *batch_flags, *extra],
                         stdout=log, stderr=subprocess.STDOUT, text=True)
    for _ in range(int(wait_s * 10)):
        for line in log_path.read_text().splitlines():
            if "Uvicorn running on" in line:
                return p, "http://127.0.0.1:" + line.rsplit(":", 1)[1].split()[0]
        if p.poll() is not None:
            break
        time.sleep(0.1)
    p.kill()
    raise RuntimeError(f"the server did not start; see {log_path}:\n{log_path.read_text()[-2000:]}")


def draw_latencies(axes, result: dict) -> None:
    for ax, key, title in ((axes[0], "ttft_ms", "time to first token (ms)"),
                           (axes[1], "itl_ms", "inter-token latency (ms)")):
        for name in ("http", "in_process"):
            xs = sorted(result[name][key])
            if xs:
                ax.plot(xs, [i / len(xs) for i in range(len(xs))], label=name.replace("_", "-"))
        ax.set_xscale("log")
        ax.set_title(title)
        ax.set_ylabel("fraction of samples")
        ax.legend()
    axes[0].figure.suptitle(f"pagedecode serve vs AsyncEngine: {result['clients']} clients, "
                            f"{result['requests']} requests")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.environ.get("PAGEDECODE_STORIES"),
                    help="model directory (default: $PAGEDECODE_STORIES, else the built-in model)")
    ap.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    ap.add_argument("--requests", type=int, default=256, help="requests in all (default 256)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    ap.add_argument("--out", default=None, help="JSON path (default: a new file under benchmarks/results/)")
    args = ap.parse_args(argv)
    import pagedecode as pd
    from pagedecode.model.default_model import default_model_path
    model = args.model or str(default_model_path())
    from tqdm import tqdm
    bar = tqdm(total=2 * args.requests, desc="requests", file=sys.stderr)
    import tempfile
    proc, url = start_server(model, args.clients, Path(tempfile.mkdtemp()) / "serve.log")
    try:
        http = asyncio.run(run_http(url, args, lambda: bar.update(1)))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    engine = pd.Engine.from_pretrained(model, max_batch_size=args.clients)
    inproc = asyncio.run(run_inprocess(engine, args, lambda: bar.update(1)))
    bar.close()
    result = {"date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "model": model, "clients": args.clients, "requests": args.requests,
              "max_tokens": args.max_tokens, "http": http, "in_process": inproc,
              "ratio_tokens_per_s": http["output_tokens_per_s"] / inproc["output_tokens_per_s"]}
    for name in ("http", "in_process"):
        r = result[name]
        print(f"{name:>10}: {r['requests_per_s']:.1f} req/s, {r['output_tokens_per_s']:.0f} tok/s, "
              f"TTFT p50/p90/p99 {r['ttft_p50_ms']:.1f}/{r['ttft_p90_ms']:.1f}/{r['ttft_p99_ms']:.1f} ms, "
              f"ITL p50/p90/p99 {r['itl_p50_ms']:.1f}/{r['itl_p90_ms']:.1f}/{r['itl_p99_ms']:.1f} ms")
    print(f"HTTP / in-process tokens/s: {result['ratio_tokens_per_s']:.2f}")
    out = result_path("serve_load", args.out)
    write_json(out, result)
    plot(out, lambda axes: draw_latencies(axes, result), size=(11, 4), ncols=2)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
