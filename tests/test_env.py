"""pagedecode/env.py: each variable read when asked (a monkeypatch.setenv after import counts),
its default when unset, and a value other than the one named keeping the default."""
from pathlib import Path

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
