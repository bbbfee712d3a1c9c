"""The built-in random model, its transformers twin, and peft adapters over it (shared by this
folder's tests: made once a session)."""
import pytest
import torch

import pagedecode as pd

from .helpers import peft_adapter

PROMPTS = [[1, 403, 407, 261, 378], [1, 291, 280, 294, 17, 99, 300, 12, 45, 46, 47, 48, 400, 3, 4, 5, 6, 7],
           [1, 5]]
ADAPTERS = {"r8": dict(r=8, alpha=16), "r64": dict(r=64, alpha=32, use_rslora=True),
            "qvd8": dict(r=8, alpha=8, targets=["q_proj", "v_proj", "down_proj"])}


@pytest.fixture(scope="session")
def base():
    """(the built-in model's folder, the same model in transformers)"""
    transformers = pytest.importorskip("transformers")
    from pagedecode.model.default_model import default_model_path
    path = default_model_path()
    return path, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def adapters(base, tmp_path_factory):
    """name -> (its folder, the peft model over the base: the reference)"""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("adapters")
    return {name: (root / name, peft_adapter(base[1], root / name, **opts)) for name, opts in ADAPTERS.items()}


def lora(adapters, name):
    return None if name is None else pd.LoRARequest(name, adapters[name][0])
