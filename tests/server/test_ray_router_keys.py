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
