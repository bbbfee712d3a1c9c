"""Turn a SchedulerOutput into a ForwardBatch (see model/batch.py for the row layout).

The host side builds two flat lists, one per dtype, and makes each one tensor (one copy to the
device each); the batch fields are views into them. The token selector's per-row inputs (each
sampling row's batch slot and output index) ride in the same copy: every other sampling
setting already sits on the device, written when the request took its slot (selector.py)."""
from __future__ import annotations

import torch

from ..lora.stacks import LoRABatch, LoRAStacks, segments
from ..model.batch import ForwardBatch
from .scheduler import SchedulerOutput


def lora_batch(plan: SchedulerOutput, stacks: LoRAStacks | None, device: torch.device) -> LoRABatch | None:
    """The batch's LoRA segments (runs of sequences under one adapter slot); None when no
    sequence of it runs under an adapter."""
    seqs = plan.seqs
    if stacks is None or all(s.request.seq.lora_slot is None for s in seqs):
        return None
    starts, slots = segments([-1 if s.request.seq.lora_slot is None else s.request.seq.lora_slot for s in seqs],
                             [s.num_new for s in seqs])
    table = torch.tensor(starts + slots, dtype=torch.int32)
    if device.type != "cpu":
        table = table.to(device, non_blocking=True)
    return LoRABatch(stacks, table[:len(starts)], table[len(starts):])


def build_batch(plan: SchedulerOutput, page_size: int, device: torch.device,
                lora_stacks: LoRAStacks | None = None) -> ForwardBatch:
    seqs = plan.seqs
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu = [0]
    lens: list[int] = []
    logits_rows: list[int] = []
    logits_seqs: list[int] = []
    sample_slots: list[int] = []                      # per sampling row: its batch slot ...
    sample_index: list[int] = []                      # ... and the output position it chooses
    prompt_rows: list[int] = []                       # rows whose logits score prompt tokens
    prompt_spans: list[tuple[int, int, int]] = []
    draft_rows: list[int] = []                        # after every other row: see ForwardBatch
    max_pages = max(len(s.request.seq.pages) for s in seqs)
    table: list[int] = []
    rows = 0
    for i, s in enumerate(seqs):
        req, start, n = s.request, s.request.seq.num_computed, s.num_new
        pages = req.seq.pages
        if n == 1:                                    # a decode step (or a one-token chunk)
            ids.append(req.token_at(start))
            slots.append(pages[start // page_size] * page_size + start % page_size)
            positions.append(start)
        else:
            known = n - len(s.drafts)                 # a verify: the last known token, then the drafts
            ids.extend(req.token_at(pos) for pos in range(start, start + known))
            ids.extend(s.drafts)
            for pos in range(start, start + n):
                slots.append(pages[pos // page_size] * page_size + pos % page_size)
            positions.extend(range(start, start + n))
        scored = req.prompt_logprob_positions(start, n) if req.params.prompt_logprobs is not None else None
        if scored:
            prompt_rows.extend(rows + p - start for p in scored)
            prompt_spans.append((i, scored.start + 1, len(scored)))
        rows += n
        cu.append(rows)
        lens.append(start + n)
        table.extend(pages)
        if len(pages) < max_pages:
            table.extend([-1] * (max_pages - len(pages)))
        if s.samples:                                 # the row after the last known token
            if req.seq.slot is None:
                raise RuntimeError(f"request {req.request_id} selects a token without a batch slot")
            logits_rows.append(rows - 1 - len(s.drafts))
            logits_seqs.append(i)
            sample_slots.append(req.seq.slot)
            sample_index.append(len(req.output_ids))
        if s.drafts:                                  # rows after each draft: they verify it
            draft_rows.extend(range(rows - len(s.drafts), rows))

    logits_rows += prompt_rows + draft_rows
    S, T, N = len(seqs), rows, len(logits_rows)
    K = len(sample_slots)
    wide = torch.tensor(ids + positions + slots + logits_rows + sample_slots + sample_index, dtype=torch.int64)
    narrow = torch.tensor(table + lens + cu, dtype=torch.int32)
    if device.type != "cpu":
        wide, narrow = wide.to(device, non_blocking=True), narrow.to(device, non_blocking=True)
    nt = S * max_pages
    return ForwardBatch(
        input_ids=wide[:T], positions=wide[T:2 * T], slot_mapping=wide[2 * T:3 * T],
        logits_indices=wide[3 * T:3 * T + N],
        sample_slots=wide[3 * T + N:3 * T + N + K], sample_index=wide[3 * T + N + K:],
        page_table=narrow[:nt].view(S, max_pages), seq_lens=narrow[nt:nt + S], cu_q=narrow[nt + S:],
        num_decode=len(plan.decode), max_new=max(s.num_new for s in seqs),
        request_ids=[s.request.request_id for s in seqs],
        token_ids=[s.request.prompt_ids for s in seqs],
        logits_seqs=logits_seqs, prompt_spans=prompt_spans,
        output_ids=[s.request.output_ids for s in seqs], drafts=[s.drafts for s in seqs],
        lora=lora_batch(plan, lora_stacks, device))
