import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedecode.kernels._backend import HAS_TRITON


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_every_kernel_compiles_for_hopper():
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except Exception:
        pytest.skip("this triton build has no NVIDIA backend")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    env.setdefault("TRITON_CACHE_DIR", str(Path(__file__).resolve().parents[2] / ".triton_cache"))
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("compile_hopper.py"))], env=env,
                       capture_output=True, text=True, timeout=600)
    if "ptxas" in r.stdout + r.stderr and "not found" in r.stdout + r.stderr and not shutil.which("ptxas"):
        pytest.skip("no ptxas available")
    assert r.returncode == 0, r.stdout + r.stderr
    # 20: attention (3 direct-write split kernels among them) and KV write; 8: the tiled sampler
    # (tiles with and without penalties / the bitmask, tile draws and finish with and without slots);
    # 1: speculative rejection; 25: the quantized matmuls; 32: the other GGUF types' (6 x 5 in bf16,
    # 2 GEMMs in fp32 / fp16); 6: LoRA shrink and expand; 10: deterministic mode's matmul, RMSNorm
    # and quantized GEMM config; 6: 8-bit KV caches (int8, fp8 e4m3: decode split, extend, write)
    assert r.stdout.count("ok ") == 20 + 8 + 1 + 25 + 32 + 6 + 10 + 6 and "FAIL" not in r.stdout
