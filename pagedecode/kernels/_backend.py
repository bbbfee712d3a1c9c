"""Which implementation a kernel call uses: Triton on CUDA tensors, the torch reference elsewhere.

`backend="auto"` picks Triton only for CUDA tensors when Triton is importable; "triton" forces
the kernel (on CPU that needs TRITON_INTERPRET=1, which tests set); "torch" forces the reference.
"""
from __future__ import annotations

import os

import torch

from .. import env

BACKENDS = ("auto", "triton", "torch")


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (decided at import of each kernel)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_can_run() -> bool:
    """Whether a Triton kernel could run in this process: a torch built for CUDA or ROCm, or the
    interpreter. A CPU-only torch never gives Triton a tensor it can take, so there Triton is not
    imported at all (its import cost ~0.5 s and ~70 MB resident of libtriton.so for nothing),
    unless asked for (env.triton_wanted: compiling kernels for a GPU on a machine without one)."""
    return (interpreting() or torch.version.cuda is not None or torch.version.hip is not None
            or env.triton_wanted())


HAS_TRITON = False
if triton_can_run():
    try:  # triton is an optional extra: the CPU path never needs it
        import triton  # noqa: F401  (availability probe)
        import triton.language as tl  # noqa: F401
        HAS_TRITON = True
    except Exception:  # pragma: no cover - depends on the environment
        pass


def use_triton(tensor: torch.Tensor, backend: str) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    if backend == "triton":
        if not tensor.is_cuda and not interpreting():
            raise RuntimeError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1")
        if not HAS_TRITON:
            raise RuntimeError("backend='triton' but triton is not installed (pip install pagedecode[triton])")
        return True
    return HAS_TRITON and tensor.is_cuda


def dot_dtype(t: torch.Tensor):
    """The operand type for tl.dot: the tensor's own 16-bit type on the GPU, fp32 in the interpreter
    (whose bf16 dot is wrong). fp16 stays fp16 there: the interpreter computes it correctly."""
    if interpreting() and t.dtype == torch.bfloat16:
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[t.dtype]


if HAS_TRITON:
    @triton.jit
    def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """This program's (row tile, column tile) of an M x N output, in grouped order: GROUP_M
        row tiles walk the column tiles together, so consecutive programs share a weight tile
        and their activation rows stay in L2. Which program computes a tile never changes how
        the tile is computed."""
        pid = tl.program_id(0)
        per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
        first_m = (pid // per_group) * GROUP_M
        group_m = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
        return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m
