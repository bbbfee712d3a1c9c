"""The benchmark tooling a GPU user runs: it must say what it does without running, refuse a
machine it cannot measure with a clear message, find models without a sibling folder, never
write over an earlier result, and produce the JSON it promises."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402
import engine_vs_hf  # noqa: E402


def test_device_check_help_runs_nothing(tmp_path):
    out = tmp_path / "results"
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "device_check.sh"), "--help"], capture_output=True,
                       text=True, env={**os.environ, "OUT": str(out)}, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "Steps" in r.stdout and "kernels" in r.stdout and "--help" in r.stdout
    assert "set -euo" not in r.stdout
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine runs the check for real")
def test_device_check_refuses_a_venv_without_a_gpu(tmp_path):
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("no project venv here")
    out = tmp_path / "results"
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "device_check.sh")], capture_output=True, text=True,
                       env={**os.environ, "OUT": str(out)}, timeout=60)
    assert r.returncode == 2
    assert "sees no GPU" in r.stderr
    assert not out.exists()


def test_result_paths_never_repeat(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    first = common.result_path("x", None)
    common.write_json(first, {"a": 1})
    second = common.result_path("x", None)           # same second
    assert second != first and not second.exists()
    assert common.result_path("x", str(tmp_path / "given.json")) == tmp_path / "given.json"


def test_a_missing_model_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGEDECODE_STORIES", raising=False)
    monkeypatch.delenv("PAGEDECODE_SHARED", raising=False)
    with pytest.raises(SystemExit, match="stories260k not found.*PAGEDECODE_STORIES"):
        engine_vs_hf.main(["--models", "stories260k", "--out", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit, match="no config.json"):
        engine_vs_hf.main(["--model", str(tmp_path), "--out", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit, match="unknown model"):
        engine_vs_hf.main(["--models", "gpt5", "--out", str(tmp_path / "r.json")])


def test_percentiles():
    p = engine_vs_hf.percentiles([i / 1000 for i in range(1, 101)])     # 1..100 ms
    assert p == {"p50_ms": 51.0, "p90_ms": 91.0, "p99_ms": 100.0}
    assert engine_vs_hf.percentiles([]) is None
    lat = engine_vs_hf.latency(0.0, [[0.010, 0.012, 0.015], [], [0.020]])
    assert lat["ttft"]["p50_ms"] == 20.0 and lat["itl"]["p99_ms"] == 3.0


def test_engine_vs_hf_single_on_stories(stories_path, tmp_path):
    """One real run, pagedecode beside transformers: the JSON has the rows, the ratios and the
    latency percentiles, and the greedy tokens agree in float32."""
    out = tmp_path / "r.json"
    assert engine_vs_hf.main(["--stories", str(stories_path), "--models", "stories260k", "--workloads", "single",
                              "--engines", "pagedecode,transformers", "--repeat", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (row,) = result["results"]
    assert row["identical_requests"] == "1/1" and row["token_agreement"] == 1.0
    assert row["useful_tokens"] == 128
    for name in ("pagedecode", "transformers"):
        assert row[name]["tok_s"] > 0 and row[name]["itl"]["p50_ms"] > 0 and row[name]["ttft"]["p50_ms"] > 0
    assert row["transformers"]["vs_transformers"] == 1.0
    assert result["threads"] == torch.get_num_threads() and result["dtype"] == "float32"


def test_dtype_ratio_interleaves_runs(stories_path, tmp_path):
    """dtype_ratio.py: both dtypes every round, one ratio per round, their median in the JSON."""
    import dtype_ratio
    out = tmp_path / "ratio.json"
    assert dtype_ratio.main(["--stories", str(stories_path), "--models", "stories260k", "--rounds", "2",
                             "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert len(row["float32"]["tok_s"]) == len(row["bfloat16"]["tok_s"]) == 2
    assert len(row["round_ratios"]) == 2 and row["min_ratio"] <= row["median_ratio"] <= row["max_ratio"]
    assert row["round_ratios"][0] == pytest.approx(row["bfloat16"]["tok_s"][0] / row["float32"]["tok_s"][0],
                                                   rel=0.01)
    with pytest.raises(SystemExit):
        dtype_ratio.main(["--dtypes", "float32", "--out", str(out)])


def test_no_benchmark_script_shadows_an_installed_module():
    """A script's folder is the first entry of sys.path: benchmarks/kernels.py once hid the `kernels`
    package transformers imports, so engine_vs_hf.py failed on a fresh machine."""
    from importlib.machinery import PathFinder
    here = (ROOT / "benchmarks").resolve()
    elsewhere = [p for p in sys.path if Path(p or ".").resolve() != here]
    names = sorted(p.stem for p in here.glob("*.py"))
    clashes = [n for n in names if n in sys.builtin_module_names or PathFinder.find_spec(n, elsewhere) is not None]
    assert "engine_vs_hf" in names and not clashes, clashes


def test_llamacpp_build_succeeds_without_a_stories_folder():
    """With the build present and no PAGEDECODE_STORIES, `llamacpp.sh` has nothing to convert and
    exits 0 (it once returned the failed test's status)."""
    if not (ROOT / "benchmarks" / ".cache" / "llamacpp" / "bin" / "llama-bench").exists():
        pytest.skip("llama.cpp not built here")
    env = {k: v for k, v in os.environ.items() if k != "PAGEDECODE_STORIES"}
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "peers" / "llamacpp.sh")], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "llama.cpp" in r.stdout and "/bin" in r.stdout           # where the tools are, nothing rebuilt


def test_quantized_smallest_on_stories(stories_path, tmp_path):
    """quantized.py's smallest run: f32 and q8_0, single workload, two prompts. Logits against
    float32 (zero for f32 itself, small and nonzero for q8_0), less weight memory in q8_0, and
    llama.cpp beside pagedecode on the same GGUF file when it is built (else the reason why not)."""
    import quantized
    out = tmp_path / "q.json"
    assert quantized.main(["--stories", str(stories_path), "--models", "stories260k", "--formats", "f32,q8_0",
                           "--workloads", "single", "--engines", "pagedecode,llamacpp", "--repeat", "1",
                           "--prompts", "2", "--accuracy-tokens", "8", "--kv-cache-dtype", "float32",
                           "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kv_cache"]["pagedecode"].startswith("float32")
    acc = result["accuracy"]["stories260k"]
    assert acc["f32"]["max_abs_logit_diff"] == 0 and acc["f32"]["mean_kl"] == 0
    assert 0 < acc["q8_0"]["max_abs_logit_diff"] < 1 and 0 < acc["q8_0"]["mean_kl"] < 0.01
    assert acc["q8_0"]["weight_bytes"] < acc["f32"]["weight_bytes"]
    assert [(r["format"], r["workload"]) for r in result["results"]] == [("f32", "single"), ("q8_0", "single")]
    assert all(r["pagedecode"]["tok_s"] > 0 and r["useful_tokens"] == 128 for r in result["results"])
    assert result["results"][1]["pagedecode_vs_own_f32"] > 0
    if quantized.llamacpp_missing() is None:
        assert result["pagedecode_source"] == "the same GGUF file"
        assert acc["f32"]["greedy_vs_llamacpp"]["token_agreement"] >= 0.9
        assert all(r["llamacpp"]["tok_s"] > 0 and r["pagedecode_vs_llamacpp"] > 0 for r in result["results"])
    else:
        assert result["llamacpp"].startswith("llama.cpp not built") and "llamacpp" not in result["results"][0]
    with pytest.raises(SystemExit, match="includes f32"):
        quantized.main(["--formats", "q8_0", "--out", str(tmp_path / "x.json")])


def test_gpu_e2e_runs_its_rows_on_a_tiny_llama_on_cpu(monkeypatch):
    """benchmarks/gpu_e2e.py's pipeline (random weights shared with transformers, engines with and
    without graphs, transformers' generate, the step profile) on a tiny shape on CPU: every row
    it promises, with figures, and greedy tokens that agree with transformers'."""
    pytest.importorskip("transformers")
    import gpu_e2e
    monkeypatch.setitem(gpu_e2e.SHAPES, "tiny", dict(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
        tie_word_embeddings=False))
    monkeypatch.setattr(gpu_e2e, "PROMPT", 24)
    rows = []
    gpu_e2e.random_rows("tiny", 6, rows.append, device="cpu", prompt=24, concurrent=3)
    runs = [r for r in rows if "workload" in r]
    assert [r["workload"] for r in runs] == ["single", "concurrent"]
    for r in runs:
        for engine in ("pagedecode", "pagedecode_eager", "transformers"):
            assert r[engine]["tokens_per_s"] > 0 and r[engine]["ttft"]["p50_ms"] >= 0
        assert r["graphs_agree_with_eager"] == 1.0
        assert r["greedy_agrees_with_transformers"] >= 2 / 3
    profiles = [r["step_profile"] for r in rows if "step_profile" in r]
    assert [p["batch"] for p in profiles] == [3, 3, 1, 1] and all(p["wall_us_per_step"] > 0 for p in profiles)


def test_load_time_on_stories(stories_path, tmp_path):
    """benchmarks/load_time.py end to end on the small model (fresh processes, serve included,
    llama.cpp left out): the JSON has every figure and says which goals were met."""
    import load_time
    out = tmp_path / "load.json"
    assert load_time.main(["--model", str(stories_path), "--repeat", "1", "--no-llamacpp", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (tree,) = result["trees"].values()
    (load,), (serve,) = tree["runs"]["load"], tree["runs"]["serve"]
    assert 0 < load["from_pretrained_to_first_token_s"] < load["process_to_first_token_s"] <= load["process_s"]
    assert load["peak_rss_mb"] >= load["rss_mb"] > load["weight_mb"] > 0
    assert serve["ready_s"] > 0 and serve["rss_after_request_mb"] > 0 and serve["answer"]
    assert "KV cache of" in serve["startup_log"]
    assert set(tree["goals_met"]) == {"load_to_first_token_s", "serve_ready_s", "serve_rss_mb"}
    assert result["llamacpp"]["missing"] == "skipped (--no-llamacpp)"
