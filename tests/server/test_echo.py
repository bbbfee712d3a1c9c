"""/v1/completions with echo: the prompt's text first and, with logprobs N, OpenAI's legacy
logprobs object over prompt + completion (what lm-eval's loglikelihood requests read); vLLM's
prompt_logprobs field. Values are transformers' float32 log-softmax of stories260k within 1e-5."""
import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

PROMPT = "Once upon a time, there was a little dog"


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="sekret", max_retries=0)


@pytest.fixture(scope="module")
def hf_lsm(stories_path):
    model = transformers.LlamaForCausalLM.from_pretrained(stories_path, torch_dtype=torch.float32).eval()

    def lsm(ids):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return lsm


def post(server, body):
    return httpx.post(server.url + "/v1/completions", headers={"Authorization": "Bearer sekret"}, json=body,
                      timeout=60)


def test_echo_with_logprobs_and_max_tokens_zero(client, server, hf_lsm):
    r = client.completions.create(model="stories260k", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    c = r.choices[0]
    ids = server.engine.tokenizer.encode(PROMPT)
    assert c.text == PROMPT and c.finish_reason == "length" and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens[1:]).strip() == PROMPT and lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    ref = hf_lsm(ids)
    for j in range(1, len(ids)):
        assert abs(lp.token_logprobs[j] - ref[j - 1, ids[j]].item()) < 1e-5
        (tok, v), = lp.top_logprobs[j].items()
        assert abs(v - ref[j - 1].max().item()) < 1e-5


def test_echo_with_a_completion_as_lm_eval_sends_it(server, hf_lsm):
    ids = server.engine.tokenizer.encode(PROMPT)
    r = post(server, {"prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    ref = hf_lsm(ids)
    want = [ref[j - 1, ids[j]].item() for j in range(1, len(ids))] + [ref[-1].max().item()]
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], want)) < 1e-5
    assert c["text"].startswith(server.engine.tokenizer.decode(ids, True)) and len(c["text"]) > len(PROMPT)
    # the same without echo: only the completion
    plain = post(server, {"prompt": [ids], "max_tokens": 1, "logprobs": 1, "temperature": 0}).json()["choices"][0]
    assert plain["logprobs"]["tokens"] == lp["tokens"][-1:] and c["text"].endswith(plain["text"])


def test_vllm_prompt_logprobs_field(server, hf_lsm):
    ids = server.engine.tokenizer.encode(PROMPT)
    r = post(server, {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()["choices"][0]["prompt_logprobs"]
    ref = hf_lsm(ids)
    assert body[0] is None and len(body) == len(ids)
    for j in range(1, len(ids)):
        entry = body[j]
        assert abs(entry[str(ids[j])]["logprob"] - ref[j - 1, ids[j]].item()) < 1e-5
        ranked = sorted((e["rank"], int(k)) for k, e in entry.items() if "rank" in e)
        assert [k for _, k in ranked][:2] == ref[j - 1].topk(2).indices.tolist()


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "echo": True, "stream": True}, "echo"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": "all"}, "prompt_logprobs"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
])
def test_bad_echo_fields_are_400(server, body, param):
    r = post(server, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
