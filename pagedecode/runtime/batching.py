"""Turn a SchedulerOutput into a ForwardBatch (see model/batch.py for the row layout)."""
from __future__ import annotations

import torch

from ..model.batch import ForwardBatch
from .scheduler import SchedulerOutput


def build_batch(plan: SchedulerOutput, page_size: int, device: torch.device) -> ForwardBatch:
    seqs = plan.seqs
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu = [0]
    lens: list[int] = []
    logits_rows: list[int] = []
    logits_seqs: list[int] = []
    max_pages = max(len(s.request.pages) for s in seqs)
    table = []
    for i, s in enumerate(seqs):
        req, start, n = s.request, s.request.num_computed, s.num_new
        pages = req.pages
        for pos in range(start, start + n):
            ids.append(req.token_at(pos))
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
        positions.extend(range(start, start + n))
        cu.append(cu[-1] + n)
        lens.append(start + n)
        table.append(pages + [-1] * (max_pages - len(pages)))
        if s.samples:
            logits_rows.append(cu[-1] - 1)
            logits_seqs.append(i)

    def t(x: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    return ForwardBatch(
        input_ids=t(ids, torch.int64), positions=t(positions, torch.int64),
        slot_mapping=t(slots, torch.int64), page_table=t(table, torch.int32),
        seq_lens=t(lens, torch.int32), cu_q=t(cu, torch.int32),
        logits_indices=t(logits_rows, torch.int64), num_decode=len(plan.decode),
        max_new=max(s.num_new for s in seqs),
        request_ids=[s.request.request_id for s in seqs],
        token_ids=[s.request.prompt_ids for s in seqs],
        logits_seqs=logits_seqs,
        output_ids=[s.request.output_ids for s in seqs])
