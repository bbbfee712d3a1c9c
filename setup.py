"""Adds the csrc/ CUDA extension only when a CUDA-enabled torch and a toolkit are present;
otherwise pagedecode installs as pure Python (everything on the CPU path)."""
from pathlib import Path

from setuptools import setup


def cuda_extensions():
    sources = sorted(str(p) for p in Path("csrc").glob("*.cu"))
    if not sources:
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except Exception:
        return [], {}
    if not torch.cuda.is_available() or torch.version.cuda is None or CUDA_HOME is None:
        return [], {}
    ext = CUDAExtension("pagedecode._C", sources, extra_compile_args={"nvcc": ["-O3"]})
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = cuda_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
