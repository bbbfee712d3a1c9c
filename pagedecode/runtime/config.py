"""EngineConfig: every engine option, validated once."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .. import env
from ..kernels._backend import BACKENDS
from ..model.quant import QUANTIZATIONS
from .threads import default_num_threads
from .trace import TRACE_LEVELS

BACKPRESSURE_POLICIES = ("pause", "fail")
SPECULATIVE_METHODS = ("ngram", "draft")
# the KV cache's default size: a full context per batch slot, within this many bytes (as llama.cpp's
# default context is 4,096 tokens whatever the model's: SmolLM2-135M's float32 KV then holds 2,912
# tokens, and the server stays near 600 MB resident); --kv-cache-memory / max_cache_tokens for more
DEFAULT_KV_BUDGET_BYTES = 128 << 20
CPU_MATMULS = ("onednn", "aten")
# kv_cache_dtype: "auto" (the model's dtype), a float type, under its usual names (kept as the first),
# or an 8-bit type with a float32 scale per token and KV head (kernels/kv_quant.py)
KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "fp32": torch.float32, "f32": torch.float32,
                   "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                   "float16": torch.float16, "fp16": torch.float16, "f16": torch.float16, "half": torch.float16,
                   "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn}
KV_CACHE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                  torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3"}


@dataclass
class EngineConfig:
    page_size: int = 16                      # tokens per KV page
    max_cache_tokens: int | None = None      # KV capacity in tokens (rounded down to pages)
    memory_budget_bytes: int | None = None   # or KV capacity as bytes; at most one of the two
    max_batch_size: int = 64                 # batch slots: requests running at once
    max_tokens_per_step: int = 512           # token budget of one step (decodes + prefill chunks)
    max_context: int | None = None           # cap below the model's own context length
    stream_max_events: int = 64              # a streaming request's outgoing buffer, in events
    stream_max_bytes: int = 1 << 20          # ... and in bytes of text
    backpressure: str = "pause"              # full buffer: "pause" the request, or "fail" it
    backpressure_timeout_s: float = 30.0     # with "fail": how long a buffer may stay full
    attention_backend: str = "auto"          # "auto" | "triton" | "torch"
    sampling_backend: str = "auto"
    seed: int | None = None                  # draws the seeds of requests that give none
    max_finished_kept: int = 10_000          # finished requests whose result / replay / trace stay
                                             # readable; the oldest are forgotten first
    max_finished_bytes: int | None = 256 << 20   # ... and at most this many bytes of them (estimated)
    trace: str = "lifecycle"                 # "off" | "lifecycle" | "tokens": what each request's
                                             # trace keeps (see runtime/trace.py)
    model_name: str | None = None            # shown in start events
    request_id_prefix: str = "req-"          # generated request ids: this and 128 random bits (a
                                             # replica's own prefix lets a router find it: ray.py)
    enable_prefix_caching: bool = True       # share full prompt / output pages between requests
    grammar_compile_timeout_s: float = 60.0  # a structured-output parse + compile longer than this fails its request
    grammar_cache_size: int = 64             # compiled grammars kept, by constraint, LRU
    grammar_cache_bytes: int = 256 << 20     # ... and at most this many bytes of them (xgrammar's own count)
    max_schema_depth: int = 64               # JSON nesting depth of a json_schema constraint (deeper: refused)
    max_schema_bytes: int = 32 << 10         # size of any constraint: schema JSON, regex, EBNF, choices
    deterministic: bool = False              # a request's logits the same bits whatever else runs (batch,
                                             # chunking, prefix cache, preemption, threads): batch-invariant
                                             # kernels (csrc/cpu_forward.cpp, kernels/), fixed-order all-reduce
    enforce_eager: bool = False              # CUDA: run every step eagerly, no decode graphs (model/cuda_graphs.py)
    # the compiled CPU forward (csrc/cpu_forward.cpp): each default comes from the environment
    # variable named, read when the config is made (env.py); a value given here wins over it
    cpu_matmul: str = field(default_factory=env.cpu_matmul)
                                             # its larger matmuls: "onednn" (oneDNN's linear) or "aten"
                                             # (at::mm); PAGEDECODE_CPU_MATMUL=aten sets the default
    cpu_pack_weights: bool = field(default_factory=env.cpu_pack_weights)
                                             # a second copy of each float weight in oneDNN's blocked
                                             # layout: 8-52-row float32 matmuls 1.3-2.5x faster, at twice
                                             # the weights' memory; off by default (one resident copy),
                                             # PAGEDECODE_CPU_PACK=1 turns it on
    cpu_keep_freed_memory: bool = field(default_factory=env.keep_freed_memory)
                                             # glibc keeps what a step frees for the next (mallopt, applied
                                             # by the engine, once per process); PAGEDECODE_MALLOC=default: not
    num_threads: int | None = None           # the CPU forward's threads (torch's intra-op count, which the
                                             # compiled forward's pool takes): set by the engine, put back
                                             # when it shuts down; None: the physical cores this process
                                             # may use, within its cgroup quota (runtime/threads.py)
    speculative: "SpeculativeConfig | None" = None   # speculative decoding (runtime/spec/speculative.py); None: off
    max_loras: int = 4                       # LoRA adapters resident at once (their stacked weights are made on
                                             # the first adapter's use; 0: none served); more adapters wait
                                             # their turn, the least recently used evicted when none runs
    max_lora_rank: int = 64                  # the largest adapter rank served: the stacks' padded rank
    kv_cache_dtype: "str | torch.dtype" = "auto"   # the KV cache's element type: "auto" (the model's dtype),
                                             # "bfloat16" / "float16" (half a float32 model's cache bytes:
                                             # K/V rounded once when written, attention still in float32)
                                             # or "float32"; "int8" / "fp8_e4m3" (8 bits and a float32
                                             # scale per token and KV head: ~1.9x float16's tokens per
                                             # byte; kernels/kv_quant.py); an alias (bf16, fp16, ...)
                                             # or a torch dtype is kept as that name

    def threads(self) -> int:
        """num_threads, or the default for this process when it is None."""
        return self.num_threads if self.num_threads is not None else default_num_threads()

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's torch dtype for a model computing in model_dtype."""
        return KV_CACHE_DTYPES[str(self.kv_cache_dtype)] or model_dtype

    def kv_pages(self, bytes_per_token: int, model_context: int) -> int:
        """How many KV pages the engine allocates: memory_budget_bytes or max_cache_tokens, else
        what the batch and the context need, max_batch_size x context tokens, within
        DEFAULT_KV_BUDGET_BYTES:
            min(max_batch_size x context, DEFAULT_KV_BUDGET_BYTES / bytes_per_token)
        (rounded down to whole pages; `context` is max_context, else the model's). A pool smaller
        than the context also bounds the context (Engine.max_context)."""
        if self.memory_budget_bytes is not None:
            tokens = self.memory_budget_bytes // bytes_per_token
        elif self.max_cache_tokens is not None:
            tokens = self.max_cache_tokens
        else:
            tokens = min(self.max_batch_size * model_context, DEFAULT_KV_BUDGET_BYTES // bytes_per_token)
        if tokens < self.page_size:
            raise ValueError(f"KV capacity of {tokens} tokens holds no page of {self.page_size}")
        return tokens // self.page_size

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.max_cache_tokens is not None and self.memory_budget_bytes is not None:
            raise ValueError("give max_cache_tokens or memory_budget_bytes, not both")
        for name in ("max_cache_tokens", "memory_budget_bytes", "max_context", "num_threads"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        for name in ("max_batch_size", "max_tokens_per_step", "stream_max_events", "stream_max_bytes",
                     "max_finished_kept", "grammar_cache_size", "grammar_cache_bytes", "max_schema_depth",
                     "max_schema_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.backpressure not in BACKPRESSURE_POLICIES:
            raise ValueError(f"backpressure must be one of {BACKPRESSURE_POLICIES}, got {self.backpressure!r}")
        if self.backpressure_timeout_s <= 0:
            raise ValueError("backpressure_timeout_s must be > 0")
        if self.cpu_matmul not in CPU_MATMULS:
            raise ValueError(f"cpu_matmul must be one of {CPU_MATMULS}, got {self.cpu_matmul!r}")
        for name in ("attention_backend", "sampling_backend"):
            if getattr(self, name) not in BACKENDS:
                raise ValueError(f"{name} must be one of {BACKENDS}, got {getattr(self, name)!r}")
        if self.trace not in TRACE_LEVELS:
            raise ValueError(f"trace must be one of {TRACE_LEVELS}, got {self.trace!r}")
        for name in ("deterministic", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(f"speculative must be a pd.SpeculativeConfig or None, got {type(self.speculative).__name__}")
        kv = KV_CACHE_NAMES.get(self.kv_cache_dtype, self.kv_cache_dtype) if isinstance(
            self.kv_cache_dtype, torch.dtype) else self.kv_cache_dtype
        if not isinstance(kv, str) or kv.lower() not in KV_CACHE_DTYPES:
            raise ValueError("kv_cache_dtype must be one of auto, float32, bfloat16, float16, int8, fp8_e4m3 (or "
                             "fp32 / f32, bf16, fp16 / f16 / half, float8_e4m3fn, or one of those torch dtypes), "
                             f"got {self.kv_cache_dtype!r}")
        dtype = KV_CACHE_DTYPES[kv.lower()]
        self.kv_cache_dtype = "auto" if dtype is None else KV_CACHE_NAMES[dtype]
        if not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise ValueError(f"max_loras must be an integer >= 0, got {self.max_loras!r}")
        if not isinstance(self.max_lora_rank, int) or not 1 <= self.max_lora_rank <= 1024:
            raise ValueError(f"max_lora_rank must be an integer in [1, 1024], got {self.max_lora_rank!r}")
        if self.max_finished_bytes is not None and self.max_finished_bytes < 1:
            raise ValueError(f"max_finished_bytes must be >= 1 or None, got {self.max_finished_bytes}")


@dataclass
class SpeculativeConfig:
    """Speculative decoding: propose up to `num_tokens` tokens per request and step, verify them
    in one forward pass, keep exactly the ones the engine would have chosen anyway; with
    method="draft", a sampling request without penalties, bias, grammar, pending min_tokens or
    logprobs takes the rejection rule instead (its tokens follow the target's distribution
    exactly, not token for token: runtime/spec/rejection.py)."""
    method: str = "ngram"                    # "ngram": prompt lookup in the request's own tokens;
                                             # "draft": a smaller model with the same tokenizer
    num_tokens: int = 4                      # k: draft tokens proposed per request and step
    min_ngram: int = 2                       # n-gram: the shortest suffix matched ...
    max_ngram: int = 4                       # ... and the longest (tried first)
    draft_model: Any = None                  # "draft": a pd.Model, or a directory / GGUF file to load
    draft_quantization: str | None = None    # "draft": load the draft quantized ("q8_0", "q4_0", ...); without
                                             # draft_model, the target's own checkpoint (a self-draft:
                                             # Engine.from_pretrained passes its path)
    self_draft: bool = False                 # "draft": draft_model is the target's own checkpoint (set by
                                             # Engine.from_pretrained for a self-draft): the draft then reads
                                             # and writes the target's KV cache, no cache or prefill of its own
    prompt_lookup: bool = False              # "draft": a request whose own tokens hold an n-gram match drafts
                                             # from it (min_ngram .. max_ngram), the draft model for the
                                             # others: input-grounded text copies whole runs at no draft cost
    min_draft_confidence: float = 0.0        # "draft": a run stops drafting once the draft's own probability
                                             # of its drafts so far (their probabilities multiplied) falls
                                             # below this: each further draft costs a draft step and a verify
                                             # row, kept or not (0: always the run's length)
    max_batch: int = 8                       # no proposals while more requests than this decode (large
                                             # batches are compute-bound: verifying costs more; and a batch
                                             # lasts as long as its slowest request: 16 concurrent
                                             # stories260k requests took 256 steps with drafts or without)
    min_acceptance: float = 0.3              # per request: rolling acceptance below this turns
                                             # proposals off for it (0: never; and every run
                                             # proposes k, not the length its runs earned) ...
    backoff_steps: int = 8                   # ... for this many steps, doubled on every new miss
    min_gain: float = 0.97                   # per batch size: output tokens/s of steps that verify below
                                             # this times that of steps that do not turns proposals off
                                             # there for backoff_steps (doubling); 0: never

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if not isinstance(self.num_tokens, int) or not 1 <= self.num_tokens <= 64:
            raise ValueError(f"num_tokens must be an integer in [1, 64], got {self.num_tokens!r}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}")
        if self.method == "draft" and self.draft_model is None and self.draft_quantization is None:
            raise ValueError('method="draft" needs draft_model (a pd.Model or a model directory), or '
                             'draft_quantization for a self-draft through Engine.from_pretrained')
        if self.method == "ngram" and (self.draft_model is not None or self.draft_quantization is not None
                                       or self.self_draft or self.prompt_lookup):
            raise ValueError('draft_model, draft_quantization and prompt_lookup are only for method="draft" '
                             '(method="ngram" is prompt lookup alone)')
        if self.draft_quantization is not None:
            if self.draft_quantization not in QUANTIZATIONS:
                raise ValueError(f"draft_quantization must be one of {', '.join(QUANTIZATIONS)}, "
                                 f"got {self.draft_quantization!r}")
        if not 0.0 <= self.min_draft_confidence <= 1.0:
            raise ValueError(f"min_draft_confidence must be in [0, 1], got {self.min_draft_confidence}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"min_acceptance must be in [0, 1], got {self.min_acceptance}")
        if not 0.0 <= self.min_gain <= 10.0:
            raise ValueError(f"min_gain must be in [0, 10], got {self.min_gain}")
        if self.backoff_steps < 1:
            raise ValueError(f"backoff_steps must be >= 1, got {self.backoff_steps}")
