"""Tensor parallelism on CPU: gloo, 2 ranks spawned by the engine inside pytest. Same logits
(1e-5), same greedy and seeded tokens as N = 1 and transformers; the same events under chunked
prefill, preemption and a cancel; a killed worker fails its step and the engine refuses more."""
import os
import signal

import pytest
import torch

import pagedecode as pd
from pagedecode.model.parallel import ModelUnavailableError
from pagedecode.testing import prefill_batch

from .test_hf_parity import PROMPTS, hf_greedy, make_checkpoint

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
FAMILIES = ["llama2", "mistral", "qwen2-bias", "qwen3-qknorm"]


def logits_of(model, ids):
    c = model.config
    kv = pd.KVCache(c.num_layers, 8, 16, c.num_kv_heads, c.head_dim, model.dtype)
    return model.forward(prefill_batch(ids, list(range(8)), 16), kv)


@pytest.fixture()
def stories_tp(stories_path):
    eng = pd.Engine.from_pretrained(stories_path, tensor_parallel_size=2)
    yield eng
    eng.close()


def test_stories_at_two_ranks(stories_tp, stories_path):
    one = pd.Engine.from_pretrained(stories_path)
    prompts = ["Once upon a time", "Lily and Tom went", "The dog"]
    for params in (pd.SamplingParams(max_tokens=24), pd.SamplingParams(max_tokens=24, temperature=1.0, seed=9)):
        assert [o.selected_token_ids for o in stories_tp.generate(prompts, params)] == \
            [o.selected_token_ids for o in one.generate(prompts, params)]
    out = stories_tp.generate("Once upon a time", pd.SamplingParams(max_tokens=16))[0]
    assert out.text == ", there was a little girl named Lily. She loved to play"     # REFERENCE.md
    assert stories_tp.bytes_per_token * 2 == stories_tp.bytes_per_token_total == one.bytes_per_token
    ids = stories_tp.tokenizer.encode("Once upon a time, there was")
    torch.testing.assert_close(logits_of(stories_tp.model, ids), logits_of(one.model, ids), atol=1e-5, rtol=1e-5)


def test_same_events_with_chunked_prefill_preemption_and_a_cancel(stories_path):
    def run(eng):
        rids = [eng.add_request(p, pd.SamplingParams(max_tokens=12, temperature=0.8, seed=i))
                for i, p in enumerate(["Once upon a time, there was a little girl", "Lily", "Tom and Sue went to",
                                       "The sun"])]
        events, step = [], 0
        while eng.has_unfinished():
            events += eng.step()
            step += 1
            if step == 3:
                eng.cancel(rids[2])
        preempted = sum(any(r["kind"] == "preempted" for r in eng.trace(rid)) for rid in rids)
        return [(type(e).__name__, e.seq, getattr(e, "text", None), getattr(e, "token_ids", None),
                 getattr(e, "finish_reason", None)) for e in events if e.request_id in rids], preempted
    opts = dict(page_size=4, max_cache_tokens=48, max_tokens_per_step=7, max_batch_size=4)
    one = pd.Engine.from_pretrained(stories_path, **opts)
    tp = pd.Engine.from_pretrained(stories_path, tensor_parallel_size=2, **opts)
    try:
        want, preempted = run(one)
        got, _ = run(tp)
        assert preempted > 0 and got == want
    finally:
        tp.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_random_families_match_one_rank_and_transformers(tmp_path, stories_path, family):
    hf = make_checkpoint(tmp_path, family, stories_path)
    one = pd.Engine.from_pretrained(tmp_path)
    tp = pd.Engine.from_pretrained(tmp_path, tensor_parallel_size=2, max_tokens_per_step=11, page_size=8)
    try:
        tp_logits = logits_of(tp.model, PROMPTS[1])
        torch.testing.assert_close(tp_logits, logits_of(one.model, PROMPTS[1]), atol=1e-5, rtol=1e-5)
        with torch.no_grad():
            ref = hf(torch.tensor([PROMPTS[1]])).logits[0].float()
        torch.testing.assert_close(tp_logits, ref, atol=1e-5, rtol=1e-5)             # and transformers
        params = pd.SamplingParams(max_tokens=10, ignore_eos=True)
        outs = tp.generate(PROMPTS, params)
        for ids, out in zip(PROMPTS, outs):
            assert out.selected_token_ids == hf_greedy(hf, ids, 10)
        seeded = pd.SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=4)
        assert [o.selected_token_ids for o in tp.generate(PROMPTS, seeded)] == \
            [o.selected_token_ids for o in one.generate(PROMPTS, seeded)]
    finally:
        tp.close()


def test_a_killed_worker_fails_the_step_and_the_engine_refuses_more(stories_path):
    tp = pd.Engine.from_pretrained(stories_path, tensor_parallel_size=2)
    procs = list(tp.model._procs)
    try:
        rid = tp.add_request("Once upon a time", pd.SamplingParams(max_tokens=50))
        for _ in range(3):
            tp.step()
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].join(timeout=10)
        while tp.has_unfinished():
            tp.step()
        out = tp.result(rid)
        assert out.state == pd.RequestState.FAILED and out.finish_reason == pd.FinishReason.MODEL_ERROR
        assert "died" in out.error or "tensor-parallel" in out.error
        with pytest.raises(ModelUnavailableError, match="no more requests"):
            tp.add_request("again", pd.SamplingParams())
        assert tp.pool.free_pages == tp.pool.num_pages
    finally:
        tp.close()
    assert not any(p.is_alive() for p in procs)


def test_a_shape_that_does_not_divide_is_named(stories_path):
    with pytest.raises(pd.ModelLoadError, match="num_attention_heads = 8"):
        pd.Engine.from_pretrained(stories_path, tensor_parallel_size=3)


def _torchrun_rank(rank, path, port, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from pagedecode.parallel import from_torchrun
    engine = from_torchrun(path)
    if engine is not None:
        results.put(engine.generate("Once upon a time", pd.SamplingParams(max_tokens=16))[0].text)
        engine.close()


def test_joined_from_torchrun_style_environment(stories_path):
    import torch.multiprocessing as mp

    from pagedecode.model.parallel import _free_port
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_torchrun_rank, args=(r, str(stories_path), port, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    text = results.get(timeout=60)
    for p in procs:
        p.join(timeout=30)
    assert text == ", there was a little girl named Lily. She loved to play"
    assert all(p.exitcode == 0 for p in procs)


def test_interpreter_exit_leaves_no_worker_behind(stories_path, tmp_path):
    import subprocess
    import sys
    script = tmp_path / "run.py"
    script.write_text(
        "import pagedecode as pd, sys\n"
        "if __name__ == '__main__':\n"
        f"    e = pd.Engine.from_pretrained({str(stories_path)!r}, tensor_parallel_size=2)\n"
        "    print(e.model._procs[0].pid, flush=True)\n"
        "    e.generate('Once', pd.SamplingParams(max_tokens=2))\n")              # no close(): exit does it
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    pid = int(r.stdout.split()[0])
    import time
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"worker {pid} outlived the interpreter")


def test_ctrl_c_of_generate_at_two_ranks_ends_at_once(stories_path):
    """Ctrl-C reaches every process of the terminal's group. The workers leave it to rank 0,
    which finishes its step, so the group stops together (it used to wait 60 s in all_reduce)."""
    import subprocess
    import sys
    import time
    p = subprocess.Popen([sys.executable, "-m", "pagedecode.cli", "generate", "--model", str(stories_path),
                          "--prompt", "Once upon a time", "--max-tokens", "100000", "--ignore-eos",
                          "--tensor-parallel-size", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True)
    assert p.stdout.read(40)                           # decoding at two ranks
    start = time.time()
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=120)
    took = time.time() - start
    assert p.returncode == 130
    assert b"[interrupted" in err and b"Traceback" not in err and b"gloo" not in err, err.decode()[-2000:]
    assert took < 15, took                             # ~2.5 s on a loaded 2-core machine

def test_shutdown_ends_requests_and_stops_the_workers(stories_tp):
    """One verb for "stop everything": shutdown() (as close()) ends the requests and the ranks."""
    eng = stories_tp
    procs = list(eng.model._procs)
    assert procs and all(p.is_alive() for p in procs)
    rid = eng.add_request("Once upon a time", pd.SamplingParams(max_tokens=10_000))
    eng.step()
    events = eng.shutdown()
    assert [e.state for e in events if isinstance(e, pd.TerminalEvent)] == [pd.RequestState.CANCELLED]
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(ModelUnavailableError, match="closed"):
        eng.add_request("Once", pd.SamplingParams(max_tokens=2))
    eng.close()                                           # the other name: the same, idempotent
    assert eng.result(rid).state == pd.RequestState.CANCELLED
