"""A verify run (one request's drafts in one step) and what verifying needs from the engine.

The run carries its own rows and what verification has kept so far, so the exact-matching
loop (speculative.py) and the rejection rule (rejection.py) read and write fields of the
run, not tables keyed by it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..output.events import Event
from ..request import Request
from ..scheduler import ScheduledSeq
from ..selector import Selection, TokenSelector


class Host(Protocol):
    """What the verification loop needs from the engine: its own selection and commit (commit.py)."""

    selector: TokenSelector

    def select(self, logits: torch.Tensor, choosers: list[Request]) -> Selection: ...

    def take(self, req: Request, sel: Selection, i: int, events: list[Event]) -> None: ...

    def fail(self, req: Request, exc: BaseException, events: list[Event]) -> None: ...

    def accept_draft(self, req: Request) -> None: ...

    def after_verify(self, req: Request) -> None: ...


@dataclass(eq=False)
class VerifyRun:
    seq: ScheduledSeq
    row: int                          # its row r0 in the step's first selection
    offset: int                       # its first row in the step's draft logits (rows r1..rk)
    record: dict | None               # its trace record (level "tokens"), completed as tokens are taken
    accepted: int = 0                 # drafts kept so far
    upfront: Selection | None = None  # exact matching: rows r1..rk chosen before any is taken ...
    upfront_row: int = 0              # ... r1's row in it

    @property
    def request(self) -> Request:
        return self.seq.request

    @property
    def drafts(self) -> tuple[int, ...]:
        return self.seq.drafts

    def keep_draft(self) -> None:
        """Its next draft was selected."""
        req = self.request
        req.accepted_draft_tokens += 1
        if req.prediction is not None and not self.seq.lookup:
            req.prediction.accepted += 1
        self.accepted += 1
        if self.record is not None:
            self.record["accepted"] += 1

    def note_bonus(self, token: int) -> None:
        """The token after the kept drafts."""
        if self.record is not None:
            self.record["bonus"] = token
