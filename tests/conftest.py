import os

# Triton decides at decoration time whether to interpret: set this before any kernel import.
os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

SHARED = Path(os.environ.get("PAGEDECODE_SHARED", Path(__file__).resolve().parents[2] / "shared"))
STORIES = SHARED / "models" / "stories260k"


@pytest.fixture(scope="session")
def stories_path():
    if not (STORIES / "model.safetensors").is_file():
        pytest.skip(f"stories260k not found at {STORIES} (set PAGEDECODE_SHARED)")
    return STORIES


@pytest.fixture(scope="session")
def stories_engine_factory(stories_path):
    import pagedecode as pd

    def make(**options):
        return pd.Engine.from_pretrained(stories_path, **options)
    return make
