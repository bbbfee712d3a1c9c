#!/usr/bin/env bash
# One call on the lent GPU (H200), at most ~460 s even when every step hits its timeout:
# the kernel tests and the CUDA engine test on the GPU, the kernel benchmarks with a sweep of
# attention launch configs, then compute-sanitizer once per kernel where it works. Uses the
# machine's own python3 (torch, triton, pytest, hypothesis are there); installs nothing.
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
timeout 120 python3 -m pytest tests/kernels tests/model/test_cuda_engine.py -q -p no:cacheprovider 2>&1 \
  | tail -25 | tee "$OUT/kernel_tests.txt"

echo "== benchmarks (copy bandwidth first, then each kernel beside its torch baseline, then the sweep)"
timeout 200 python3 benchmarks/kernels.py --sweep --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.txt"

echo "== tensor parallelism, 2 ranks (only with >= 2 GPUs)"
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  timeout 120 python3 - <<'PY' 2>&1 | tee "$OUT/tp2.txt"
import pagedecode as pd
from pagedecode.model.default_model import default_model_path
if __name__ == "__main__":
    path = default_model_path()
    params = pd.SamplingParams(max_tokens=32, ignore_eos=True)
    prompts = ["The lighthouse keeper", "Numbers"]
    one = [o.selected_token_ids for o in pd.Engine.from_pretrained(path, device="cuda", dtype="float32").generate(prompts, params)]
    eng = pd.Engine.from_pretrained(path, device="cuda", dtype="float32", tensor_parallel_size=2)
    two = [o.selected_token_ids for o in eng.generate(prompts, params)]
    eng.close()
    print("tp2 tokens identical to tp1:", one == two)
    raise SystemExit(0 if one == two else 1)
PY
else
  echo "fewer than 2 GPUs: TP=2 case skipped" | tee "$OUT/tp2.txt"
fi

echo "== compute-sanitizer, one small launch per kernel"
if command -v compute-sanitizer >/dev/null; then
  for k in kv_write decode extend sampling; do
    timeout 35 compute-sanitizer --tool memcheck --error-exitcode 3 python3 benchmarks/kernels.py --sanitize "$k" \
      2>&1 | tail -4 | tee -a "$OUT/sanitizer.txt"
  done
else
  echo "compute-sanitizer not found" | tee "$OUT/sanitizer.txt"
fi
