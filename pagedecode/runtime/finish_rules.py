"""Whether a selected token ends its request, and why: one pure function, tested directly (and
the message a request fails with when its row allowed no token at all).

Order (docs/design.md, "Finish reasons"): EOS before stops, stops before length, length before context; a grammar that
is complete (its matcher accepted EOS, or allows nothing but EOS next) ends with
grammar_complete, unless a stop string or id hit on the same token. `token` is
the t-th selected token, already appended to req.output_ids; `stop` is the stop the output
pipeline matched on it (None for EOS: EOS never reaches the pipeline).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, AbstractSet

from .lifecycle import FinishReason

if TYPE_CHECKING:
    from .request import Request


def is_eos(req: Request, token: int, eos_ids: AbstractSet[int]) -> bool:
    return token in eos_ids and not req.params.ignore_eos


def check_ending(req: Request, token: int, stop: str | tuple[int, ...] | None, eos_ids: AbstractSet[int], max_context: int,
                 grammar_done: bool = False) -> FinishReason | None:
    """The finish reason token fixes, or None when the request goes on.

    context: the cache will hold num_computed + 1 tokens once this token is decoded; a request
    whose next decode would reach the context C ends now (so a prompt of C - 1 tokens gets
    exactly one token)."""
    if grammar_done and (token in eos_ids or stop is None):
        return FinishReason.GRAMMAR_COMPLETE   # it accepted a stop token, or allows nothing else next
    if is_eos(req, token, eos_ids):
        return FinishReason.EOS
    if stop is not None:
        return FinishReason.STOP_SEQUENCE
    if len(req.output_ids) >= req.params.max_tokens:
        return FinishReason.MAX_OUTPUT_TOKENS
    if req.seq.num_computed + 1 >= max_context:
        return FinishReason.CONTEXT_LIMIT
    return None


def nothing_allowed(req: Request) -> str:
    """Why a request's row had no token to choose (it fails): what masked them, in the order applied."""
    p, why = req.params, []
    if p.logit_bias:
        why.append("logit_bias")
    if len(req.output_ids) < p.min_tokens and (not p.ignore_eos or any(len(q) == 1 for q in p.stop_id_seqs)):
        why.append(f"min_tokens={p.min_tokens} (EOS and stop ids masked)")
    if req.grammar is not None:
        why.append("the grammar")
    masks = " and ".join(why) or "the sampling parameters"
    return f"no token is allowed at output position {len(req.output_ids) + 1}: every token is -inf after {masks}"
