"""LoRA adapters over HTTP (server/lora.py): --lora-modules served by name through `model`,
/v1/models listing them with parent and root, the run-time load / unload endpoints behind
--allow-runtime-lora (403 otherwise), 404 naming an unknown adapter, 400 naming a bad one."""
import json

import httpx
import pytest

import pagedecode as pd

from ..lora.helpers import write_adapter
from .conftest import start_server, stop_server

PROMPT = "Once upon a time"
BODY = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def folders(stories_path, tmp_path_factory):
    config = json.loads((stories_path / "config.json").read_text())
    root = tmp_path_factory.mktemp("adapters")
    return {"good": write_adapter(root / "good", config, r=8, std=0.3),
            "other": write_adapter(root / "other", config, r=4, std=0.3),
            "big": write_adapter(root / "big", config, r=128)}


def alone(stories_path, folder, name):
    engine = pd.Engine.from_pretrained(stories_path)
    return engine.generate(PROMPT, pd.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                           lora=None if folder is None else pd.LoRARequest(name, folder))[0].text


def test_served_adapters_by_name(stories_path, folders):
    s = start_server(stories_path, lora_modules=(("good", str(folders["good"])),))
    try:
        cards = httpx.get(s.url + "/v1/models").json()["data"]
        assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
            ("stories260k", None, "stories260k"), ("good", "stories260k", str(folders["good"]))]
        texts = {m: httpx.post(s.url + "/v1/completions", json={**BODY, "model": m}, timeout=60).json()
                 ["choices"][0]["text"] for m in ("good", "stories260k")}
        assert texts["good"] == alone(stories_path, folders["good"], "good") != texts["stories260k"]
        assert texts["stories260k"] == alone(stories_path, None, "")
        assert_responses_name_the_adapter(s.url)
        r = httpx.post(s.url + "/v1/completions", json={**BODY, "model": "nope"})
        assert r.status_code == 404 and "'nope'" in r.json()["error"]["message"]
        r = httpx.post(s.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(folders["other"])})
        assert r.status_code == 403 and "--allow-runtime-lora" in r.json()["error"]["message"]
        assert httpx.post(s.url + "/v1/unload_lora_adapter", json={"lora_name": "good"}).status_code == 403
    finally:
        stop_server(s)


def assert_responses_name_the_adapter(url):
    """Every response shape names the model the request named, an adapter's or the base's
    (vLLM's answers do); a stored response fetched later too."""
    for model in ("good", "stories260k"):
        assert httpx.post(url + "/v1/completions", json={**BODY, "model": model}, timeout=60).json()["model"] == model
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).json()["model"] == model
        with httpx.stream("POST", url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert chunks and {c["model"] for c in chunks} == {model}
        resp = httpx.post(url + "/v1/responses", json={"model": model, "input": "hi", "max_output_tokens": 4},
                          timeout=60).json()
        assert resp["model"] == model
        assert httpx.get(url + f"/v1/responses/{resp['id']}", timeout=60).json()["model"] == model
        msg = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(url + "/v1/messages", json=msg, timeout=60).json()["model"] == model


def test_adapters_loaded_and_unloaded_at_run_time(stories_path, folders):
    s = start_server(stories_path, template=None, allow_runtime_lora=True, engine_options={"max_lora_rank": 64})
    try:
        load = s.url + "/v1/load_lora_adapter"
        r = httpx.post(load, json={"lora_name": "big", "lora_path": str(folders["big"])})
        assert r.status_code == 400 and "'big'" in r.json()["error"]["message"] and "max_lora_rank 64" in r.text
        r = httpx.post(load, json={"lora_name": "gone", "lora_path": str(folders["big"].parent / "nowhere")})
        assert r.status_code == 400 and "'gone'" in r.json()["error"]["message"]
        assert httpx.post(load, json={"lora_name": "other"}).status_code == 400          # no lora_path
        assert httpx.post(load, json={"lora_name": "other", "lora_path": str(folders["other"])}).status_code == 200
        assert httpx.post(load, json={"lora_name": "other", "lora_path": str(folders["other"])}).status_code == 400
        assert [c["id"] for c in httpx.get(s.url + "/v1/models").json()["data"]] == ["stories260k", "other"]
        r = httpx.post(s.url + "/v1/completions", json={**BODY, "model": "other"}, timeout=60)
        assert r.json()["choices"][0]["text"] == alone(stories_path, folders["other"], "other")
        assert httpx.post(s.url + "/v1/unload_lora_adapter", json={"lora_name": "other"}).status_code == 200
        r = httpx.post(s.url + "/v1/unload_lora_adapter", json={"lora_name": "other"})
        assert r.status_code == 404 and "'other'" in r.json()["error"]["message"]
        assert httpx.post(s.url + "/v1/completions", json={**BODY, "model": "other"}).status_code == 404
        assert httpx.post(s.url + "/v1/completions", json=BODY, timeout=60).status_code == 200   # serving on
    finally:
        stop_server(s)
