"""benchmarks/tool_calls.py's smallest run, on the built-in random model behind a real server
(the benchmark itself runs SmolLM2; two tools, as the random model's context is 1024): it asks under every tool_choice mode, judges the calls
(a random model follows nothing but the grammar, so required / named are valid and nothing
else is promised), pairs each constrained request with an unconstrained one of the same prompt
and length, and writes the JSON it promises. Its prompts and schemas hold together."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

pytest.importorskip("openai")
pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

import tool_calls  # noqa: E402

# a template without tool support that shows the system message (the generic format's tools)
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def test_prompts_and_schemas_hold_together():
    import jsonschema
    assert len(tool_calls.TOOLS) >= 10 and len(tool_calls.PROMPTS) >= 100
    assert {name for name, _ in tool_calls.PROMPTS} == set(tool_calls.SCHEMAS)
    for schema in tool_calls.SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)
    firsts = [name for name, _ in tool_calls.PROMPTS[:len(tool_calls.TOOLS)]]
    assert sorted(firsts) == sorted(tool_calls.SCHEMAS)          # any first n prompts take the tools in turn


def test_smallest_run_on_the_random_model(tmp_path):
    from pagedecode.model.default_model import default_model_path
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    out = tmp_path / "tool_calls.json"
    assert tool_calls.main(["--model", str(default_model_path()), "--chat-template", str(template),
                            "--prompts", "2", "--tools", "2", "--max-tokens", "300", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["tool_format"] == "generic" and result["prompts"] == 2 and result["tools"] == 2
    assert result["load_before"] and [r["tool"] for r in result["rows"][::3]] == ["get_weather", "get_time"]
    assert set(result["modes"]) == {"auto", "required", "named"}
    for mode in ("required", "named"):
        s = result["modes"][mode]
        assert s["requests"] == 2 and s["valid_pct"] == 100.0, s["invalid"]
        assert s["latency_s"]["p50"] > 0
        over = s["constraint_overhead"]
        assert over["pairs"] == 2, "each constrained answer is paired with an unconstrained one"
        assert over["decode_ms_per_token"]["constrained"]["p50"] > 0
    named = [r for r in result["rows"] if r["mode"] == "named"]
    assert all(r["first_call"]["name"] == r["tool"] and r["intended"] for r in named)
    assert all(r["unconstrained"]["same_prompt"] for r in named)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert out.with_suffix(".png").exists()
