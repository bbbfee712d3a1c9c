#!/usr/bin/env bash
# The device check: one call on a lent CUDA GPU (an H100 / H200), in the project's own venv; the
# default steps together at most 570 s (STEPS= a few of them for a rerun within a 15-minute lease).
#
#   bash benchmarks/device_check.sh            run every step (results under $OUT, else
#                                             benchmarks/results/device-<date>-<time>/)
#   bash benchmarks/device_check.sh --help     this text; runs nothing
#   STEPS="tests kernels" bash benchmarks/device_check.sh     only the steps named
#
# Steps, each with its own timeout, each writing its JSON as it finishes (a timeout or a kill
# keeps what was done; steps.json says which ran, how long, and how each ended):
#   env      GPU, driver, torch / triton versions                                   env.json
#   build    every Triton kernel compiled ahead of time for sm_90 (a compile error
#            stops nothing else, but shows before the long steps)                  build.log
#   tests    kernel tests, the CUDA engine test, deterministic mode's model test
#            and the decode graphs' bitwise test, compiled (not interpreted)        tests.json
#   kernels  copy bandwidth; split-KV decode attention (8B shape: 32 q / 8 kv heads,
#            d128: B=64 x 4k, B=32 x 4k, B=1 x 32k, and B=1 x 32k in deterministic
#            mode's fixed splits) vs HBM bandwidth, prefill TFLOP/s, the tiled
#            sampler over 64 x 128,256 (top-k + top-p, greedy, min-p, top-p alone;
#            a seed per row) with its reference and batch checks, KV write, each
#            beside its torch baseline; deterministic mode's matmul / RMSNorm vs
#            torch and its extend vs the default extend ("det ..." rows); the
#            config sweep with SWEEP=1                                              kernels.json
#   e2e      benchmarks/gpu_e2e.py: SmolLM2-135M (bf16, q8_0, q4_0; its GGUF at
#            benchmarks/.cache/smollm2.gguf when carried), 1B- and 8B-shaped
#            random Llamas: tokens/s, TTFT, ITL with and without decode graphs,
#            transformers' generate, host vs GPU time per step                     e2e.json
#   quant    copy bandwidth; Q8_0 / Q4_0 GEMV and GEMM: weight GB/s vs it, beside
#            dequantize + matmul and a dense bf16 matmul; a row each for Q4_1, Q5_0,
#            Q5_1, Q4_K, Q5_K, Q6_K (GEMV at 1 row, GEMM at 16: kernels/gguf_matmul.py)
#            and for the segmented LoRA delta (rank 64, 16 rows over 4 adapters);
#            config sweep                                                            quant.json
#   micro    the pytest-benchmark micro-benchmarks (benchmarks/micro) on CUDA       micro.json
#   spec     speculative decoding's rejection kernel vs its torch reference:
#            equal tokens, microseconds (benchmarks/speculative.py --kernel)        spec.json
#   engine   benchmarks/engine_vs_hf.py --device cuda (pagedecode vs transformers)  engine.json
#   tp2      tensor parallelism on 2 GPUs (skipped with fewer)                      tp2.json
# Default: env build tests kernels quant e2e; micro, spec, engine and tp2 run when STEPS names them.
# Failures are recorded by kernel and shape (kernels.json rows carry "error"); the script exits
# non-zero when any step failed or timed out, after running the rest.
#
# The interpreter: .venv if its torch sees a GPU; else the first python on the machine whose torch
# sees one (the H200 image's is /opt/torch/.venv/bin/python3), with this checkout on PYTHONPATH:
# nothing installed, nothing downloaded (the device machine reaches no registry).
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 0
fi
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=0 TRITON_CACHE_DIR="$PWD/.triton_cache" PYTHONUNBUFFERED=1

py_sees_gpu() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
if [ -x .venv/bin/python ] && py_sees_gpu .venv/bin/python; then
  echo "using .venv"
elif [ -x .venv/bin/python ]; then
  echo "error: .venv exists but its torch sees no GPU (a CPU build?): move it away and rerun" >&2
  exit 2
else
  # The machine's CUDA torch may live in another environment than the first python3 on PATH (the
  # H200 image keeps it in /opt/torch/.venv, whose packages a --system-site-packages venv made
  # from it would not see): run the first interpreter whose torch sees the GPU, with this
  # checkout first on its path (no install, no downloads; the CPU extension is not needed).
  PY=""
  for cand in $(which -a python3 python 2>/dev/null) /opt/torch/.venv/bin/python3; do
    if [ -x "$cand" ] && py_sees_gpu "$cand"; then PY="$cand"; break; fi
  done
  [ -n "$PY" ] || { echo "error: no python here has a torch that sees a GPU" >&2; exit 2; }
  echo "using $PY with this checkout on PYTHONPATH"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
PY="${PY:-$PWD/.venv/bin/python}"
RESULTS="${OUT:-benchmarks/results/device-$(date +%F-%H%M%S)}"
mkdir -p "$RESULTS"
STEPS="${STEPS:-env build tests kernels quant e2e}"

STATUS="$RESULTS/steps.json"
echo "[]" > "$STATUS"
FAILED=0
record() {  # step rc seconds
  "$PY" - "$STATUS" "$1" "$2" "$3" <<'PY'
import json, sys
path, step, rc, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rows = json.load(open(path))
rows.append({"step": step, "rc": rc, "seconds": secs,
             "outcome": "ok" if rc == 0 else "timed out" if rc in (124, 137) else "failed"})
open(path, "w").write(json.dumps(rows, indent=1) + "\n")
PY
}
step() {  # name timeout command...
  local name="$1" limit="$2"; shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  echo "== $name (at most ${limit}s)"
  local t0=$SECONDS rc=0
  timeout "$limit" "$@" > >(tee "$RESULTS/$name.log") 2>&1 || rc=$?
  record "$name" "$rc" "$((SECONDS - t0))"
  if [ "$rc" -ne 0 ]; then FAILED=1; echo "!! step $name: rc=$rc (see $RESULTS/$name.log)"; fi
}

step env 20 "$PY" -c "
import json, subprocess, torch, triton
smi = subprocess.run(['nvidia-smi', '--query-gpu=name,driver_version,memory.total', '--format=csv,noheader'],
                     capture_output=True, text=True).stdout.strip()
env = {'gpu': torch.cuda.get_device_name(), 'nvidia_smi': smi, 'torch': torch.__version__,
       'triton': triton.__version__, 'capability': list(torch.cuda.get_device_capability())}
print(env); open('$RESULTS/env.json', 'w').write(json.dumps(env, indent=1) + '\n')"

step build 40 "$PY" tests/kernels/compile_hopper.py

step tests 120 "$PY" -m pytest tests/kernels tests/model/test_cuda_engine.py tests/model/test_deterministic_triton.py \
  tests/model/test_cuda_graphs.py \
  -q -p no:cacheprovider -o addopts= \
  --ignore=tests/kernels/test_compile_hopper.py --junitxml="$RESULTS/tests.xml"
[ -f "$RESULTS/tests.xml" ] && "$PY" - "$RESULTS/tests.xml" "$RESULTS/tests.json" <<'PY' || true
import json, sys, xml.etree.ElementTree as ET
cases = []
for c in ET.parse(sys.argv[1]).iter("testcase"):
    bad = c.find("failure") if c.find("failure") is not None else c.find("error")
    cases.append({"test": f"{c.get('classname')}::{c.get('name')}", "seconds": float(c.get("time", 0)),
                  "outcome": "skipped" if c.find("skipped") is not None else "failed" if bad is not None else "passed",
                  **({"message": (bad.get("message") or "")[:300]} if bad is not None else {})})
open(sys.argv[2], "w").write(json.dumps(cases, indent=1) + "\n")
PY

SWEEP_FLAG=""; [ "${SWEEP:-0}" = "1" ] && SWEEP_FLAG="--sweep"
step kernels 110 "$PY" benchmarks/kernel_sweep.py $SWEEP_FLAG --out "$RESULTS/kernels.json"

step quant 100 "$PY" benchmarks/kernel_sweep.py --quant $SWEEP_FLAG --out "$RESULTS/quant.json"

SMOLLM2_FLAG=""; [ -f benchmarks/.cache/smollm2.gguf ] && SMOLLM2_FLAG="--smollm2 benchmarks/.cache/smollm2.gguf"
step e2e 180 "$PY" benchmarks/gpu_e2e.py $SMOLLM2_FLAG --out "$RESULTS/e2e.json"

step micro 60 "$PY" -m pytest benchmarks/micro/test_ops.py -q -p no:cacheprovider -o addopts= \
  --benchmark-json="$RESULTS/micro.json" --benchmark-max-time=0.5

step spec 30 "$PY" benchmarks/speculative.py --kernel --out "$RESULTS/spec.json"

step engine 60 "$PY" benchmarks/engine_vs_hf.py --device cuda --dtype bfloat16 --models llama135m \
  --engines pagedecode,transformers --repeat 3 --out "$RESULTS/engine.json"

tp2() {
  if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -lt 2 ]; then
    echo '{"skipped": "fewer than 2 GPUs"}' > "$RESULTS/tp2.json"; echo "fewer than 2 GPUs: skipped"; return 0
  fi
  "$PY" - "$RESULTS/tp2.json" <<'PY'
import json, sys
import pagedecode as pd
from pagedecode.model.default_model import default_model_path
if __name__ == "__main__":
    path, params = default_model_path(), pd.SamplingParams(max_tokens=32, ignore_eos=True)
    prompts = ["The lighthouse keeper", "Numbers"]
    one = [o.selected_token_ids for o in pd.Engine.from_pretrained(path, device="cuda").generate(prompts, params)]
    eng = pd.Engine.from_pretrained(path, device="cuda", tensor_parallel_size=2)
    two = [o.selected_token_ids for o in eng.generate(prompts, params)]
    eng.close()
    json.dump({"identical_to_tp1": one == two}, open(sys.argv[1], "w"))
    sys.exit(0 if one == two else 1)
PY
}
export -f tp2; export PY RESULTS
step tp2 50 bash -c tp2

echo "== steps"; cat "$STATUS"
if [ "$FAILED" -ne 0 ]; then echo "device check: a step failed (steps.json)" >&2; exit 1; fi
echo "device check: every step passed"
