"""Engine.from_pretrained: an engine over a checkpoint (a Hugging Face directory or a GGUF file),
in this process or over tensor-parallel worker processes; and what an EngineConfig sets on the
model it is given."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..protocols import Model, ModelParts
from .config import EngineConfig, SpeculativeConfig
from .process import return_freed_memory

if TYPE_CHECKING:
    from .engine import Engine

E = TypeVar("E", bound="Engine")


def from_pretrained(cls: type[E], path: str | Path, device: str = "cpu", dtype: Any = None,
                    tensor_parallel_size: int = 1, quantization: str | None = None,
                    tokenizer: str | Path | None = None, **engine_options: Any) -> E:
    """path: a Hugging Face directory or a GGUF file, or a Hugging Face repository id (ORG/NAME,
    ORG/NAME:FILE.gguf: model/hub.py). quantization "q8_0" / "q4_0" / "q4_1" / "q5_0" / "q5_1"
    keeps the layer weights quantized in memory; tokenizer: a folder holding tokenizer.json to use
    instead of the model's own. tensor_parallel_size N > 1 starts N - 1 worker processes
    (model/parallel.py); the engine and every request stay in this one."""
    from ..model.hub import resolve_model
    from ..model.loader import load_model
    config = EngineConfig(**{"model_name": str(path), **engine_options})
    path = resolve_model(path)                 # ORG/NAME[:FILE.gguf]: from the Hugging Face cache
    config.speculative = with_self_draft(config.speculative, path)
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tensor_parallel_size!r}")
    if tensor_parallel_size == 1:
        model, tok = load_model(path, device=device, dtype=dtype, attention_backend=config.attention_backend,
                                quantization=quantization, tokenizer=tokenizer, cpu_matmul=config.cpu_matmul,
                                cpu_pack_weights=config.cpu_pack_weights)
        return_freed_memory()
        return _engine(cls, model, tok, config)
    if quantization is not None or tokenizer is not None or Path(path).is_file():
        raise ValueError("tensor_parallel_size > 1 takes a Hugging Face directory, without quantization "
                         "or tokenizer")
    from ..model.parallel import load_tensor_parallel
    model, tok = load_tensor_parallel(path, tensor_parallel_size, device=device, dtype=dtype,
                                      attention_backend=config.attention_backend)
    return _engine(cls, model, tok, config)


def with_self_draft(spec: SpeculativeConfig | None, path: str | Path) -> SpeculativeConfig | None:
    """spec with its self-draft's checkpoint named: method "draft" without a draft_model drafts
    with the checkpoint at `path` (the target's own), quantized as draft_quantization asks."""
    if spec is not None and spec.method == "draft" and spec.draft_model is None:
        return replace(spec, draft_model=path, self_draft=True)
    return spec


def _engine(cls: type[E], model: Any, tok: Any, config: EngineConfig) -> E:
    """The engine over a model just loaded; if the engine refuses it (an option that does not fit
    the model), the model's worker processes, if any, are stopped before the error goes up."""
    try:
        return cls(model, tok, config)
    except BaseException:
        ModelParts(model).close()
        raise


def configure(model: Model, config: EngineConfig) -> None:
    """A non-"auto" attention_backend, deterministic=True (refused for a model without a
    batch-invariant forward) and the compiled CPU forward's switches are set on the model (what
    the process gets, the engine's ProcessEffects applies: process.py)."""
    parts = ModelParts(model)
    if config.attention_backend != "auto" and parts.takes_attention_backend:
        parts.set_attention_backend(config.attention_backend)
    if config.deterministic:
        if not parts.takes_deterministic:
            raise ValueError(f"deterministic=True needs a model with a batch-invariant forward (a `deterministic` "
                             f"attribute, as pagedecode's own models have); {type(model).__name__} has none")
        parts.set_deterministic(True)
    parts.configure_cpu(config.cpu_matmul, config.cpu_pack_weights)
