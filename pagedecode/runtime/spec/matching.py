"""Exact-match verification (speculative.py's module text has the step's layout): a verify run's
tokens taken one depth at a time through the engine's own selection and commit, as plain decoding
would take them, until one differs from its draft or ends the request. The draft model's sampled
runs take the rejection rule instead (rejection.py)."""
from __future__ import annotations

import torch

from ..lifecycle import RequestState
from ..output.events import Event
from ..request import Request
from ..selector import SampleRows, Selection, uses_penalties
from .verify_run import Host, VerifyRun


def pick_rows(logits: torch.Tensor, picks: list[int], index: torch.Tensor) -> torch.Tensor:
    """logits' rows `picks` (`index` on its device): a view where they are consecutive (one run, or
    every run of the step in order: the usual case), else a copy. index_select of a verify's rows
    (k x a 49k vocabulary) goes to OpenMP's threads, whose join waits for a descheduled one: on a
    loaded 2-core machine 39 ms a step, a third of a SmolLM2 step."""
    if picks and picks == list(range(picks[0], picks[0] + len(picks))):
        return logits[picks[0]:picks[0] + len(picks)]
    return logits.index_select(0, index)


def verify_matched(runs: list[VerifyRun], first: Selection, logits: torch.Tensor, host: Host,
                   events: list[Event]) -> None:
    """Takes each run's tokens one depth at a time, as plain decoding would, until a token
    differs from its draft or ends the request.

    Row r_j of a run chooses y_{t+1+j} from the history prompt + y1..yt + d1..dj, which is
    the request's history exactly when d1..dj are accepted, the only case it is read. So a
    run whose selection depends on nothing else (_at_once) has every row chosen up front
    in one selector call (_choose_upfront); the others choose one depth at a time after
    the tokens before are taken."""
    runs = _choose_upfront(runs, logits, host, events)
    pending = [(run, first, run.row) for run in runs]
    depth = 0
    while pending:
        went_on = [run for run, sel, row in pending if _take(run, sel, row, depth, host, events)]
        depth += 1
        for run in went_on:                      # its draft was selected: that K/V is valid
            host.accept_draft(run.request)
        pending = [(run, run.upfront, run.upfront_row + depth - 1) for run in went_on
                   if run.upfront is not None]
        later = [run for run in went_on if run.upfront is None]
        if later:
            rows = torch.tensor([run.offset + depth - 1 for run in later], device=logits.device)
            try:
                sel = host.select(logits.index_select(0, rows), [run.request for run in later])
            except Exception as exc:            # as a failed step would: these requests fail
                for run in later:
                    host.fail(run.request, exc, events)
            else:
                pending += [(run, sel, row) for row, run in enumerate(later)]

def _take(run: VerifyRun, sel: Selection, row: int, depth: int, host: Host, events: list[Event]) -> bool:
    """Commits the run's token at this depth; True when it was the draft and the request
    decodes on (its next row is then read)."""
    usable = row not in sel.bad and row not in sel.empty
    hit = usable and depth < len(run.drafts) and sel.tokens[row] == run.drafts[depth]
    if hit:
        run.keep_draft()
    elif usable:
        run.note_bonus(sel.tokens[row])
    try:
        host.take(run.request, sel, row, events)
    except Exception as exc:
        host.fail(run.request, exc, events)
    return hit and run.request.state == RequestState.DECODING

def _choose_upfront(runs: list[VerifyRun], logits: torch.Tensor, host: Host,
                    events: list[Event]) -> list[VerifyRun]:
    """Chooses rows r1..rk of every _at_once run in one selector call, each at its own
    output index (its Philox position). Returns the runs still to take (a failed selection
    fails its requests, as a failed step would)."""
    at_once = [run for run in runs if _at_once(run.request)]
    if not at_once:
        return runs
    picks: list[int] = []
    slots: list[int | None] = []
    index: list[int] = []
    reqs: list[Request] = []
    for run in at_once:
        req, k = run.request, len(run.drafts)
        run.upfront_row = len(picks)
        picks.extend(range(run.offset, run.offset + k))
        slots.extend([req.seq.slot] * k)
        t = len(req.output_ids) + 1            # y_{t+1} is row r0's
        index.extend(range(t, t + k))
        reqs.extend([req] * k)
    try:
        rows = torch.tensor([picks, slots, index], dtype=torch.int64).to(logits.device)
        upfront = host.selector.select(pick_rows(logits, picks, rows[0]), reqs, None, SampleRows(rows[1], rows[2]))
    except Exception as exc:
        for run in at_once:
            host.fail(run.request, exc, events)
        return [run for run in runs if run not in at_once]
    for run in at_once:
        run.upfront = upfront
    return runs

def _at_once(req: Request) -> bool:
    """All of its draft rows can be chosen before any of their tokens is taken (verify)."""
    p = req.params
    return req.grammar is None and not uses_penalties(p) and len(req.output_ids) + 1 >= p.min_tokens
