import subprocess
import sys


from pagedecode import cli


def test_generate_streams_the_reference_text(stories_path, capsys):
    assert cli.main(["generate", "--model", str(stories_path), "--prompt", "Once upon a time",
                     "--max-tokens", "16"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == ", there was a little girl named Lily. She loved to play"
    assert "max_output_tokens" in out.err


def test_demo_on_the_default_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PAGEDECODE_CACHE", str(tmp_path))
    assert cli.main(["demo", "--requests", "3", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "throughput (tok/s)" in out and "time to first token" in out and "inter-token latency" in out
    assert "tokens returned                     24" in out
    assert (tmp_path / "default-model-v2" / "model.safetensors").is_file()     # cached after first use


def test_default_model_is_deterministic(tmp_path):
    from pagedecode.model.default_model import write_default_model
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    write_default_model(a)
    write_default_model(b)
    for f in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes()


def test_bad_model_dir_is_a_clear_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pagedecode.cli", "generate", "--model", str(tmp_path / "x"),
                        "--prompt", "hi"], capture_output=True, text=True)
    assert r.returncode == 2 and "model directory not found" in r.stderr
