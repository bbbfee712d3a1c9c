"""Speculative decoding through the server and the command line: the same text as without it,
the draft counts in the usage the engine reports, and vLLM's spec_decode counters on /metrics."""
import json

import httpx

import pagedecode as pd
from pagedecode import cli

from .conftest import start_server, stop_server

NAMES = ("pagedecode:spec_decode_num_drafts_total", "pagedecode:spec_decode_num_draft_tokens_total",
         "pagedecode:spec_decode_num_accepted_tokens_total")


def scrape(url):
    text = httpx.get(url + "/metrics").text
    return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines() if ln.startswith("pagedecode:"))}


def test_completions_equal_and_metrics_count_the_drafts(stories_path):
    passage = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
               "One day, she saw a big, red ball.")
    body = {"model": "stories260k", "prompt": passage + "\n" + passage[:30], "max_tokens": 48, "temperature": 0}
    texts = []
    for spec in (None, pd.SpeculativeConfig(method="ngram", num_tokens=4)):
        s = start_server(stories_path, template=None, engine_options={"speculative": spec})
        try:
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
            m, snap = scrape(s.url), s.engine.snapshot()
            assert [m[n] for n in NAMES] == [snap.spec_decode_num_drafts, snap.spec_decode_num_draft_tokens,
                                             snap.spec_decode_num_accepted_tokens]
        finally:
            stop_server(s)
    assert texts[0] == texts[1]
    assert m[NAMES[2]] > 0          # the speculative server accepted drafts


def test_flags_on_generate_demo_and_serve(stories_path, capsys):
    ap = cli.build_parser()
    for cmd in (["generate", "--prompt", "x"], ["demo"], ["serve"]):
        args = ap.parse_args(cmd + ["--speculative-method", "ngram", "--num-speculative-tokens", "3"])
        assert (args.speculative_method, args.num_speculative_tokens, args.draft_model) == ("ngram", 3, None)
    argv = ["generate", "--model", str(stories_path), "--prompt", "Once upon a time", "--max-tokens", "40"]
    assert cli.main(argv) == 0
    plain = capsys.readouterr().out
    assert cli.main(argv + ["--speculative-method", "ngram", "--num-speculative-tokens", "5"]) == 0
    assert capsys.readouterr().out == plain
    assert cli.main(argv + ["--num-speculative-tokens", "0", "--speculative-method", "ngram"]) == 2
    assert "num_tokens" in capsys.readouterr().err
    assert cli.main(argv + ["--draft-model", str(stories_path)]) == 2
    assert "--speculative-method draft" in capsys.readouterr().err
    assert cli.main(argv + ["--speculative-prompt-lookup"]) == 2
    assert "--speculative-method draft" in capsys.readouterr().err
    assert cli.main(argv + ["--speculative-method", "ngram", "--speculative-prompt-lookup"]) == 2
    assert "prompt_lookup" in capsys.readouterr().err
    assert cli.main(argv + ["--speculative-method", "draft", "--speculative-draft-quantization", "q8_0",
                            "--speculative-prompt-lookup", "--speculative-min-draft-confidence", "0.5"]) == 0
    assert capsys.readouterr().out == plain
    for bad, says in ((["--speculative-min-draft-confidence", "0.5"], "--speculative-method draft"),
                      (["--speculative-method", "ngram", "--speculative-min-draft-confidence", "0.5"], "only for"),
                      (["--speculative-method", "draft", "--speculative-draft-quantization", "q8_0",
                        "--speculative-min-draft-confidence", "1.5"], "min_draft_confidence")):
        assert cli.main(argv + bad) == 2
        assert says in capsys.readouterr().err


def chat_text(url, extra, stream=False):
    body = {"model": "stories260k", "messages": [{"role": "user", "content": "Once upon a time"}],
            "max_tokens": 40, "temperature": 0, **extra}
    if not stream:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"], r.json()["usage"], r.headers
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    text, usage = "", None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
                usage = chunk.get("usage") or usage
        return text, usage, r.headers


def test_predicted_outputs_over_chat_completions(stories_path):
    """OpenAI's `prediction`: the same text as without it, streamed or not; the prediction's
    accepted and rejected tokens in usage.completion_tokens_details, the drafts in the usage."""
    s = start_server(stories_path)
    try:
        plain, usage, headers = chat_text(s.url, {})
        assert usage["draft_tokens"] == usage["accepted_draft_tokens"] == 0
        assert usage["completion_tokens_details"] == {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
        assert headers["x-pagedecode-request-id"] == headers["x-request-id"]
        edited = plain.replace(" the ", " a ", 1)
        for prediction in (plain, [{"type": "text", "text": edited[:20]}, {"type": "text", "text": edited[20:]}]):
            for stream in (False, True):
                text, usage, headers = chat_text(s.url, {"prediction": {"type": "content", "content": prediction}},
                                                 stream)
                assert text == plain
                details = usage["completion_tokens_details"]
                assert usage["accepted_draft_tokens"] >= details["accepted_prediction_tokens"] > 10
                assert details["rejected_prediction_tokens"] <= usage["draft_tokens"] - usage["accepted_draft_tokens"]
                assert headers["x-pagedecode-request-id"] == headers["x-request-id"]
        for bad, field in (({"type": "text", "content": "x"}, "prediction"), ({"type": "content"}, "prediction.content"),
                           ({"type": "content", "content": [{"type": "image"}]}, "prediction.content"), ("x", "prediction")):
            r = httpx.post(s.url + "/v1/chat/completions", timeout=30, json={
                "model": "stories260k", "messages": [{"role": "user", "content": "Hi"}], "prediction": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    finally:
        stop_server(s)
