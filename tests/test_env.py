"""pagedecode/env.py: each variable read when asked (a monkeypatch.setenv after import counts),
its default when unset, and a value other than the one named keeping the default."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedecode import env


def test_each_variable_is_read_when_asked(monkeypatch, tmp_path):
    for name in (env.CPU_MATMUL, env.CPU_PACK, env.MALLOC, env.CACHE):
        monkeypatch.delenv(name, raising=False)
    assert (env.cpu_matmul(), env.cpu_pack_weights(), env.keep_freed_memory()) == ("onednn", False, True)
    assert env.cache_root() == Path.home() / ".cache" / "pagedecode"
    monkeypatch.setenv(env.CPU_MATMUL, "aten")
    monkeypatch.setenv(env.CPU_PACK, "1")
    monkeypatch.setenv(env.MALLOC, "default")
    monkeypatch.setenv(env.CACHE, str(tmp_path))
    assert (env.cpu_matmul(), env.cpu_pack_weights(), env.keep_freed_memory()) == ("aten", True, False)
    assert env.cache_root() == tmp_path
    monkeypatch.setenv(env.CPU_MATMUL, "mkl")
    monkeypatch.setenv(env.CPU_PACK, "yes")
    monkeypatch.setenv(env.MALLOC, "glibc")
    monkeypatch.setenv(env.CACHE, "")
    assert (env.cpu_matmul(), env.cpu_pack_weights(), env.keep_freed_memory()) == ("onednn", False, True)
    assert env.cache_root() == Path.home() / ".cache" / "pagedecode"


def test_the_default_model_is_written_where_the_cache_says(monkeypatch, tmp_path):
    from pagedecode.model.default_model import cache_dir
    monkeypatch.setenv(env.CACHE, str(tmp_path))
    assert cache_dir().parent == tmp_path


def test_openmp_spins_briefly_unless_the_user_chose(monkeypatch):
    """GOMP_SPINCOUNT=1000 only while torch is first imported, then removed (children see the
    environment as it was); a user's OMP_WAIT_POLICY or GOMP_SPINCOUNT, or torch already imported,
    leaves everything as it is."""
    import sys
    monkeypatch.delenv(env.OMP_WAIT_POLICY, raising=False)
    monkeypatch.delenv(env.GOMP_SPINCOUNT, raising=False)
    with env.openmp_spins_briefly():           # this process imported torch long ago: too late
        assert env.GOMP_SPINCOUNT not in os.environ
    monkeypatch.delitem(sys.modules, "torch")     # as before torch's first import (restored after)
    with env.openmp_spins_briefly():
        assert os.environ[env.GOMP_SPINCOUNT] == "1000"
    assert env.GOMP_SPINCOUNT not in os.environ
    for name, value in ((env.OMP_WAIT_POLICY, "active"), (env.GOMP_SPINCOUNT, "300000")):
        monkeypatch.setenv(name, value)
        with env.openmp_spins_briefly():
            assert os.environ.get(env.GOMP_SPINCOUNT) == (value if name == env.GOMP_SPINCOUNT else None)
        assert os.environ[name] == value
        monkeypatch.delenv(name)


SPIN_CPU = """
import time
import pagedecode
import torch
torch.set_num_threads(2)
x = torch.ones(1 << 18)
t = time.process_time()
for _ in range(100):
    x.add_(1.0)            # a parallel region over 2 threads
    time.sleep(0.01)       # meanwhile the other thread spins, then sleeps
print(time.process_time() - t)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="libgomp spins briefly anyway with fewer CPUs")
def test_torchs_openmp_threads_stop_spinning_soon_after_import_pagedecode():
    """The CPU a process burns between 100 parallel regions 10 ms apart: with libgomp's own
    default (300,000 spins, here set by hand, which wins) the idle thread spins for milliseconds
    after each; under `import pagedecode` first, a small fraction of that."""
    def cpu_seconds(extra):
        base = {k: v for k, v in os.environ.items() if k not in (env.OMP_WAIT_POLICY, env.GOMP_SPINCOUNT)}
        out = subprocess.run([sys.executable, "-c", SPIN_CPU], env={**base, **extra}, capture_output=True,
                             text=True, timeout=300, check=True).stdout
        return float(out.split()[-1])
    libgomp_default = cpu_seconds({env.GOMP_SPINCOUNT: "300000"})
    brief = cpu_seconds({})
    assert brief * 3 < libgomp_default, (brief, libgomp_default)
