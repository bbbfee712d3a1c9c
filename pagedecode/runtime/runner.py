"""StepRunner: everything between scheduling and commit. It builds the batch, runs the model and
chooses tokens; it reads the requests of a plan and changes none of them (the commit does), so
a failure here leaves nothing of the step behind."""
from __future__ import annotations

import torch

from ..lora.manager import LoRAManager
from ..model.kv_cache import KVCache
from ..protocols import Model
from .batching import build_batch
from .grammar import Constraints
from .request import Request
from .scheduler import SchedulerOutput
from .selector import SampleRows, Selection, TokenSelector, prompt_logprobs


class StepRunner:
    def __init__(self, model: Model, kv: KVCache, selector: TokenSelector, constraints: Constraints,
                 page_size: int, device: torch.device, lora: LoRAManager | None = None) -> None:
        self.model = model
        self.lora = lora                 # the adapters' stacks, when a request runs under one
        self.kv = kv
        self.selector = selector
        self.constraints = constraints
        self.page_size = page_size
        self.device = device

    def run(self, plan: SchedulerOutput) -> Selection:
        """The plan's forward and its selection: one token per sampling sequence, prompt logprobs
        where asked, and the logits after each draft token (verified at the commit)."""
        for req in plan.admitted:       # a (re)admitted request brings its sampler state to its slot
            self.selector.admit(req)
        batch = build_batch(plan, self.page_size, self.device, None if self.lora is None else self.lora.stacks)
        logits = self.model.forward(batch, self.kv)
        choosers = [s.request for s in plan.seqs if s.samples]
        n, scored = len(choosers), sum(c for _, _, c in batch.prompt_spans)
        drafts = sum(len(s.drafts) for s in plan.verify)
        if logits.shape[0] != n + scored + drafts:
            raise RuntimeError(f"the model returned {logits.shape[0]} rows of logits for {n} sequences"
                               + (f" and {scored} prompt positions (prompt_logprobs)" if scored else "")
                               + (f" and {drafts} draft tokens" if drafts else ""))
        assert batch.sample_slots is not None and batch.sample_index is not None
        self.selector.stage_rows(SampleRows(batch.sample_slots, batch.sample_index))   # came with the batch
        selection = self.select(logits[:n], choosers)
        if scored:
            selection.prompt = prompt_logprobs(logits[n:n + scored], batch.prompt_spans,
                                               [s.request for s in plan.seqs])
        if drafts:
            selection.drafts = logits[n + scored:]
            selection.chooser_logits = logits[:n]
        return selection

    def select(self, logits: torch.Tensor, choosers: list[Request]) -> Selection:
        """One row of logits per request -> its token, with its grammar's mask for this position
        (each row's slot and output position: the staged ones, else read off the requests), and a
        tool call's token replaced where the call would not finish within its budget."""
        grammars = [r.grammar for r in choosers]
        if all(g is None for g in grammars):
            return self.selector.select(logits, choosers, None)
        bitmask = self.constraints.rows(grammars, [r.seq.slot for r in choosers], [len(r.output_ids) for r in choosers])
        sel = self.selector.select(logits, choosers, bitmask)
        for row, token in self.constraints.close_in_budget(choosers, sel.tokens, sel.bad | sel.empty).items():
            self.selector.replace(sel, row, choosers[row], token)
        return sel
