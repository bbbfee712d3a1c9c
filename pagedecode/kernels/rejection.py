"""Speculative sampling's rejection rule (Leviathan et al. 2023, Chen et al. 2023): the tokens a
draft model proposed are kept or replaced so that the output has exactly the target model's
distribution, whatever the draft's.

Shapes:
    target_probs  (B, K + 1, V) float32: the target's processed distribution at each position
                  (row j after the prompt + j drafts; row K gives the bonus token)
    draft_probs   (B, K, V) float32: the distribution each draft token was sampled from
    draft_ids     (B, K) int64, num_drafts (B,) int32 (row b uses its first num_drafts[b] drafts)
    seed (B,) int64, output_index (B,) int64: the output index of each row's first position
    returns RejectionOutput(tokens int64 (B, K + 1), num_accepted int32 (B,)):
    tokens[b, :num_accepted[b] + 1] are the chosen tokens (accepted drafts, then one more);
    the rest is -1

Rule, position j = 0, 1, ...: with p = target_probs[b, j], q = draft_probs[b, j], d = draft_ids[b, j],
accept d when u * q[d] <= p[d] (u uniform in (0, 1): probability min(1, p[d] / q[d])); otherwise
the token is drawn from max(p - q, 0) normalised, and the row stops. When every draft is
accepted, a bonus token is drawn from target_probs[b, num_drafts[b]].

Randomness as in sampling.py, keyed by (seed, output index, token id), never by batch position:
position j draws at output index output_index + j; the acceptance test's uniform uses the
counter of token id ACCEPT_COUNTER (no vocabulary reaches it), and draws use Gumbel-max over
log(weights) with the token's own counter.

Kernel plan: one program per row; positions in order, each one pass over the vocabulary only
when a draw is needed (a rejection, or the bonus).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._backend import HAS_TRITON, interpreting, use_triton
from .philox import gumbel

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .philox import _philox_gumbel

ACCEPT_COUNTER = 0x7FFFFFFF


@dataclass
class RejectionOutput:
    tokens: torch.Tensor        # (B, K + 1) int64, -1 past the chosen tokens
    num_accepted: torch.Tensor  # (B,) int32


def accept_uniform(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The acceptance test's uniform at (seed, index), from the same Philox word as the noise."""
    g = gumbel(seed, index, torch.full_like(seed, ACCEPT_COUNTER))
    return torch.exp(-torch.exp(-g))


def _draw(weights: torch.Tensor, seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """weights (R, V) >= 0 -> one token per row, with probability weights / sum (Gumbel-max)."""
    V = weights.shape[-1]
    tokens = torch.arange(V, device=weights.device)[None, :]
    g = gumbel(seed[:, None], index[:, None], tokens)                      # (R, V)
    return (torch.log(weights) + g).argmax(dim=-1)


def rejection_sample_ref(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_ids: torch.Tensor,
                         num_drafts: torch.Tensor, seed: torch.Tensor, output_index: torch.Tensor
                         ) -> RejectionOutput:
    B, K1, V = target_probs.shape
    K = K1 - 1
    tokens = torch.full((B, K1), -1, dtype=torch.int64, device=target_probs.device)
    accepted = torch.zeros(B, dtype=torch.int32, device=target_probs.device)
    going = torch.ones(B, dtype=torch.bool, device=target_probs.device)     # no rejection yet
    rows = torch.arange(B, device=target_probs.device)
    for j in range(K + 1):
        at = going & (num_drafts >= j)             # rows that choose a token at position j
        if not bool(at.any()):
            break
        index = output_index + j
        p = target_probs[:, j].float()                                         # (B, V)
        if j < K:
            drafting = at & (num_drafts > j)
            d = draft_ids[:, j].clamp(0, V - 1)
            pd_, qd = p[rows, d], draft_probs[:, j].float()[rows, d]
            ok = drafting & (accept_uniform(seed, index) * qd <= pd_)
            tokens[ok, j] = d[ok]
            accepted += ok.int()
            rejected = drafting & ~ok
            if bool(rejected.any()):
                residual = (p - draft_probs[:, j].float()).clamp(min=0)[rejected]
                tokens[rejected, j] = _draw(residual, seed[rejected], index[rejected])
            going = going & ~rejected
            bonus = at & (num_drafts == j)
        else:
            bonus = at
        if bool(bonus.any()):
            tokens[bonus, j] = _draw(p[bonus], seed[bonus], index[bonus])
            going = going & ~bonus
    return RejectionOutput(tokens, accepted)


if HAS_TRITON:
    @triton.jit
    def _draw_row(w_ptr, q_ptr, seed, index, V, SUBTRACT: tl.constexpr, BLOCK_V: tl.constexpr):
        """argmax over v of log(w[v] (- q[v], clamped at 0)) + Gumbel(seed, index, v)."""
        lanes = tl.arange(0, BLOCK_V)
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_at = tl.full([BLOCK_V], 0, tl.int32)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + lanes
            ok = offs < V
            w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            if SUBTRACT:
                w = tl.maximum(w - tl.load(q_ptr + offs, mask=ok, other=0.0).to(tl.float32), 0.0)
            score = tl.where(ok, tl.log(w) + _philox_gumbel(seed, index, offs), float("-inf"))
            better = score > best
            best_at = tl.where(better, offs, best_at)
            best = tl.where(better, score, best)
        top = tl.max(best, 0)
        return tl.min(tl.where(best == top, best_at, V), 0)

    @triton.jit
    def _rejection_kernel(target_ptr, draft_ptr, ids_ptr, n_ptr, seed_ptr, index_ptr, tokens_ptr, accepted_ptr,
                          V, K, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        n = tl.load(n_ptr + row)
        seed = tl.load(seed_ptr + row)
        first = tl.load(index_ptr + row)
        target = target_ptr + row * (K + 1) * V
        draft = draft_ptr + row * K * V
        accepted = n * 0
        going = n >= 0                                     # True: no rejection yet
        for j in range(0, K):
            if going & (j < n):
                d = tl.load(ids_ptr + row * K + j)
                p = tl.load(target + j * V + d)
                q = tl.load(draft + j * V + d)
                u = tl.exp(-tl.exp(-_philox_gumbel(seed, first + j, d * 0 + 0x7FFFFFFF)))
                if u * q <= p:
                    tl.store(tokens_ptr + row * (K + 1) + j, d)
                    accepted += 1
                else:
                    tok = _draw_row(target + j * V, draft + j * V, seed, first + j, V, True, BLOCK_V)
                    tl.store(tokens_ptr + row * (K + 1) + j, tok.to(tl.int64))
                    going = going & False
        if going:                                          # every draft accepted: the bonus token
            tok = _draw_row(target + n * V, target, seed, first + n, V, False, BLOCK_V)
            tl.store(tokens_ptr + row * (K + 1) + n, tok.to(tl.int64))
        tl.store(accepted_ptr + row, accepted)


def rejection_sample_triton(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_ids: torch.Tensor,
                            num_drafts: torch.Tensor, seed: torch.Tensor, output_index: torch.Tensor
                            ) -> RejectionOutput:
    B, K1, V = target_probs.shape
    tokens = torch.full((B, K1), -1, dtype=torch.int64, device=target_probs.device)
    accepted = torch.zeros(B, dtype=torch.int32, device=target_probs.device)
    if B == 0:
        return RejectionOutput(tokens, accepted)
    block_v = min(triton.next_power_of_2(V), 256 if interpreting() else 4096)
    _rejection_kernel[(B,)](target_probs.float().contiguous(), draft_probs.float().contiguous(),
                            draft_ids.contiguous(), num_drafts.to(torch.int32).contiguous(), seed.contiguous(),
                            output_index.contiguous(), tokens, accepted, V, K1 - 1, BLOCK_V=block_v,
                            num_warps=8, enable_fp_fusion=False)
    return RejectionOutput(tokens, accepted)


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_ids: torch.Tensor,
                     num_drafts: torch.Tensor, seed: torch.Tensor, output_index: torch.Tensor,
                     backend: str = "auto") -> RejectionOutput:
    """Keep or replace each row's drafts (module docstring); the output has the target's
    distribution at every position."""
    if use_triton(target_probs, backend):
        return rejection_sample_triton(target_probs, draft_probs, draft_ids, num_drafts, seed, output_index)
    return rejection_sample_ref(target_probs, draft_probs, draft_ids, num_drafts, seed, output_index)
