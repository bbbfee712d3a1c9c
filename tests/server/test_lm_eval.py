"""lm-evaluation-harness against the server: `local-completions` (echo + logprobs over the prompt,
as lm-eval sends its loglikelihood requests) on a multiple-choice task and a loglikelihood task
written here (YAML + JSONL, no hub), every per-item loglikelihood equal to lm-eval's own `hf`
backend on stories260k within 1e-4, with tokenized_requests true and false. Both backends put
the model's BOS first (add_bos_token=True); with tokenized_requests false lm-eval sends its
decoded ids, "<s> ...", which the server encodes without a second BOS."""
import json
import textwrap

import pytest

from .conftest import start_server, stop_server

MC = [{"question": "Lily went to the park. She saw a", "choices": ["dog", "car", "big tree"], "answer": 0},
      {"question": "Once upon a time, there was a little", "choices": ["girl", "boat", "sun"], "answer": 0},
      {"question": "Tom was sad because he lost his", "choices": ["toy", "mom", "ball in the park"], "answer": 2}]
LL = [{"context": "Once upon a time, there was a little girl named", "continuation": " Lily"},
      {"context": "The sun was shining and the birds", "continuation": " were singing in the sky"},
      {"context": "She said, \"Thank you,", "continuation": " mom!\""}]


def write_tasks(root):
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC))
    (root / "ll.jsonl").write_text("".join(json.dumps(d) + "\n" for d in LL))
    (root / "pd_mc.yaml").write_text(textwrap.dedent(f"""\
        task: pd_mc
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {root / "mc.jsonl"}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{question}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: "{{{{answer}}}}"
        metric_list:
          - metric: acc
        """))
    (root / "pd_ll.yaml").write_text(textwrap.dedent(f"""\
        task: pd_ll
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {root / "ll.jsonl"}
        test_split: test
        output_type: loglikelihood
        doc_to_text: "{{{{context}}}}"
        doc_to_target: "{{{{continuation}}}}"
        target_delimiter: ""
        metric_list:
          - metric: perplexity
          - metric: acc
        """))


def per_item(results):
    """task -> [(doc id, [loglikelihood of each request])]"""
    return {task: sorted((s["doc_id"], [r[0][0] for r in s["resps"]]) for s in samples)
            for task, samples in results["samples"].items()}


@pytest.fixture(scope="module")
def lm_eval_env(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    cache = tmp_path_factory.mktemp("hf-cache")
    for k, v in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                 "HF_DATASETS_CACHE": str(cache / "datasets"), "HF_HOME": str(cache)}.items():
        mp.setenv(k, v)
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    root = tmp_path_factory.mktemp("tasks")
    write_tasks(root)
    yield lm_eval, TaskManager(include_path=str(root), include_defaults=False)
    mp.undo()


def test_lm_eval_local_completions_equal_its_hf_backend(stories_path, lm_eval_env):
    lm_eval, tasks = lm_eval_env
    ref = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={stories_path},dtype=float32,device=cpu,add_bos_token=True",
                                  tasks=["pd_mc", "pd_ll"], task_manager=tasks, batch_size=1, log_samples=True)
    want = per_item(ref)
    assert [len(want["pd_mc"]), len(want["pd_ll"])] == [len(MC), len(LL)]
    s = start_server(stories_path)
    try:
        for tokenized in (True, False):
            got = per_item(lm_eval.simple_evaluate(
                model="local-completions",
                model_args=(f"base_url={s.url}/v1/completions,model=stories260k,tokenizer={stories_path},"
                            f"tokenizer_backend=huggingface,tokenized_requests={tokenized},add_bos_token=True,"
                            "max_retries=1"),
                tasks=["pd_mc", "pd_ll"], task_manager=tasks, log_samples=True))
            for task in ("pd_mc", "pd_ll"):
                assert [d for d, _ in got[task]] == [d for d, _ in want[task]]
                for (d, g), (_, w) in zip(got[task], want[task]):
                    assert len(g) == len(w) and max(abs(a - b) for a, b in zip(g, w)) < 1e-4, (tokenized, task, d,
                                                                                               g, w)
    finally:
        stop_server(s)


def test_lm_eval_runs_on_a_gguf_only_model_with_the_exported_tokenizer(stories_path, lm_eval_env, tmp_path):
    """`pagedecode export-tokenizer` makes a GGUF file usable by lm-eval's `local-completions`
    (whose tokenizer is transformers'): the same per-item loglikelihoods as with the checkpoint's
    own Hugging Face tokenizer, against a server over the GGUF."""
    from pagedecode import cli
    lm_eval, tasks = lm_eval_env
    gguf = stories_path / "source" / "stories260K.gguf"
    if not gguf.is_file():
        pytest.skip(f"{gguf} not found")
    assert cli.main(["export-tokenizer", str(gguf), str(tmp_path / "tok")]) == 0
    s = start_server(gguf)
    try:
        def run(tokenizer):
            return per_item(lm_eval.simple_evaluate(
                model="local-completions",
                model_args=(f"base_url={s.url}/v1/completions,model=stories260k,tokenizer={tokenizer},"
                            "tokenizer_backend=huggingface,tokenized_requests=True,add_bos_token=True,max_retries=1"),
                tasks=["pd_mc", "pd_ll"], task_manager=tasks, log_samples=True))
        got, want = run(tmp_path / "tok"), run(stories_path)
    finally:
        stop_server(s)
    for task in ("pd_mc", "pd_ll"):
        assert len(got[task]) == len({"pd_mc": MC, "pd_ll": LL}[task])
        assert got[task] == want[task]
