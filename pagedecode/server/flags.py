"""The `pagedecode serve` command line: its flags (and the model flags generate and demo share),
and what they build: the engine options, the speculative config, the API keys, the allowed
hosts, the server options."""
from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from ..runtime.config import EngineConfig

# num_threads is --threads (add_model_arguments), as llama.cpp and vLLM name it
ENGINE_FLAGS = [f for f in fields(EngineConfig) if f.name not in ("model_name", "speculative", "num_threads")]


def engine_options(args: argparse.Namespace, leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
    """The EngineConfig fields the flags give, checked now (a bad one raises ValueError naming it,
    before any model loads or cluster starts)."""
    options = {f.name: getattr(args, "engine_" + f.name) for f in ENGINE_FLAGS if f.name not in leave_out}
    if getattr(args, "threads", None) is not None:
        options["num_threads"] = args.threads
    if getattr(args, "kv_cache_memory", None) is not None:
        options["memory_budget_bytes"] = args.kv_cache_memory
    EngineConfig(**options)
    return options


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default shown once: appended, unless the help already says it or there is
    nothing to say (None, whose meaning the help gives, and an off flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default" in text or action.default is None or (action.nargs == 0 and action.default is False):
            return text
        return super()._get_help_string(action)


def positive(text: str) -> int:
    """argparse's type for a count: an integer >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def lora_module(text: str) -> tuple[str, str]:
    """argparse's type for --lora-modules: NAME=PATH."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (an adapter's name and its PEFT folder), got {text!r}")
    return name.strip(), path.strip()


def byte_size(text: str) -> int:
    """argparse's type for a size: bytes, or a number with K, M, G (powers of 1024), e.g. 512M."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = units.get(t[-1:], 1)
    try:
        n = int(float(t[:-1] if t[-1:] in units else t) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 512M or 2G, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return n


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """What to load and where: --model, --quantization, --tokenizer, --device, --dtype,
    --tensor-parallel-size, --threads (generate, demo, chat and serve)."""
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory or GGUF file (default: the built-in tiny Llama)")
    p.add_argument("--quantization", default=None, choices=["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"],
                   help="keep the layer weights quantized in memory, as llama.cpp's reference quantizer makes "
                        "them (a GGUF's own blocks stay as the file has them anyway)")
    p.add_argument("--tokenizer", default=None, help="a folder holding tokenizer.json, instead of the model's own")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the weights' dtype, and the KV cache's unless --kv-cache-dtype says otherwise "
                        "(default: float32 on CPU, the checkpoint's on CUDA)")
    p.add_argument("--tensor-parallel-size", type=positive, default=1,
                   help="ranks the model is sharded over (processes started by the engine)")
    p.add_argument("--kv-cache-memory", type=byte_size, default=None, metavar="SIZE",
                   help="the KV cache's bytes (512M, 2G, or a number of bytes; EngineConfig.memory_budget_bytes). "
                        "Default: max batch x context tokens, within 128 MiB")
    p.add_argument("--threads", type=positive, default=None,
                   help="CPU threads of the forward (EngineConfig.num_threads; default: the physical cores this "
                        "process may use, within its cgroup CPU quota)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (loopback unless told otherwise)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY'; repeat it for more tenants (each key one tenant, "
                        "who sees only its own requests)")
    p.add_argument("--api-keys-file", default=None,
                   help="a file of API keys, one a line (blank lines and lines starting with # skipped)")
    p.add_argument("--metrics-public", action="store_true", help="serve /metrics without a key when keys are set")
    p.add_argument("--allowed-host", action="append", default=None,
                   help="a Host name the server answers to besides its address and localhost ('*': any); "
                        "repeatable")
    p.add_argument("--allow-special-tokens-in-content", action="store_true",
                   help="chat content's special-token strings ('</s>') become the real tokens (unsafe)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the folder name, or the GGUF file's without .gguf)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file (default: the model's)")
    p.add_argument("--chat-template-timeout", type=float, default=1.0,
                   help="seconds one chat template render may take (400 beyond)")
    p.add_argument("--chat-template-max-chars", type=positive, default=4 << 20,
                   help="characters a chat template render may produce, and any one value it builds (400 beyond)")
    p.add_argument("--max-queued-requests", type=int, default=256, help="waiting requests before 429")
    p.add_argument("--max-prompts-per-request", type=int, default=64,
                   help="prompts one completions request may batch (400 beyond); its choices, prompts x n, are at "
                        "most this or 16, whichever is more")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (413 beyond)")
    p.add_argument("--max-request-seconds", type=float, default=None, help="cap on timeout and first_token_timeout")
    p.add_argument("--max-tokens-cap", type=int, default=4096, help="largest max_tokens a request may ask")
    p.add_argument("--max-connections", type=int, default=None,
                   help="open connections at once; at the cap a new one closes the longest-idle one, or gets 503 "
                        "when every connection has a request running (default: 2048, less to fit the open-file limit)")
    p.add_argument("--max-connections-per-client", type=positive, default=None,
                   help="open connections from one client address; beyond, its own slow-body or idle connection "
                        "makes room, or it gets 429 (default: half of --max-connections; a proxy's clients share one)")
    p.add_argument("--min-body-rate", type=float, default=1024.0,
                   help="bytes/s: at the connection cap, a request body arriving slower is closed first (0: never)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds from connecting (or a kept-alive connection's next byte) to complete request headers")
    p.add_argument("--body-timeout", type=float, default=20.0,
                   help="seconds from the request headers to the body's last byte (408 and closed beyond)")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle connection is kept open between requests")
    p.add_argument("--grace-seconds", type=float, default=10.0, help="on shutdown, how long live requests may finish")
    p.add_argument("--log-text", action="store_true", help="include output text in the per-request log line")
    p.add_argument("--resume-grace", type=float, default=0.0,
                   help="seconds a disconnected stream waits for a client to resume it before it is cancelled")
    p.add_argument("--on-disconnect", default="cancel", choices=["cancel", "continue"],
                   help="what a client going away does to its request (a request's on_disconnect field overrides)")
    p.add_argument("--idempotency-ttl", type=float, default=600.0, help="seconds an Idempotency-Key is kept")
    p.add_argument("--idempotency-max-keys", type=int, default=10_000, help="most Idempotency-Keys kept")
    p.add_argument("--metrics-compat", default=None, choices=["vllm"],
                   help="also export the gauges an inference gateway reads under vLLM's names "
                        "(vllm:num_requests_waiting, ...), so llm-d / KServe can route to this server")
    p.add_argument("--lora-modules", nargs="+", type=lora_module, default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) served under their names: a request's model NAME runs under "
                        "it (--max-loras of them resident at once)")
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (403 otherwise)")
    p.add_argument("--tool-format", default=None, choices=["hermes", "llama3", "mistral", "generic"],
                   help="how the model writes tool calls (default: chosen from its chat template; generic for "
                        "a template without tool support)")
    p.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                   help="publish the prefix cache's changes in vLLM's KV-event format on this ZeroMQ endpoint "
                        "(tcp://*:5557 binds every interface, tcp://host:port connects; pagedecode[ray]). The events "
                        "carry every tenant's prompt token ids: bind a wildcard only on a trusted network")
    p.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT",
                   help="the KV events' replay socket, bound (default: loopback at the publisher's port + 1 when it "
                        "binds a port; with a connected --kv-events, none unless named here)")
    p.add_argument("--kv-events-topic", default="", help="the ZeroMQ topic of the KV events")
    p.add_argument("--ray", action="store_true",
                   help="serve replicas on Ray Serve (pagedecode[ray]): a local Ray cluster, or --ray-address's")
    p.add_argument("--replicas", type=int, default=2, help="with --ray: engine replicas, each one engine")
    p.add_argument("--ray-address", default=None, help="with --ray: join this Ray cluster instead of starting one")
    for f in ENGINE_FLAGS:
        flag = "--" + f.name.replace("_", "-")
        # a field whose default comes from the environment (default_factory) is read now
        default = f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default
        kind: Any = type(default) if default is not None else None
        extra: dict[str, Any] = {}
        if isinstance(default, bool):
            kind, extra = _bool, {"nargs": "?", "const": True}     # `--deterministic` alone means true
        if f.name in ("max_cache_tokens", "memory_budget_bytes", "max_context", "seed", "max_finished_bytes"):
            kind = int
        p.add_argument(flag, type=kind, default=default, dest="engine_" + f.name, metavar=f.name.upper(),
                       help=f"EngineConfig.{f.name}", **extra)
    add_speculative_arguments(p)


def add_sampling_arguments(p: argparse.ArgumentParser, max_tokens: int, temperature: float, per: str) -> None:
    """The sampling flags every generating command takes (generate, demo, chat); `per`: what one
    max_tokens and one drawn seed are for ("request", "reply")."""
    p.add_argument("--max-tokens", type=positive, default=max_tokens, help=f"most tokens to generate per {per}")
    p.add_argument("--temperature", type=float, default=temperature, help="0 selects greedily")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 disables)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass to keep, in (0, 1]")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="over prompt and output ids (1 disables)")
    p.add_argument("--seed", type=int, default=None, help=f"sampling seed (default: drawn per {per})")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    """--speculative-method, --num-speculative-tokens, --draft-model, --speculative-draft-quantization,
    --speculative-prompt-lookup, --speculative-min-draft-confidence (generate, demo and serve)."""
    p.add_argument("--speculative-method", default=None, choices=["ngram", "draft"],
                   help="speculative decoding: ngram (prompt lookup in each request's own tokens) or "
                        "draft (a smaller model, --draft-model); off by default")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="draft tokens proposed per step")
    p.add_argument("--draft-model", default=None, help="the draft model's directory (--speculative-method draft)")
    p.add_argument("--speculative-draft-quantization", default=None,
                   help="--speculative-method draft: load the draft quantized (q8_0, q4_0, ...); without "
                        "--draft-model the model's own weights so (a self-draft)")
    p.add_argument("--speculative-prompt-lookup", action="store_true",
                   help="--speculative-method draft: a request whose own tokens hold an n-gram match drafts "
                        "from it, the draft model for the others")
    p.add_argument("--speculative-min-draft-confidence", type=float, default=None,
                   help="--speculative-method draft: a run stops drafting once the draft's own probability of its "
                        "drafts so far falls below this (0: always --num-speculative-tokens)")


def speculative_config(args: argparse.Namespace) -> Any:
    """The SpeculativeConfig the flags ask for, or None; bad values raise ValueError."""
    from ..runtime.config import SpeculativeConfig
    if args.speculative_method is None:
        if args.draft_model is not None or args.speculative_draft_quantization is not None or \
                args.speculative_prompt_lookup or args.speculative_min_draft_confidence is not None:
            raise ValueError("--draft-model, --speculative-draft-quantization, --speculative-prompt-lookup and "
                             "--speculative-min-draft-confidence need --speculative-method draft")
        return None
    if args.speculative_method != "draft" and args.speculative_min_draft_confidence is not None:
        raise ValueError("--speculative-min-draft-confidence is only for --speculative-method draft")
    return SpeculativeConfig(method=args.speculative_method, num_tokens=args.num_speculative_tokens,
                             draft_model=args.draft_model, draft_quantization=args.speculative_draft_quantization,
                             prompt_lookup=args.speculative_prompt_lookup,
                             min_draft_confidence=args.speculative_min_draft_confidence or 0.0)


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def server_options(args: argparse.Namespace, keys: tuple[str, ...]) -> dict[str, Any]:
    """build_app's options (ServerOptions fields) from the command line."""
    from .protocol import Limits
    return dict(api_keys=keys, metrics_public=args.metrics_public, allowed_hosts=allowed_hosts(args),
                allow_special_tokens_in_content=args.allow_special_tokens_in_content,
                limits=Limits(max_tokens=args.max_tokens_cap, max_request_seconds=args.max_request_seconds),
                max_queued_requests=args.max_queued_requests, max_body_bytes=args.max_body_bytes,
                max_prompts_per_request=args.max_prompts_per_request, log_text=args.log_text,
                resume_grace_s=args.resume_grace, on_disconnect=args.on_disconnect,
                idempotency_ttl_s=args.idempotency_ttl, idempotency_max_keys=args.idempotency_max_keys,
                metrics_compat=args.metrics_compat, tool_format=args.tool_format,
                lora_modules=tuple(getattr(args, "lora_modules", ())),
                allow_runtime_lora=getattr(args, "allow_runtime_lora", False))


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The tenants' keys: every --api-key, then --api-keys-file's lines."""
    keys = list(args.api_key or [])
    if args.api_keys_file is not None:
        try:
            lines = Path(args.api_keys_file).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"--api-keys-file: {e}") from None
        listed = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not listed:                 # an empty file must not leave the server open
            raise ValueError(f"--api-keys-file {args.api_keys_file} holds no key")
        keys += listed
    if any(not k or k != k.strip() for k in keys):
        raise ValueError("an API key is empty or has surrounding whitespace")
    return tuple(keys)


def allowed_hosts(args: argparse.Namespace) -> tuple[str, ...]:
    """--allowed-host values and --host (a wildcard address such as 0.0.0.0 names no one: a
    connection's own address is accepted anyway, guard.py)."""
    import ipaddress
    try:
        wildcard = ipaddress.ip_address(args.host).is_unspecified
    except ValueError:
        wildcard = False
    return tuple(args.allowed_host or []) + (() if wildcard else (args.host,))
