"""POST /tokenize and POST /detokenize, in vLLM's shapes, so that clients that count or check
tokens (lm-eval, guidellm, aiperf, a gateway) can use the served model's own tokenizer:

    /tokenize    {"prompt": str, "add_special_tokens": true}
                 or {"messages": [...], "add_generation_prompt": true, "add_special_tokens": false,
                     "continue_final_message": false}
                 (+ "return_token_strs": false)
              -> {"count": N, "max_model_len": M, "tokens": [...], "token_strs": [...] | null}
    /detokenize  {"tokens": [...]} -> {"prompt": str}

Messages render through the server's chat template exactly as a chat completion's do (content's
special-token strings stay text unless the server allows them), so `count` is the prompt size a
chat request with those messages would have."""
from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .admission import check_model, read_body
from .chat import ChatTemplate, encode_chat
from .errors import ApiError, bad
from .state import state_of


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise bad(name, f"{name} must be true or false")
    return value


def _body(parsed: Any) -> dict[str, Any]:
    if not isinstance(parsed, dict):
        raise ApiError(400, "the body must be a JSON object")
    return parsed


def _chat_ids(tok: Any, template: ChatTemplate | None, messages: Any, allow_specials: bool,
              add_generation_prompt: bool, add_special_tokens: bool, continue_final_message: bool) -> list[int]:
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise bad("messages", "messages must be a non-empty array of objects")
    if template is None:
        raise ApiError(400, "this model has no chat template (start the server with --chat-template FILE)",
                       param="messages")
    ids = encode_chat(tok, template, messages, allow_specials, add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message)
    bos = tok.bos_token_id
    if add_special_tokens and bos is not None and ids[:1] != [bos]:
        ids = [bos] + ids
    return ids


async def tokenize(request: Request) -> Response:
    state = state_of(request)
    state.tenants.check(request)
    body = _body((await read_body(state, request))[0])
    check_model(state, body)
    has_prompt, has_messages = "prompt" in body, "messages" in body
    if has_prompt == has_messages:
        raise ApiError(400, "give either prompt or messages")
    tok = state.engine.tokenizer
    if has_prompt:
        if not isinstance(body["prompt"], str):
            raise bad("prompt", "prompt must be a string")
        ids = list(tok.encode(body["prompt"], add_special_tokens=_flag(body, "add_special_tokens", True)))
    else:
        ids = _chat_ids(tok, state.chat_template, body["messages"], state.options.allow_special_tokens_in_content,
                        _flag(body, "add_generation_prompt", True), _flag(body, "add_special_tokens", False),
                        _flag(body, "continue_final_message", False))
    strs = None
    if _flag(body, "return_token_strs", False):
        to_str = getattr(tok, "id_to_token", None)
        strs = [to_str(i) if callable(to_str) else tok.decode([i], skip_special_tokens=False) for i in ids]
    return JSONResponse({"count": len(ids), "max_model_len": state.engine.max_context, "tokens": ids,
                         "token_strs": strs})


async def detokenize(request: Request) -> Response:
    state = state_of(request)
    state.tenants.check(request)
    body = _body((await read_body(state, request))[0])
    check_model(state, body)
    tokens = body.get("tokens")
    vocab = state.engine.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad("tokens", "tokens must be an array of token ids")
    if any(not 0 <= t < vocab for t in tokens):
        raise bad("tokens", f"token ids must be in [0, {vocab})")
    return JSONResponse({"prompt": state.engine.tokenizer.decode(tokens, skip_special_tokens=False)})


ROUTES = [Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"])]
