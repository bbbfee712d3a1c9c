# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Each makes .venv on first use. torch is pinned to the CPU build on machines without CUDA
# (a plain `pip install torch` would pull a multi-GB CUDA build).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
PIP := $(BIN)/pip install --quiet --disable-pip-version-check

# --no-build-isolation: setup.py compiles csrc/cpu_forward.cpp against the venv's torch
$(BIN)/.installed: pyproject.toml setup.py csrc/cpu_forward.cpp
	$(PY) -m venv $(VENV)
	$(PIP) "$(TORCH_SPEC)" "setuptools>=68" wheel
	$(PIP) --no-build-isolation -e ".[test]"
	touch $@

.PHONY: install demo test bench clean
install: $(BIN)/.installed

demo: install
	$(BIN)/pagedecode demo $(ARGS)

test: install
	$(BIN)/mypy
	$(BIN)/python -m pytest tests $(PYTEST_ARGS)

bench: install
	$(PIP) -e ".[bench]"
	$(BIN)/python benchmarks/engine_vs_hf.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
