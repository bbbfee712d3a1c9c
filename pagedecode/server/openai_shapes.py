"""OpenAI's chat / completions response shapes, which the handlers share: finish reasons,
choices, usage, SSE frames, chunks, logprobs objects. Pure functions of what the engine returned
(and the tokenizer, for token strings): a replay builds the same bytes."""
from __future__ import annotations

import json
import time
from typing import Any

from ..model.tokenizer import TokenizerLike
from ..runtime.output.events import DeltaEvent, Usage
from ..runtime.output.result import RequestOutput
from ..runtime.lifecycle import FinishReason

# pagedecode's reasons as OpenAI clients know them; every other reason keeps its own name
OPENAI_FINISH = {FinishReason.EOS: "stop", FinishReason.STOP_SEQUENCE: "stop", FinishReason.GRAMMAR_COMPLETE: "stop",
                 FinishReason.MAX_OUTPUT_TOKENS: "length", FinishReason.CONTEXT_LIMIT: "length"}


def reason_name(reason: FinishReason | None) -> str | None:
    """pagedecode's own name of a finish reason (`pagedecode_finish_reason`, logs, error codes)."""
    return None if reason is None else reason.value


def finish_reason(reason: FinishReason | None) -> str | None:
    """OpenAI's finish_reason."""
    if reason is None:
        return None
    return OPENAI_FINISH.get(reason, reason.value)


def stop_reason(out_stop: object) -> Any:
    if isinstance(out_stop, tuple):
        return list(out_stop)
    return out_stop


def finish_fields(out: RequestOutput) -> dict[str, Any]:
    """A choice's ending, in every choice and every stream's finish chunk."""
    return {"finish_reason": finish_reason(out.finish_reason), "stop_reason": stop_reason(out.stop_reason),
            "pagedecode_finish_reason": reason_name(out.finish_reason)}


def completion_choice(index: int, out: RequestOutput, text: str, logprobs: Any) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, **finish_fields(out)}


def chat_choice(index: int, out: RequestOutput, text: str, logprobs: Any) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            **finish_fields(out)}


def id_headers(request_id: str) -> dict[str, str]:
    """The request id as every reply carries it: X-Request-Id, and X-Pagedecode-Request-Id, which a
    proxy in front (Ray Serve's replaces X-Request-Id with its own) leaves alone."""
    return {"X-Request-Id": request_id, "X-Pagedecode-Request-Id": request_id}


def usage_body(u: Usage) -> dict[str, Any]:
    """OpenAI's usage, plus the engine's counts: tokens selected and processed, and speculation's
    drafts verified and accepted."""
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.returned_tokens,
            "total_tokens": u.prompt_tokens + u.returned_tokens, "selected_tokens": u.selected_tokens,
            "processed_tokens": u.processed_tokens,
            "draft_tokens": u.draft_tokens, "accepted_draft_tokens": u.accepted_draft_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "completion_tokens_details": {"accepted_prediction_tokens": u.accepted_prediction_tokens,
                                          "rejected_prediction_tokens": u.rejected_prediction_tokens}}


SUMMED = ("completion_tokens", "selected_tokens", "processed_tokens", "draft_tokens", "accepted_draft_tokens")


def now() -> int:
    return int(time.time())


def sse(data: Any, seq: int | None = None) -> str:
    head = f"id: {seq}\n" if seq is not None else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def sum_usage(outs: list[RequestOutput], n: int = 1) -> dict[str, Any]:
    """The usage of several choices, prompt-major (n per prompt): each prompt's tokens (and
    cached tokens) count once, whatever its n; completion and engine counts are summed."""
    total = usage_body(outs[0].usage)
    for i, o in enumerate(outs[1:], start=1):
        u = usage_body(o.usage)
        for k in SUMMED:
            total[k] += u[k]
        for k, v in u["completion_tokens_details"].items():
            total["completion_tokens_details"][k] += v
        if i % n == 0:                     # the first choice of another prompt
            total["prompt_tokens"] += u["prompt_tokens"]
            total["prompt_tokens_details"]["cached_tokens"] += u["prompt_tokens_details"]["cached_tokens"]
    total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
    return total


def _token_bytes(tok: TokenizerLike, token: int) -> bytes:
    """A token's bytes as it reads inside a text (its leading space kept), where the tokenizer
    knows them exactly; else its lone decode."""
    pieces = tok.byte_pieces
    if pieces is not None and tok.is_shown(token, False):
        value = pieces.byte_fallback_value(token)
        return bytes([value]) if value is not None else pieces.token_bytes(token, False)
    return tok.decode([token], False).encode()


def _token_str(tok: TokenizerLike, token: int) -> str:
    return _token_bytes(tok, token).decode("utf-8", errors="replace")


def logprobs_body(tok: TokenizerLike, out: RequestOutput | DeltaEvent, chat: bool, top_n: int,
                   offset: int = 0) -> Any:
    """OpenAI's logprobs object for a whole output, or for one delta (streaming)."""
    lps = list(out.logprobs or [])
    tops = list(out.top_logprobs or [() for _ in lps])
    strings = [_token_str(tok, t) for t in out.token_ids]
    if chat:
        return {"content": [
            {"token": s, "logprob": lp, "bytes": list(_token_bytes(tok, t)),
             "top_logprobs": [{"token": _token_str(tok, i), "logprob": v,
                               "bytes": list(_token_bytes(tok, i))} for i, v in top[:top_n]]}
            for t, s, lp, top in zip(out.token_ids, strings, lps, tops)]}
    offsets, at = [], offset
    for s in strings:
        offsets.append(at)
        at += len(s)
    return {"tokens": strings, "token_logprobs": lps,
            "top_logprobs": [{_token_str(tok, i): v for i, v in top[:top_n]} for top in tops] if top_n else None,
            "text_offset": offsets}


def echo_logprobs_body(tok: TokenizerLike, out: RequestOutput, top_n: int) -> Any:
    """OpenAI's legacy logprobs object over prompt + completion (echo: true): the prompt's tokens
    first, the first one's logprob and top logprobs null, text offsets running on through both."""
    prompt: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    lps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    tops = out.prompt_top_logprobs or [None] * len(lps)
    at = 0
    for t, lp, top in zip(out.prompt_token_ids, lps, tops):
        s = _token_str(tok, t)
        prompt["tokens"].append(s)
        prompt["token_logprobs"].append(lp)
        prompt["top_logprobs"].append(None if top is None else {_token_str(tok, i): v for i, v in top[:top_n]})
        prompt["text_offset"].append(at)
        at += len(s)
    completion = logprobs_body(tok, out, False, top_n, at)
    body = {k: prompt[k] + completion[k] for k in ("tokens", "token_logprobs", "text_offset")}
    body["top_logprobs"] = prompt["top_logprobs"] + completion["top_logprobs"] if top_n else None
    return body


def prompt_logprobs_body(tok: TokenizerLike, out: RequestOutput) -> list[Any]:
    """vLLM's prompt_logprobs: per prompt token (null for the first), {id: {logprob, rank?,
    decoded_token}} for the token itself and its N most likely alternatives."""
    body: list[Any] = []
    tops = out.prompt_top_logprobs or [None] * len(out.prompt_token_ids)
    for t, lp, top in zip(out.prompt_token_ids, out.prompt_logprobs or [], tops):
        if lp is None:
            body.append(None)
            continue
        entry = {str(t): {"logprob": lp, "decoded_token": _token_str(tok, t)}}
        for rank, (i, v) in enumerate(top or (), 1):
            entry.setdefault(str(i), {"logprob": v, "rank": rank, "decoded_token": _token_str(tok, i)})
            if i == t:
                entry[str(t)]["rank"] = rank
        body.append(entry)
    return body


def chunk_body(rid: str, obj: str, created: int, model: str, chat: bool, text: str, index: int = 0
               ) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": None}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
