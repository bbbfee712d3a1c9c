#!/usr/bin/env bash
# One call on the lent GPU (H200), under 8 minutes: kernel tests on the GPU, compute-sanitizer
# once per kernel where it works, then the kernel benchmarks. Uses the machine's own python3
# (torch + triton + pytest + hypothesis are there); nothing is installed.
#   run: bash benchmarks/device_check.sh        (results under $OUT, or benchmarks/results/)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/device-$(date +%F)}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0 TRITON_CACHE_DIR="$PWD/.triton_cache"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/env.txt"

echo "== kernel tests and the engine on the GPU"
timeout 200 python3 -m pytest tests/kernels tests/model/test_cuda_engine.py -q -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/kernel_tests.txt"

echo "== compute-sanitizer, one small launch per kernel"
if command -v compute-sanitizer >/dev/null; then
  for k in kv_write decode extend sampling; do
    timeout 60 compute-sanitizer --tool memcheck --error-exitcode 3 python3 benchmarks/kernels.py --sanitize "$k" \
      2>&1 | tail -4 | tee -a "$OUT/sanitizer.txt"
  done
else
  echo "compute-sanitizer not found" | tee "$OUT/sanitizer.txt"
fi

echo "== benchmarks"
timeout 200 python3 benchmarks/kernels.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.txt"
