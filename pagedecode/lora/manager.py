"""The engine's adapters: the ones loaded, by name (read and checked once, kept on the host), and
their residency in the device stacks (residency.py), made on first use.

A request names its adapter with a LoRARequest: the first one under a name loads it (outside the
engine's lock: reading and checking a file does not stall the steps); later ones reuse it. A name
already loaded from another folder is refused (unload it first), so a name means one set of
weights while it is loaded. `unload` forgets the name; requests already running keep their
adapter to the end."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from ..errors import AdapterError, UnknownAdapterError
from .adapter import LoRAAdapter, load_adapter
from .request import LoRARequest
from .residency import AdapterResidency
from .stacks import LoRAStacks, stack_dtype


def refusal(model: Any) -> str | None:
    """Why `model` cannot run adapters, or None when it can."""
    world = int(getattr(model, "world", 1))
    if world > 1:
        return f"LoRA adapters are not supported on a tensor-parallel model (tensor_parallel_size={world})"
    if not getattr(model, "applies_lora", False):
        return f"this model ({type(model).__name__}) does not apply LoRA adapters (a pd.LlamaModel does)"
    return None


class LoRAManager:
    def __init__(self, model: Any, max_loras: int, max_rank: int) -> None:
        self.model = model
        self.max_loras, self.max_rank = max_loras, max_rank
        self.loaded: dict[str, LoRAAdapter] = {}
        self._lock = threading.Lock()              # the loaded table: any thread may load
        self.stacks: LoRAStacks | None = None
        self.residency = AdapterResidency(max_loras, self._make_stacks)

    def _make_stacks(self) -> LoRAStacks:
        if self.stacks is None:
            self.stacks = LoRAStacks(self.model.config, self.max_loras, self.max_rank, stack_dtype(self.model),
                                     torch.device(getattr(self.model, "device", "cpu")))
        return self.stacks

    def resolve(self, lora: LoRARequest | None) -> LoRAAdapter | None:
        """The adapter a request names, loaded on first use (AdapterError: why it cannot run)."""
        if lora is None:
            return None
        if not isinstance(lora, LoRARequest):
            raise AdapterError(f"lora must be a pd.LoRARequest(name, path), got {type(lora).__name__}")
        with self._lock:
            found = self.loaded.get(lora.name)
        if found is not None:
            if Path(lora.path).resolve() != found.path.resolve():
                raise AdapterError(f"LoRA adapter {lora.name!r} is loaded from {found.path}, not {lora.path}: "
                                   "unload it first, or give the new one another name")
            return found
        return self.load(lora.name, lora.path)

    def load(self, name: str, path: str | Path) -> LoRAAdapter:
        """Read and check the adapter and keep it under `name` (a name in use: AdapterError)."""
        why = refusal(self.model)
        if why is not None:
            raise AdapterError(f"LoRA adapter {name!r}: {why}")
        if self.max_loras < 1:
            raise AdapterError(f"LoRA adapter {name!r}: this engine holds no adapters (max_loras=0)")
        adapter = load_adapter(name, path, self.model.config, self.max_rank)
        with self._lock:
            other = self.loaded.get(name)
            if other is not None and other.path.resolve() != adapter.path.resolve():
                raise AdapterError(f"LoRA adapter {name!r} is already loaded from {other.path}")
            return self.loaded.setdefault(name, adapter)

    def unload(self, name: str) -> LoRAAdapter:
        """Forget `name` (UnknownAdapterError when it is not loaded); the caller frees its slot
        (residency.forget) under the engine's lock."""
        with self._lock:
            adapter = self.loaded.pop(name, None)
        if adapter is None:
            raise UnknownAdapterError(f"LoRA adapter {name!r} is not loaded")
        return adapter

    def adapters(self) -> list[LoRAAdapter]:
        with self._lock:
            return [self.loaded[n] for n in sorted(self.loaded)]
