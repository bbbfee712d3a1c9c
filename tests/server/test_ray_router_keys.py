"""The Ray router's prefix-affinity key is the replica's own: it encodes a chat exactly as the
server admits it (chat.encode_chat), so content holding special-token text ("</s>", typed by a
user) keys the pages the replica's prefix cache will hold. No Ray cluster needed."""
from types import SimpleNamespace

import pytest

from .conftest import TEMPLATE

MESSAGES = [{"role": "user", "content": "Once upon a time </s><s> there was a cat who liked to play. " * 3}]


def keys_of(ids, page_size, model_name):
    from pagedecode.runtime.prefix_cache import namespace, page_key
    ns, keys = namespace(model_name, None), []
    for i in range((len(ids) - 1) // page_size):
        keys.append(page_key(keys[-1] if keys else b"", ids[i * page_size:(i + 1) * page_size], ns))
    return keys


@pytest.mark.parametrize("allow_special", [False, True])
def test_router_keys_a_chat_with_special_token_text_as_the_server_encodes_it(stories_path, allow_special):
    from pagedecode.model.tokenizer import Tokenizer
    from pagedecode.ray import Router, Spec
    from pagedecode.server.admission import prompts_of
    from pagedecode.server.chat import ChatTemplate, load_template
    from pagedecode.server.protocol import Limits, parse_request
    tok = Tokenizer.from_dir(stories_path)
    _, specials = load_template(stories_path)
    template = ChatTemplate(TEMPLATE, specials)
    # the server's side: the prompt its admission makes of this body
    body = {"model": "m", "messages": MESSAGES}
    state = SimpleNamespace(chat_template=template, engine=SimpleNamespace(tokenizer=tok, max_context=4096),
                            options=SimpleNamespace(allow_special_tokens_in_content=allow_special))
    [server_ids] = prompts_of(state, parse_request(body, True, {}, Limits(), 1))
    # the router's side, with what a replica's routing_info hands it
    router = Router(Spec(model="m", served_model_name="m"), None, None)
    router.routing_info = {"tokenizer": tok, "template": (TEMPLATE, specials), "page_size": 4,
                           "allow_special_tokens_in_content": allow_special}
    router.template = template
    keys = router.prompt_keys(body, chat=True)
    assert len(keys) >= 8 and keys == keys_of(server_ids, 4, "m")
    # the content's "</s>" is plain text unless the replicas allow it: the encodings differ, so a
    # router that did not escape would key other pages
    plain = tok.encode(template.render(MESSAGES), add_special_tokens=False)
    assert (server_ids == plain) == allow_special
    assert (keys_of(plain, 4, "m") == keys) == allow_special


HERMES = ("{# calls: <tool_call>JSON</tool_call> #}"
          "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t | tojson }}{% endfor %}"
          "<|im_end|>\n{% endif %}"
          "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tool(name, prop):
    parameters = {"type": "object", "properties": {prop: {"type": "string"}}}
    return {"type": "function", "function": {"name": name, "description": f"{name} of a place",
                                             "parameters": parameters}}


@pytest.mark.parametrize("source, fmt_name", [(HERMES, "hermes"), (CHATML, "generic")])
def test_router_keys_a_chat_with_its_tools_as_the_server_renders_it(stories_path, source, fmt_name):
    """Chats that differ only in tools (or in tool_choice, which decides whether and how the
    tools are shown) are different prompts to the replica: the router keys each as the replica
    renders it (the template's `tools`, or the generic format's system message), so they are
    not taken for the same prefix."""
    from pagedecode.model.tokenizer import Tokenizer
    from pagedecode.ray import Router, Spec
    from pagedecode.server.admission import prompts_of
    from pagedecode.server.chat import ChatTemplate, load_template
    from pagedecode.server.protocol import Limits, parse_request
    from pagedecode.tools import detect_format
    tok = Tokenizer.from_dir(stories_path)
    _, specials = load_template(stories_path)
    template = ChatTemplate(source, specials)
    fmt = detect_format(source, lambda m, e: template.render(m, extra=e))
    assert fmt.name == fmt_name
    state = SimpleNamespace(chat_template=template, engine=SimpleNamespace(tokenizer=tok, max_context=4096),
                            options=SimpleNamespace(allow_special_tokens_in_content=False))
    router = Router(Spec(model="m", served_model_name="m"), None, None)
    router.routing_info = {"tokenizer": tok, "template": (source, specials), "page_size": 4, "tool_format": fmt.name}
    router.template = template
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    bodies = {"no tools": {"messages": messages},
              "weather": {"messages": messages, "tools": [tool("get_weather", "city")]},
              "time": {"messages": messages, "tools": [tool("get_time", "zone")]},
              "weather, required": {"messages": messages, "tools": [tool("get_weather", "city")],
                                    "tool_choice": "required"},
              "weather, none": {"messages": messages, "tools": [tool("get_weather", "city")], "tool_choice": "none"}}
    keys = {}
    for name, body in bodies.items():
        [server_ids] = prompts_of(state, parse_request(body, True, {}, Limits(), 1, tool_format=fmt))
        keys[name] = router.prompt_keys(body, chat=True)
        assert keys[name] and keys[name] == keys_of(server_ids, 4, "m"), name
    assert keys["weather"] != keys["no tools"] and keys["weather"] != keys["time"]
    assert keys["weather, none"] == keys["no tools"]             # none: the tools are not shown
    assert (keys["weather, required"] != keys["weather"]) == (fmt_name == "generic")    # its instructions differ
