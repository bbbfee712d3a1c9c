"""Chat templates: tokenizer_config.json's `chat_template` (or chat_template.jinja, or a GGUF's
tokenizer.chat_template), rendered with the variables transformers provides in a jinja2 sandbox
whose renders are bounded in time, steps and size (template_sandbox.py): the template comes from
the model file, never from a request, but a model file may be hostile. A render is CPU work of
up to TemplateLimits.time_s: run it off the event loop."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from ..errors import InvalidRequestError
from ..model.tokenizer import EscapesSpecialTokens
from ..runtime.intake import check_prompt_bytes
from .errors import ApiError
from .template_budget import TemplateLimitError, TemplateLimits, render_bounded
from .template_sandbox import BoundedEnvironment


def load_template(model_dir: str | Path | None, override: str | Path | None = None) -> tuple[str | None, dict[str, Any]]:
    """(template source or None, special token strings) for a model directory or GGUF file."""
    specials: dict[str, Any] = {}
    source: str | None = None
    if model_dir is not None and Path(model_dir).is_file():       # a GGUF: its metadata has both
        from ..model.gguf_file import chat_template
        source, specials = chat_template(Path(model_dir))
    elif model_dir is not None:
        d = Path(model_dir)
        cfg_file = d / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            v = cfg.get(name)
            specials[name] = v.get("content") if isinstance(v, dict) else v
        t = cfg.get("chat_template")
        if isinstance(t, list):                       # named templates: take "default"
            t = next((x.get("template") for x in t if x.get("name") == "default"), None)
        if isinstance(t, str):
            source = t
        elif (d / "chat_template.jinja").is_file():
            source = (d / "chat_template.jinja").read_text()
    if override is not None:
        source = Path(override).read_text()
    return source, specials


class ChatTemplate:
    """A compiled template (jinja2.TemplateSyntaxError here, at start) and its render limits."""

    def __init__(self, source: str, specials: dict[str, Any], limits: TemplateLimits = TemplateLimits()) -> None:
        from jinja2.exceptions import TemplateError

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def strftime_now(fmt: str) -> str:
            return datetime.now().strftime(fmt)

        env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True)      # its tojson is transformers'
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        self.source = source
        self._template = env.from_string(source)
        self.limits = limits
        self._specials = {k: (v or "") for k, v in specials.items()}

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               extra: dict[str, Any] | None = None, escape: Callable[[str], str] | None = None,
               continue_final_message: bool = False) -> str:
        """The prompt text. escape (a tokenizer's escape_specials) is applied to every string a
        message holds, so what the client typed cannot become the template's special tokens.
        continue_final_message: the last message (the assistant's answer, begun) is left open,
        the text cut where its content ends, so the output continues it (continued())."""
        from jinja2.exceptions import TemplateError
        msgs = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):              # [{"type": "text", "text": ...}, ...]
                parts = []
                for p in content:
                    if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                        raise ApiError(400, "only text content parts are supported", param="messages")
                    parts.append(p["text"])
                content = "".join(parts)
            message = {**m, "content": content}
            msgs.append(message if escape is None else _escaped(message, escape))
        try:
            extra = extra if escape is None else _escaped(extra or {}, escape)
            text = render_bounded(self._template, self.limits, {
                "messages": msgs, "add_generation_prompt": add_generation_prompt, **self._specials, **(extra or {})})
        except TemplateLimitError as e:
            raise ApiError(400, f"the chat template exceeded its limits: {e}", param="messages",
                           code="chat_template_limit") from None
        except TemplateError as e:
            raise ApiError(400, f"the chat template refused these messages: {e}", param="messages") from None
        except Exception as e:        # the template met a value it cannot handle (content: null + "...")
            raise ApiError(400, f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                           param="messages") from None
        return continued(text, msgs[-1]) if continue_final_message else text


def continued(text: str, final: dict[str, Any]) -> str:
    """The rendered chat cut just after the final message's content (what follows it, the end of
    its turn, goes): the prompt of an answer the client began. The template may have trimmed the
    content's surrounding whitespace; then the cut keeps what the template kept. A 400 where the
    content is empty or the template did not render it whole (it cannot be continued)."""
    content = final.get("content")
    core = content.strip() if isinstance(content, str) else ""
    at = text.rfind(core) if core else -1
    if at < 0:
        raise ApiError(400, "continue_final_message: the final message's content must be non-empty text that the "
                       "chat template renders unchanged", param="messages")
    assert isinstance(content, str)
    lead = content.lstrip()
    kept = lead if text.startswith(lead, at) else core      # its trailing whitespace, where the template kept it
    return text[:at + len(kept)]


def encode_chat(tokenizer: Any, template: ChatTemplate, messages: list[dict[str, Any]],
                allow_special_tokens_in_content: bool = False, extra: dict[str, Any] | None = None,
                add_generation_prompt: bool = True, max_context: int | None = None,
                continue_final_message: bool = False) -> list[int]:
    """The prompt ids a chat's messages become: the server's prompt, the Ray router's prefix key
    and /tokenize's count all come from here, so they agree. Special-token text typed in content
    ("</s>") stays plain text, unless allow_special_tokens_in_content (or a tokenizer that cannot
    escape). extra: more template variables (a tool-calling request's `tools`), escaped alike;
    max_context: a prompt that cannot fit is refused before it is encoded; continue_final_message:
    the last message is an answer begun, which the output continues (ChatTemplate.render)."""
    if continue_final_message and add_generation_prompt:        # as vLLM: the client says both
        raise ApiError(400, "continue_final_message cannot be true with add_generation_prompt true (the "
                       "assistant's turn would open after the message to continue): send add_generation_prompt: "
                       "false", param="continue_final_message")
    escape = not allow_special_tokens_in_content and isinstance(tokenizer, EscapesSpecialTokens)
    text = template.render(messages, add_generation_prompt=add_generation_prompt, extra=extra,
                           escape=tokenizer.escape_specials if escape else None,
                           continue_final_message=continue_final_message)
    if max_context is not None:
        try:
            check_prompt_bytes(text, tokenizer, max_context)
        except InvalidRequestError as e:
            raise ApiError(400, str(e), param="messages", code="invalid_value") from None
    return list(tokenizer.encode_escaped(text) if escape else tokenizer.encode(text, add_special_tokens=False))


def _escaped(value: Any, escape: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return escape(value)
    if isinstance(value, dict):
        return {k: _escaped(v, escape) for k, v in value.items()}
    if isinstance(value, list):
        return [_escaped(v, escape) for v in value]
    return value
