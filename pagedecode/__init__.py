"""pagedecode: a decode runtime for Llama-family models on a paged KV cache.

Triton kernels for paged attention and sampling on CUDA, torch references everywhere else,
under a small runtime that owns the page table, batch slots, continuous batching, safe-point
cancellation and the step-state invariants.
"""
from . import env as _env

with _env.openmp_spins_briefly():    # read by torch's OpenMP runtime as it loads: env.py
    import torch  # noqa: F401
from . import testing
from .errors import (AdapterError, DoubleReleaseError, ForgottenRequestError, IllegalTransitionError, InvalidRequestError,
                     ModelLoadError, ModelUnavailableError, PageDecodeError, UnknownAdapterError, UnknownRequestError)
from .lora.request import LoRARequest
from .model.batch import ForwardBatch
from .model.config import ModelConfig
from .model.kv_cache import KVCache
from .model.llama import LlamaModel
from .model.loader import load_model
from .model.tokenizer import Tokenizer, TokenizerLike, as_tokenizer
from .params import SamplingParams
from .structured import StructuredOutput
from .protocols import Model
from .runtime.async_engine import AsyncEngine
from .runtime.config import EngineConfig, SpeculativeConfig
from .runtime.engine import Engine
from .runtime.process import freeze_heap
from .runtime.output.events import DeltaEvent, StartEvent, TerminalEvent, Usage
from .runtime.output.result import STOP_RULE_VERSION, RequestOutput, Timings
from .runtime.lifecycle import ALLOWED, FinishReason, RequestState
from .runtime.snapshot import EngineSnapshot
from .runtime.trace import to_chrome, to_jsonl


__all__ = [
    "ALLOWED", "AdapterError", "AsyncEngine", "DeltaEvent", "DoubleReleaseError", "Engine", "EngineConfig", "EngineSnapshot",
    "FinishReason", "ForgottenRequestError", "StructuredOutput", "TokenizerLike", "as_tokenizer",
    "ForwardBatch", "IllegalTransitionError", "InvalidRequestError", "KVCache", "LlamaModel", "LoRARequest", "Model",
    "ModelConfig", "ModelLoadError", "ModelUnavailableError", "PageDecodeError", "RequestOutput", "RequestState", "SamplingParams",
    "SpeculativeConfig", "StartEvent", "STOP_RULE_VERSION", "TerminalEvent", "Timings", "Tokenizer", "UnknownAdapterError", "UnknownRequestError", "Usage", "load_model",
    "freeze_heap", "testing", "to_chrome", "to_jsonl",
]
__version__ = "0.1.0"
