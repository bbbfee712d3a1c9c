"""Compiled parts, each optional: pagedecode installs and runs as pure Python without them.

- pagedecode._cpu (csrc/cpu_forward.cpp): the CPU forward pass in one call, built with torch's
  cpp_extension when torch and a C++ compiler are present. A failed build warns and installs
  without it; the torch path (the oracle) then runs.
- pagedecode._C (csrc/*.cu): CUDA ops, only with a CUDA-enabled torch and a toolkit.

torch must be importable at build time, so the Makefile installs with --no-build-isolation.
"""
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup


def extensions():
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except Exception:
        return [], {}
    exts = []
    if os.environ.get("PAGEDECODE_NO_CPU_EXT") != "1" and shutil.which(os.environ.get("CXX", "c++")):
        # as torch is built; without -fno-trapping-math GCC leaves the exp loops scalar
        flags = ["-O3", "-std=c++17", "-fopenmp", "-fno-trapping-math", "-fno-math-errno"]
        if os.environ.get("PAGEDECODE_PORTABLE") != "1":
            flags.append("-march=native")      # built where it runs: the venv is per machine
        exts.append(CppExtension("pagedecode._cpu", ["csrc/cpu_forward.cpp"], extra_compile_args=flags,
                                 extra_link_args=["-fopenmp"]))
    cu = sorted(str(p) for p in Path("csrc").glob("*.cu"))
    if cu and torch.cuda.is_available() and torch.version.cuda is not None and CUDA_HOME is not None:
        exts.append(CUDAExtension("pagedecode._C", cu, extra_compile_args={"nvcc": ["-O3"]}))

    class OptionalBuild(BuildExtension):
        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as e:  # a compiler that fails must not fail the install
                print(f"warning: {ext.name} not built ({e}); the torch path runs instead", file=sys.stderr)

    return exts, {"build_ext": OptionalBuild}


ext_modules, cmdclass = extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
