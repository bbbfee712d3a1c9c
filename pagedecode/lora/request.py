"""pd.LoRARequest: which adapter a request runs under (a name, and the folder PEFT saved it to)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name and path: PEFT's adapter_config.json and adapter_model.safetensors in
    the folder `path`. The name identifies it to the engine (first use loads it; the prefix cache
    keys pages by it and a digest of its weights)."""
    name: str
    path: str | Path

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or len(self.name) > 256:
            raise InvalidRequestError(f"LoRARequest.name must be a non-empty str of at most 256 characters, "
                                      f"got {self.name!r}")
        if not isinstance(self.path, (str, Path)) or not str(self.path):
            raise InvalidRequestError(f"LoRARequest.path must be a folder path, got {self.path!r}")
