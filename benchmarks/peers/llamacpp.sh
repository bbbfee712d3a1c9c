#!/usr/bin/env bash
# Builds llama.cpp (CPU) from the llama-cpp-python source distribution on PyPI into
# benchmarks/.cache/llamacpp (ignored), and converts checkpoints to GGUF with llama.cpp's own
# convert script. engine_vs_hf.py uses the build when it is there.
#
#   benchmarks/peers/llamacpp.sh                 # build what bin/ lacks, and convert stories260k
#   benchmarks/peers/llamacpp.sh convert DIR [OUT.gguf [f32|bf16]]   # one Hugging Face folder -> GGUF
#   benchmarks/peers/llamacpp.sh quantize IN.gguf OUT.gguf q8_0|q4_0  # llama-quantize --pure (every matrix)
#   LLAMACPP_PRE=gpt-2 ... convert DIR      # a tokenizer llama.cpp does not recognise: name its pre-tokenizer
#
# The build is incremental: a tool missing from bin/ is built as its one cmake target in the kept
# build tree (llama-perplexity, llama-tokenize added later need no rebuild of the rest), and the peer
# tools (peers/*.cpp: pd-greedy, pd-logits) are recompiled when their source is newer.
# LLAMACPP_CACHE=DIR: another checkout's build (a git worktree beside the main one).
# Needs: cmake, a C++ compiler, pip access to PyPI. Version: LLAMA_CPP_PYTHON (default below).
set -euo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${LLAMACPP_CACHE:-$HERE/.cache/llamacpp}"
VERSION="${LLAMA_CPP_PYTHON:-0.3.36}"
PY="${PYTHON:-$HERE/../.venv/bin/python}"
[ -x "$PY" ] || PY=python3

TOOLS=(llama-bench llama-batched-bench llama-parallel llama-quantize llama-lookup llama-perplexity llama-tokenize)
PEERS=(greedy logits)          # peers/NAME.cpp -> bin/pd-NAME, linked against the same libraries

build() {  # only what bin/ lacks: one cmake target, or one peer tool, at a time (the tree is kept)
  mkdir -p "$CACHE/src" "$CACHE/bin"
  if [ ! -d "$CACHE/src/vendor/llama.cpp" ]; then
    "$PY" -m pip download --quiet --no-deps --no-binary :all: --dest "$CACHE/dl" "llama-cpp-python==$VERSION"
    tar -xzf "$CACHE"/dl/llama_cpp_python-*.tar.gz -C "$CACHE/src" --strip-components=1
  fi
  local src="$CACHE/src/vendor/llama.cpp" tool missing=()
  if [ ! -f "$CACHE/build/CMakeCache.txt" ]; then
    cmake -S "$src" -B "$CACHE/build" -DCMAKE_BUILD_TYPE=Release \
      -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_SERVER=OFF >/dev/null
  fi
  for tool in "${TOOLS[@]}"; do [ -x "$CACHE/bin/$tool" ] || missing+=("$tool"); done
  if [ ${#missing[@]} -gt 0 ]; then
    cmake --build "$CACHE/build" -j"$(nproc)" --target "${missing[@]}"
    for tool in "${missing[@]}"; do cp "$CACHE/build/bin/$tool" "$CACHE/bin/"; done
  fi
  # pd-greedy (peers/greedy.cpp): greedy token ids for prompts given as ids; pd-logits
  # (peers/logits.cpp): every position's logits of sequences given as ids, teacher-forced
  for tool in "${PEERS[@]}"; do
    [ "$CACHE/bin/pd-$tool" -nt "$HERE/peers/$tool.cpp" ] && continue
    "${CXX:-c++}" -O2 -std=c++17 "$HERE/peers/$tool.cpp" -I"$src/include" -I"$src/ggml/include" -o "$CACHE/bin/pd-$tool" \
      -Wl,--start-group "$CACHE/build/src/libllama.a" $(find "$CACHE/build/ggml" -name 'libggml*.a') -Wl,--end-group \
      -fopenmp -lpthread -ldl -lm
  done
  echo "llama.cpp $VERSION (from llama-cpp-python sdist) in $CACHE/bin"
}

convert() {  # convert HF_DIR [OUT [OUTTYPE]]
  local src="$1" type="${3:-f32}"
  local out="${2:-$CACHE/$(basename "$1").$type.gguf}"
  [ -f "$out" ] && { echo "$out"; return; }
  "$PY" -m pip install --quiet --disable-pip-version-check "$CACHE/src/vendor/llama.cpp/gguf-py" sentencepiece >/dev/null
  # LLAMACPP_PRE=NAME: for a checkpoint whose tokenizer llama.cpp's table does not know (the random
  # 135M model carries a small byte-level BPE), declare its pre-tokenizer instead of failing.
  LLAMACPP_PRE="${LLAMACPP_PRE:-}" "$PY" - "$CACHE/src/vendor/llama.cpp/convert_hf_to_gguf.py" \
      "$src" --outtype "$type" --outfile "$out" >&2 <<'PY'
import os, runpy, sys
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
pre = os.environ.get("LLAMACPP_PRE")
if pre:
    from conversion import base
    known = base.TextModel.get_vocab_base_pre
    def get_vocab_base_pre(self, tokenizer):
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            return pre
    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
runpy.run_path(script, run_name="__main__")
PY
  echo "$out"
}

quantize() {  # quantize IN OUT TYPE: every 2-D weight in TYPE (--pure: no Q6_K output / mixes),
  # those whose rows are not a multiple of the block fall back as llama.cpp decides
  [ -f "$2" ] && { echo "$2"; return; }
  "$CACHE/bin/llama-quantize" --pure "$1" "$2" "$3" >&2
  echo "$2"
}

case "${1:-build}" in
  build) build
         stories="${PAGEDECODE_STORIES:-}"
         if [ -n "$stories" ]; then convert "$stories"; fi ;;
  convert) shift; convert "$@" ;;
  quantize) shift; quantize "$@" ;;
  *) echo "usage: $0 [build | convert HF_DIR [OUT.gguf [f32|bf16]] | quantize IN.gguf OUT.gguf q8_0|q4_0]" >&2; exit 2 ;;
esac
