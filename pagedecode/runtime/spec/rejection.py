"""The draft model's rejection rule (Leviathan et al. 2023, Chen et al. 2023) in the engine: which
requests take it, how the draft samples for them, and how a verify run's tokens are chosen and
committed. kernels/rejection.py holds the rule itself (Triton kernel and torch reference).

Which requests (`takes_rejection`): under method="draft", a request that samples (temperature
>= MIN_TEMPERATURE) and whose selection needs nothing per position beyond temperature, top-k,
top-p and min-p: no penalties or logit_bias, no grammar, min_tokens already met, no logprobs.
Every other request keeps the exact-match verification (speculative.py), whose tokens are the
plain engine's, token for token; so do greedy requests, and every request of a deterministic
engine (its seeded tokens must not depend on the verify schedule, which other requests shape).

The draft samples d_j from q_j: the target sampler's own processing (the request's temperature,
top-k, top-p and min-p; kernels/sampling.py `sampling_probs`) of the draft's logits over the
target's vocabulary (draft ids past it are left out; a smaller draft vocabulary leaves the rest
at 0). Its Gumbel-max noise is keyed by (seed, output index, token) on philox's DRAFT_STREAM, so
it is independent of the rule's uniforms and draws at the same index (stream 0).

A run with drafts d_1..d_k verifies them on its rows r_0..r_k (the off-by-one: speculative.py):
p_j = sampling_probs(r_j); d_{j+1} is kept with probability min(1, p_j(d) / q_j(d)), else the
token is drawn from norm(max(p_j - q_j, 0)) and the run stops; with all k kept, a bonus token is
drawn from p_k. So each output token has the target's distribution, whatever the draft's. The
chosen tokens are then committed one at a time through the engine's commit (`take`), so EOS,
stops, hold-back, length and context cut the run at the same token; each kept draft whose
request still decodes makes its K/V valid (`accept_draft`). The tokens are not the plain
engine's (another draw from the same distribution); a seeded request's are reproducible for the
same verify schedule (the gates in speculative.py decide it: with the cost gate, timing does).
A run with a non-finite row fails its request, as the step would where it reached that row.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...kernels.philox import DRAFT_STREAM, gumbel, seed_to_int64
from ...kernels.rejection import rejection_sample
from ...kernels.sampling import MIN_TEMPERATURE, sampling_probs
from ..lifecycle import RequestState
from ..output.events import Event
from ..request import Request
from ..scheduler import ScheduledSeq
from ..selector import Selection, SlotSettings, uses_penalties

if TYPE_CHECKING:
    from .verify_run import Host, VerifyRun


def takes_rejection(req: Request) -> bool:
    """The draft samples for it and the rejection rule verifies it (module docstring)."""
    p = req.params
    return (p.temperature >= MIN_TEMPERATURE and p.logprobs is None and req.grammar is None
            and not uses_penalties(p) and len(req.output_ids) >= p.min_tokens)


def sample_drafts(logits: torch.Tensor, reqs: list[Request], index: list[int], vocab_size: int
                  ) -> tuple[list[int], torch.Tensor, list[bool]]:
    """logits (R, V_draft): one draft row per request; index: the output position each row's token
    takes. Returns each row's token, q (R, vocab_size) float32 it was drawn from, and whether q
    is usable (finite: a draft whose logits are not cuts its proposal there)."""
    x = logits.float()
    if x.shape[-1] >= vocab_size:
        x = x[:, :vocab_size]
    else:
        x = torch.nn.functional.pad(x, (0, vocab_size - x.shape[-1]), value=float("-inf"))
    inp = SlotSettings.of_requests(reqs, index, vocab_size, x.device)
    q = sampling_probs(x, inp)                                                       # (R, V)
    tokens = torch.arange(vocab_size, device=x.device)[None, :]
    noise = gumbel(inp.seed[:, None], inp.output_index[:, None], tokens, DRAFT_STREAM)   # (R, V)
    chosen = (torch.log(q) + noise).argmax(dim=-1)
    usable = torch.isfinite(q).all(dim=-1) & (q.sum(dim=-1) > 0)
    return chosen.tolist(), q, usable.tolist()


def verify_sampled(runs: list[VerifyRun], first_logits: torch.Tensor, draft_logits: torch.Tensor, host: Host,
                   events: list[Event]) -> None:
    """runs: verify runs with draft_probs, each with its row r0 in first_logits (the step's
    choosers' rows) and its rows r1..rk in draft_logits (sum of k, V) from its offset.
    Chooses and commits each run's tokens (module docstring), counting its kept drafts."""
    device, V = draft_logits.device, draft_logits.shape[-1]
    try:
        # every run's rows r0..rk, one after another, as rows of `flat`
        parts: list[torch.Tensor] = []
        reqs: list[Request] = []
        starts: list[int] = []
        for run in runs:
            k = len(run.drafts)
            starts.append(len(reqs))
            parts += [first_logits[run.row:run.row + 1], draft_logits[run.offset:run.offset + k]]
            reqs += [run.request] * (1 + k)
        flat = torch.cat(parts)                                                      # (rows, V)
        p = sampling_probs(flat, SlotSettings.of_requests(reqs, [0] * len(reqs), V, device))   # (rows, V)
        finite = torch.isfinite(flat.float().amax(dim=-1)).tolist()
    except Exception as exc:                     # as a failed step would: these requests fail
        for run in runs:
            host.fail(run.request, exc, events)
        return
    going = []
    for run, start in zip(runs, starts):
        if all(finite[start:start + 1 + len(run.drafts)]):
            going.append((run, start))
        else:
            host.fail(run.request, FloatingPointError("the model returned non-finite logits (NaN or inf) for it"),
                      events)
    if not going:
        return
    try:
        tokens, kept, logprobs = _rule(going, flat, p, host.selector.backend)
    except Exception as exc:
        for run, _ in going:
            host.fail(run.request, exc, events)
        return
    for b, (run, _) in enumerate(going):
        req = run.request
        for j in range(kept[b] + 1):
            is_draft = j < kept[b]
            if is_draft:
                run.keep_draft()
            else:
                run.note_bonus(tokens[b][j])
            try:
                host.take(req, Selection([tokens[b][j]], [logprobs[b][j]], frozenset()), 0, events)
            except Exception as exc:
                host.fail(req, exc, events)
                break
            if not is_draft or req.state != RequestState.DECODING:
                break                              # the run's last token, or an ending cut it here
            host.accept_draft(req)                 # d_{j+1} kept: its K/V is valid


def _rule(going: list[tuple[VerifyRun, int]], flat: torch.Tensor, p: torch.Tensor, backend: str
          ) -> tuple[list[list[int]], list[int], list[list[float]]]:
    """The rejection rule over the runs (each with its first row in flat / p): each run's tokens
    (kept drafts, then one more), its number of kept drafts, and each token's logprob (the
    log-softmax of the target's logits at it, as the sampler reports one)."""
    device, V = p.device, p.shape[-1]
    B, K = len(going), max(len(run.drafts) for run, _ in going)
    target = torch.zeros(B, K + 1, V, dtype=torch.float32, device=device)     # (B, K + 1, V)
    draft = torch.zeros(B, K, V, dtype=torch.float32, device=device)          # (B, K, V)
    ids = torch.zeros(B, K, dtype=torch.int64)
    for b, (run, start) in enumerate(going):
        k, probs = len(run.drafts), run.seq.draft_probs
        assert probs is not None
        target[b, :k + 1] = p[start:start + k + 1]
        draft[b, :k] = probs.to(device)
        ids[b, :k] = torch.tensor(run.drafts)
    reqs = [run.request for run, _ in going]
    meta = torch.tensor([[len(run.drafts) for run, _ in going], [seed_to_int64(r.seed) for r in reqs],
                         [len(r.output_ids) for r in reqs]], dtype=torch.int64).to(device)
    out = rejection_sample(target, draft, ids.to(device), meta[0].to(torch.int32), meta[1], meta[2], backend=backend)
    tokens, kept = out.tokens.tolist(), out.num_accepted.tolist()
    # logprobs of the chosen tokens: run b's token j comes from flat row start_b + j
    rows = [start + j for (_, start), n in zip(going, kept) for j in range(n + 1)]
    chosen = [t for b, n in enumerate(kept) for t in tokens[b][:n + 1]]
    at = torch.tensor([rows, chosen], dtype=torch.int64).to(device)
    lp = torch.log_softmax(flat.float()[at[0]], dim=-1).gather(1, at[1][:, None])[:, 0].tolist()
    logprobs, i = [], 0
    for n in kept:
        logprobs.append(lp[i:i + n + 1])
        i += n + 1
    return [t[:n + 1] for t, n in zip(tokens, kept)], kept, logprobs
