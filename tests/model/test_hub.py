"""--model ORG/NAME and ORG/NAME:FILE.gguf load from huggingface_hub's cache, laid out here as
huggingface_hub lays it out (models--ORG--NAME/{blobs,refs/main,snapshots/COMMIT}); tests never
reach a network (HF_HUB_OFFLINE=1), and a name that is not cached is one line saying where it
was looked for."""
import hashlib
import os
import shutil
import subprocess
import sys

import pytest

from pagedecode.model.hub import is_hub_name

STORY = ", there was a little girl named Lily. She loved to play"


def cache_repo(cache, repo, files):
    """files: {name in the repository: local file}, stored as blobs with snapshot symlinks."""
    root = cache / ("models--" + repo.replace("/", "--"))
    commit = hashlib.sha1(repo.encode()).hexdigest()
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    (root / "blobs").mkdir()
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, src in files.items():
        blob = root / "blobs" / hashlib.sha256(src.read_bytes()).hexdigest()
        shutil.copy(src, blob)
        os.symlink(os.path.relpath(blob, snap), snap / name)
    return snap


@pytest.fixture
def hub_cache(tmp_path, stories_path):
    cache = tmp_path / "hub"
    cache_repo(cache, "testorg/stories260k", {f.name: f for f in stories_path.iterdir() if f.is_file()})
    gguf = stories_path / "source" / "stories260K.gguf"
    if gguf.is_file():
        cache_repo(cache, "testorg/stories260k-GGUF", {"stories260K.gguf": gguf})
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(tmp_path / "home"))
    return cache, env


def generate(model, env):
    return subprocess.run([sys.executable, "-m", "pagedecode.cli", "generate", "--model", model, "--prompt",
                           "Once upon a time", "--max-tokens", "16"], capture_output=True, text=True, env=env,
                          timeout=300)


def test_a_repository_id_loads_from_the_cache(hub_cache):
    r = generate("testorg/stories260k", hub_cache[1])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == STORY


def test_a_gguf_file_of_a_repository_loads_from_the_cache(hub_cache, stories_path):
    if not (stories_path / "source" / "stories260K.gguf").is_file():
        pytest.skip("no stories260K.gguf")
    r = generate("testorg/stories260k-GGUF:stories260K.gguf", hub_cache[1])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == STORY


def test_offline_and_not_cached_is_one_line(hub_cache):
    cache, env = hub_cache
    r = generate("testorg/missing", env)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert f"testorg/missing: not in the Hugging Face cache at {cache}" in r.stderr
    assert "nothing could be downloaded (HF_HUB_OFFLINE is set)" in r.stderr
    r = generate("testorg/stories260k-GGUF:other.gguf", env)
    assert r.returncode == 2 and "not in the Hugging Face cache" in r.stderr and "Traceback" not in r.stderr


def test_what_counts_as_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_name("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert is_hub_name("bartowski/SmolLM2-135M-Instruct-GGUF:SmolLM2-135M-Instruct-Q4_K_M.gguf")
    assert not is_hub_name("/abs/path") and not is_hub_name("model.gguf") and not is_hub_name("a/b/c")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_name("org/name")                 # an existing path is a path
