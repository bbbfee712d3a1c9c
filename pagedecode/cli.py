"""`pagedecode generate` streams one completion; `pagedecode demo` runs several concurrent
requests with a progress display and prints throughput, time to first token and
inter-token latency."""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from .errors import PageDecodeError
from .params import SamplingParams
from .runtime.events import DeltaEvent, TerminalEvent

DEMO_PROMPTS = ["The lighthouse keeper", "In the village below,", "A small river", "The old library",
                "When the storm came,", "The market opened", "Good tools are", "Numbers have"]


def _engine(args):
    from .runtime.engine import Engine
    from .model.default_model import default_model_path
    path = args.model or default_model_path()
    options = {"max_batch_size": max(8, getattr(args, "requests", 1))}
    return Engine.from_pretrained(path, device=args.device, dtype=args.dtype, **options)


def _sampling(args, seed=None) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed if seed is None else seed, stop=tuple(args.stop))


def cmd_generate(args) -> int:
    engine = _engine(args)
    rid = engine.add_request(args.prompt, _sampling(args))
    end = None
    while end is None:
        for ev in engine.step():
            if ev.request_id != rid:
                continue
            if isinstance(ev, DeltaEvent):
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            elif isinstance(ev, TerminalEvent):
                end = ev
    sys.stdout.write("\n")
    u = end.usage
    reason = end.finish_reason.value if end.finish_reason else "none"
    print(f"[{end.state.value}: {reason}; prompt {u.prompt_tokens} tokens, "
          f"selected {u.selected_tokens}, returned {u.returned_tokens} tokens / {u.returned_bytes} bytes]"
          + (f" error: {end.error}" if end.error else ""), file=sys.stderr)
    return 0 if end.error is None else 1


def cmd_demo(args) -> int:
    engine = _engine(args)
    prompts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(args.requests)]
    start = time.perf_counter()
    ids: list[str] = []
    arrival: dict[str, float] = {}
    stamps: dict[str, list[tuple[float, int]]] = {}
    texts: dict[str, str] = {}
    ends: dict[str, TerminalEvent] = {}
    for i, p in enumerate(prompts):
        rid = engine.add_request(p, _sampling(args, seed=(args.seed or 0) + i), request_id=f"demo-{i}")
        ids.append(rid)
        arrival[rid], stamps[rid], texts[rid] = time.perf_counter(), [], ""
    tty = sys.stdout.isatty()
    last_draw = 0.0
    while engine.has_unfinished():
        for ev in engine.step():
            if isinstance(ev, DeltaEvent):
                stamps[ev.request_id].append((time.perf_counter(), len(ev.token_ids)))
                texts[ev.request_id] += ev.text
            elif isinstance(ev, TerminalEvent):
                ends[ev.request_id] = ev
        now = time.perf_counter()
        if now - last_draw > (0.1 if tty else 1.0) or not engine.has_unfinished():
            last_draw = now
            _draw(ids, texts, ends, stamps, args.max_tokens, tty)
    wall = time.perf_counter() - start
    _report(ids, arrival, stamps, ends, wall)
    return 0


def _draw(ids, texts, ends, stamps, max_tokens, tty):
    lines = []
    for rid in ids:
        n = sum(k for _, k in stamps[rid])
        bar = "#" * int(20 * n / max_tokens)
        state = ends[rid].finish_reason.value if rid in ends else "running"
        tail = texts[rid].replace("\n", " ")[-40:]
        lines.append(f"{rid:>8} [{bar:<20}] {n:4d} tok {state:<18} {tail}")
    if tty:
        sys.stdout.write("\x1b[H\x1b[2J" + "\n".join(lines) + "\n")
    else:
        sys.stdout.write("\n".join(lines) + "\n---\n")
    sys.stdout.flush()


def _report(ids, arrival, stamps, ends, wall):
    total = sum(e.usage.returned_tokens for e in ends.values())
    ttft = [stamps[r][0][0] - arrival[r] for r in ids if stamps[r]]
    itl = [b[0] - a[0] for r in ids for a, b in zip(stamps[r], stamps[r][1:])]
    ms = lambda xs, f: f"{1000 * f(xs):8.2f}" if xs else "     n/a"   # noqa: E731
    print()
    print(f"{'requests':<28}{len(ids):>10}")
    print(f"{'tokens returned':<28}{total:>10}")
    print(f"{'wall time (s)':<28}{wall:>10.2f}")
    print(f"{'throughput (tok/s)':<28}{total / wall:>10.1f}")
    print(f"{'time to first token (ms)':<28} mean {ms(ttft, statistics.mean)}  p50 {ms(ttft, statistics.median)}"
          f"  max {ms(ttft, max)}")
    print(f"{'inter-token latency (ms)':<28} mean {ms(itl, statistics.mean)}  p50 {ms(itl, statistics.median)}"
          f"  max {ms(itl, max)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pagedecode", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("generate", "demo"):
        p = sub.add_parser(name)
        p.add_argument("--model", help="Hugging Face model directory (default: the built-in tiny Llama)")
        p.add_argument("--device", default="cpu")
        p.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16", "float16"])
        p.add_argument("--max-tokens", type=int, default=64 if name == "generate" else 48)
        p.add_argument("--temperature", type=float, default=0.0 if name == "generate" else 0.8)
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--seed", type=int, default=None)
        p.add_argument("--stop", action="append", default=[])
        if name == "generate":
            p.add_argument("--prompt", required=True)
        else:
            p.add_argument("--requests", type=int, default=8)
    args = ap.parse_args(argv)
    try:
        return cmd_generate(args) if args.cmd == "generate" else cmd_demo(args)
    except PageDecodeError as e:
        print(f"pagedecode: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
