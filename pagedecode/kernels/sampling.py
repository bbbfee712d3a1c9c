"""Token selection: penalties and logit bias, greedy, temperature, top-k, min-p, top-p and
Gumbel-max noise, plus the chosen token's logprob, in one kernel.

Shapes:
    logits       (B, V) float: one row per request that selects a token this step
    SamplingInputs fields, each (S,), read through `slot` (B,) when given (a caller such as the
    engine keeps one entry per batch slot on the device), else S = B and row i reads entry i:
        temperature  float32, 0 means greedy (first index of the maximum)
        top_k        int32, 0 disables; keeps every token >= the k-th largest value (ties kept)
        top_p        float32 in (0, 1]; keeps the smallest set of most likely tokens whose mass
                     reaches top_p of the mass left after top-k and min-p (ties kept)
        log_min_p    float32, log(min_p) or -inf: keeps z >= max(z) + log_min_p
        seed         int64 (the 64-bit seed's bits)
    and per row: output_index (B,) int64, slot (B,) int32 / int64 or None
    returns SampleOutput(tokens int64 (B,), logprobs float32 (B,), processed float32 (B, V): the
    logits after penalties, bias and mask); a row left with no token above -inf (bias, mask) gets
    a NaN logprob on both paths, and its token means nothing

Kernel plan, one program per row (its row-selection steps: row_select.py): pass 1 applies penalties (writing the processed row once) and
takes max / sum-exp / argmax; top-k's k-th value comes from a radix select (4 passes); when
top-k / min-p leave at most CANDIDATES tokens they are gathered once and top-p and the draw run
in registers, otherwise top-p bisects over the row and a last pass draws.

Semantics (both paths): z = logits / temperature; the kept set is z >= threshold; the token is
argmax over kept of z + g, g = Gumbel noise keyed by (seed, output index, token id). With
PenaltyInputs, `logits` above means the logits after penalties and bias (penalties.py). The
logprob is log_softmax(logits)[token] of those logits (before temperature and filters).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._backend import HAS_TRITON, interpreting, use_triton
from .penalties import PenaltyInputs, apply_penalties_ref
from .philox import GUMBEL_MAX, GUMBEL_MIN, gumbel

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .penalties import _penalize
    from .philox import _philox_gumbel
    from .row_select import _bisect, _compact, _order_key, _pick, _radix_kth, _tile_top_p


@dataclass
class SamplingInputs:
    temperature: torch.Tensor       # (S,) each, indexed by slot (module docstring)
    top_k: torch.Tensor
    top_p: torch.Tensor
    log_min_p: torch.Tensor
    seed: torch.Tensor
    output_index: torch.Tensor      # (B,): per row, as a request may sample several positions
    slot: torch.Tensor | None = None   # (B,): which entry each row reads; None: row i reads entry i

    def to(self, device) -> "SamplingInputs":
        return SamplingInputs(self.temperature.to(device), self.top_k.to(device), self.top_p.to(device),
                              self.log_min_p.to(device), self.seed.to(device), self.output_index.to(device),
                              None if self.slot is None else self.slot.to(device))

    def per_row(self) -> "SamplingInputs":
        """The same inputs with one entry per row (slot None)."""
        if self.slot is None:
            return self
        at = self.slot.long()
        return SamplingInputs(self.temperature[at], self.top_k[at], self.top_p[at], self.log_min_p[at],
                              self.seed[at], self.output_index)


@dataclass
class SampleOutput:
    tokens: torch.Tensor            # (B,) int64
    logprobs: torch.Tensor          # (B,) float32
    processed: torch.Tensor         # (B, V) float32: the logits after penalties, bias and mask (what
                                    # logprobs are taken from); may be the caller's scratch or input


class SamplerScratch:
    """The kernel's working buffers, owned by the caller and reused by every call: the processed
    rows (with penalties or a mask) and the top-k / min-p candidates. Grown to the largest batch
    seen, never shrunk; what a call returns in `processed` is valid until the next call."""

    def __init__(self) -> None:
        self._proc: torch.Tensor | None = None
        self._cand_z: torch.Tensor | None = None
        self._cand_i: torch.Tensor | None = None

    @staticmethod
    def _fits(t: torch.Tensor | None, rows: int, cols: int, device: torch.device) -> bool:
        return t is not None and t.shape[0] >= rows and t.shape[1] == cols and t.device == device

    def processed(self, rows: int, V: int, device: torch.device) -> torch.Tensor:
        if not self._fits(self._proc, rows, V, device):
            self._proc = torch.empty(rows, V, dtype=torch.float32, device=device)
        assert self._proc is not None
        return self._proc[:rows]

    def candidates(self, rows: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._fits(self._cand_z, rows, width, device):
            self._cand_z = torch.empty(rows, width, dtype=torch.float32, device=device)
            self._cand_i = torch.empty(rows, width, dtype=torch.int32, device=device)
        assert self._cand_z is not None and self._cand_i is not None
        return self._cand_z[:rows], self._cand_i[:rows]


# Top-k / min-p survivors kept in registers for top-p and the draw; more than this falls back
# to passes over the whole row. Small in the interpreter so tests reach both paths.
CANDIDATES = 1024
CANDIDATES_INTERPRETED = 32
MIN_TEMPERATURE = 1e-5   # below this, logits / T overflows to inf (inf - inf = NaN): greedy instead


def make_sampling_inputs(temperature, top_k, top_p, min_p, seed, output_index, device="cpu"):
    """Build SamplingInputs from per-row Python lists (min_p as a probability). A temperature
    under MIN_TEMPERATURE selects greedily, on both paths."""
    import math
    return SamplingInputs(
        temperature=torch.tensor([t if t >= MIN_TEMPERATURE else 0.0 for t in temperature],
                                 dtype=torch.float32, device=device),
        top_k=torch.tensor(top_k, dtype=torch.int32, device=device),
        top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
        log_min_p=torch.tensor([math.log(p) if p > 0 else float("-inf") for p in min_p],
                               dtype=torch.float32, device=device),
        seed=torch.tensor(seed, dtype=torch.int64, device=device),
        output_index=torch.tensor(output_index, dtype=torch.int64, device=device))


def thresholds_ref(z: torch.Tensor, top_k, top_p, log_min_p) -> torch.Tensor:
    """Per row, the smallest kept value of z (R, V) after top-k, min-p and top-p, by sorting."""
    R, V = z.shape
    zs = z.sort(dim=-1, descending=True).values                      # (R, V)
    zmax = zs[:, 0]
    thr = torch.full((R,), float("-inf"), device=z.device)
    k = top_k.long()
    kth = zs.gather(1, (k - 1).clamp(0, V - 1)[:, None])[:, 0]
    thr = torch.where((k > 0) & (k < V), kth, thr)
    thr = torch.maximum(thr, zmax + log_min_p)
    mass = torch.where(zs >= thr[:, None], torch.exp(zs - zmax[:, None]), 0.0)
    target = top_p * mass.sum(-1)
    crossing = (mass.cumsum(-1) < target[:, None]).sum(-1).clamp(max=V - 1)
    tau_p = zs.gather(1, crossing[:, None])[:, 0]
    return torch.where(top_p < 1.0, torch.maximum(thr, tau_p), thr)


def sampling_probs(logits: torch.Tensor, inp: SamplingInputs) -> torch.Tensor:
    """logits (B, V) -> (B, V) float32: the distribution `sample` draws each row's token from
    (without penalties or a mask): at temperature > 0, softmax(logits / temperature) over the
    tokens top-k, min-p and top-p keep (thresholds_ref: the kernel's kept set), 0 elsewhere; a
    greedy row (temperature 0) is one-hot at its first maximum. Speculation's rejection rule
    compares the target's and the draft's (runtime/spec_rejection.py)."""
    inp = inp.per_row()
    x = logits.float()
    greedy = inp.temperature <= 0                                    # (B,)
    temperature = torch.where(greedy, torch.ones_like(inp.temperature), inp.temperature)
    z = x / temperature[:, None] + 0.0                               # (B, V)
    thr = thresholds_ref(z, inp.top_k, inp.top_p, inp.log_min_p)     # (B,)
    probs = torch.softmax(z.masked_fill(z < thr[:, None], float("-inf")), dim=-1)
    if bool(greedy.any()):
        first_max = x[greedy].argmax(dim=-1)
        probs[greedy] = torch.nn.functional.one_hot(first_max, x.shape[-1]).float()
    return probs


def unpack_bitmask(bitmask: torch.Tensor, V: int) -> torch.Tensor:
    """(B, ceil(V / 32)) int32 -> (B, V) bool: bit t % 32 of word t // 32 allows token t."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    return ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :V]


def sample_ref(logits: torch.Tensor, inp: SamplingInputs, penalties: PenaltyInputs | None = None,
               bitmask: torch.Tensor | None = None) -> SampleOutput:
    inp = inp.per_row()
    x = logits.float()
    if penalties is not None:
        x = apply_penalties_ref(x, penalties)
    if bitmask is not None:              # structured output: after bias and penalties, before temperature
        x = x.masked_fill(~unpack_bitmask(bitmask, x.shape[-1]), float("-inf"))
    tokens = x.argmax(dim=-1)
    logprobs = torch.log_softmax(x, dim=-1).gather(1, tokens[:, None])[:, 0]
    rows = (inp.temperature > 0).nonzero().flatten()
    if rows.numel():
        z = x[rows] / inp.temperature[rows, None] + 0.0           # + 0.0 turns -0.0 into +0.0
        thr = thresholds_ref(z, inp.top_k[rows], inp.top_p[rows], inp.log_min_p[rows])
        keep = z >= thr[:, None]
        zmax = z.max(dim=-1).values                                 # always kept
        # noise lies in [GUMBEL_MIN, GUMBEL_MAX]: a token that trails the best kept one by more
        # than the spread can never win, so its noise need not be drawn (exact, not a heuristic)
        reach = zmax - (GUMBEL_MAX - GUMBEL_MIN) - 1e-3 - 1e-6 * zmax.abs()
        r, t = (keep & (z >= reach[:, None])).nonzero(as_tuple=True)
        g = gumbel(inp.seed[rows][r], inp.output_index[rows][r], t)
        score = torch.full_like(z, float("-inf"))
        score[r, t] = z[r, t] + g
        chosen = score.argmax(dim=-1)
        tokens[rows] = chosen
        logprobs[rows] = torch.log_softmax(x[rows], dim=-1).gather(1, chosen[:, None])[:, 0]
    return SampleOutput(tokens, logprobs, x)


if HAS_TRITON:
    @triton.jit
    def _sample_kernel(logits_ptr, stride_row, V, tokens_ptr, logprobs_ptr,
                       slot_ptr, index_ptr, temp_ptr, topk_ptr, topp_ptr, lminp_ptr, seed_ptr,
                       proc_ptr, state_slot_ptr, rep_ptr, pres_ptr, freq_ptr, active_ptr, counts_ptr, seen_ptr,
                       bias_ptr, mask_ptr, mask_words, cand_z_ptr, cand_i_ptr,
                       BLOCK_V: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK_C: tl.constexpr,
                       HAS_SLOTS: tl.constexpr, HAS_PENALTIES: tl.constexpr, HAS_MASK: tl.constexpr):
        """One row per program. The settings (temp ... seed) are read at the row's slot
        (slot_ptr, HAS_SLOTS) or at the row; the penalty settings and state at the row's
        state slot. Absent inputs are None with their HAS_* flag False."""
        row = tl.program_id(0)
        raw = logits_ptr + row.to(tl.int64) * stride_row
        if HAS_PENALTIES or HAS_MASK:   # pass 1 writes the processed row here; every later pass reads it
            base = proc_ptr + row.to(tl.int64) * V
        else:
            base = raw
        if HAS_SLOTS:
            at = tl.load(slot_ptr + row).to(tl.int64)
        else:
            at = row.to(tl.int64)
        if HAS_PENALTIES:
            state_slot = tl.load(state_slot_ptr + row).to(tl.int64)
            active = tl.load(active_ptr + state_slot) != 0
            state = state_slot * V
            rep = tl.load(rep_ptr + state_slot)
            pres = tl.load(pres_ptr + state_slot)
            freq = tl.load(freq_ptr + state_slot)
        temp = tl.load(temp_ptr + at)
        top_k = tl.load(topk_ptr + at)
        top_p = tl.load(topp_ptr + at)
        log_min_p = tl.load(lminp_ptr + at)
        seed = tl.load(seed_ptr + at)
        index = tl.load(index_ptr + row)
        div = tl.where(temp > 0, temp, 1.0)
        lanes = tl.arange(0, BLOCK_V)
        # pass 1, per lane: raw max / sum-exp (logprob), first argmax (greedy), z max and min
        m_vec = tl.full([BLOCK_V], float("-inf"), tl.float32)
        l_vec = tl.zeros([BLOCK_V], tl.float32)
        arg_vec = tl.full([BLOCK_V], 0, tl.int32)
        zmax_vec = tl.full([BLOCK_V], float("-inf"), tl.float32)
        zmin_vec = tl.full([BLOCK_V], float("inf"), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + lanes
            ok = offs < V
            x = tl.load(raw + offs, mask=ok, other=float("-inf")).to(tl.float32)
            if HAS_PENALTIES:
                if active:
                    x = _penalize(x, offs, ok, state, rep, pres, freq, counts_ptr, seen_ptr, bias_ptr)
            if HAS_MASK:     # the grammar's bitmask: bit offs % 32 of word offs // 32
                word = tl.load(mask_ptr + row.to(tl.int64) * mask_words + offs // 32, mask=ok, other=0)
                x = tl.where(((word >> (offs % 32)) & 1) != 0, x, float("-inf"))
            if HAS_PENALTIES or HAS_MASK:
                tl.store(base + offs, x, mask=ok)
            better = x > m_vec
            arg_vec = tl.where(better, offs, arg_vec)
            m_new = tl.maximum(m_vec, x)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_vec = l_vec * tl.exp(m_vec - m_safe) + tl.exp(x - m_safe)
            m_vec = m_new
            z = x / div + 0.0
            zmax_vec = tl.maximum(zmax_vec, z)
            zmin_vec = tl.minimum(zmin_vec, tl.where(ok, z, float("inf")))
        if HAS_PENALTIES or HAS_MASK:
            tl.debug_barrier()                     # the processed row is read back by every pass
        m_raw = tl.max(m_vec, 0)
        m_raw_safe = tl.where(m_raw == float("-inf"), 0.0, m_raw)
        l_raw = tl.sum(l_vec * tl.exp(m_vec - m_raw_safe), 0)
        first_best = tl.min(tl.where(m_vec == m_raw, arg_vec, V), 0)
        zmax = tl.max(zmax_vec, 0)
        zmin = tl.min(zmin_vec, 0)
        token = first_best
        if temp > 0:
            thr = zmin - float("inf")              # -inf, as a loop-safe f32 scalar
            if (top_k > 0) & (top_k < V):
                thr = _radix_kth(base, V, div, top_k, BLOCK_V)
            thr = tl.maximum(thr, zmax + log_min_p)
            # few candidates left (top-k / min-p): gather them once, finish in registers
            n_cand = V + 1
            if (top_p < 1.0) & (thr > float("-inf")):
                n_cand = _compact(base, V, div, thr, cand_z_ptr + row.to(tl.int64) * BLOCK_C,
                                  cand_i_ptr + row.to(tl.int64) * BLOCK_C, BLOCK_C, BLOCK_V)
                tl.debug_barrier()                 # other warps read what this pass wrote
            if n_cand <= BLOCK_C:
                c = tl.arange(0, BLOCK_C)
                live = c < n_cand
                z = tl.load(cand_z_ptr + row.to(tl.int64) * BLOCK_C + c, mask=live, other=float("-inf"))
                ids = tl.load(cand_i_ptr + row.to(tl.int64) * BLOCK_C + c, mask=live, other=0)
                thr = tl.maximum(thr, _tile_top_p(z, live, thr, zmax, top_p, SEARCH_STEPS))
                token = _pick(z, ids, live & (z >= thr), seed, index, V)
            else:
                if top_p < 1.0:
                    tot = tl.zeros([BLOCK_V], tl.float32)
                    for v0 in range(0, V, BLOCK_V):
                        offs = v0 + lanes
                        z = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / div + 0.0
                        tot += tl.where(z >= thr, tl.exp(z - zmax), 0.0)
                    target = top_p * tl.sum(tot, 0)
                    thr = tl.maximum(thr, _bisect(base, V, div, zmax, _order_key(thr), _order_key(zmax) + 1,
                                                  target, BLOCK_V, SEARCH_STEPS))
                best = tl.full([BLOCK_V], float("-inf"), tl.float32)
                best_at = tl.full([BLOCK_V], 0, tl.int32)
                for v0 in range(0, V, BLOCK_V):
                    offs = v0 + lanes
                    ok = offs < V
                    z = tl.load(base + offs, mask=ok, other=float("-inf")).to(tl.float32) / div + 0.0
                    score = tl.where(ok & (z >= thr), z + _philox_gumbel(seed, index, offs), float("-inf"))
                    better = score > best
                    best_at = tl.where(better, offs, best_at)
                    best = tl.where(better, score, best)
                top = tl.max(best, 0)
                token = tl.min(tl.where(best == top, best_at, V), 0)
        x_tok = tl.load(base + token).to(tl.float32)
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(logprobs_ptr + row, x_tok - (m_raw + tl.log(l_raw)))


def sample_triton(logits: torch.Tensor, inp: SamplingInputs, penalties: PenaltyInputs | None = None,
                  bitmask: torch.Tensor | None = None, scratch: SamplerScratch | None = None) -> SampleOutput:
    B, V = logits.shape
    assert logits.stride(-1) == 1
    dev = logits.device
    tokens = torch.empty(B, dtype=torch.int64, device=dev)
    logprobs = torch.empty(B, dtype=torch.float32, device=dev)
    if B == 0:
        return SampleOutput(tokens, logprobs, logits)
    scratch = scratch if scratch is not None else SamplerScratch()
    processed = scratch.processed(B, V, dev) if (penalties is not None or bitmask is not None) else logits
    block_c = CANDIDATES_INTERPRETED if interpreting() else CANDIDATES
    cand_z, cand_i = scratch.candidates(B, block_c, dev)
    p = penalties
    st = p.state if p is not None else None
    if st is not None:
        assert st.counts.shape[1] == V, "penalty state and logits disagree on the vocabulary"
    if bitmask is not None:
        assert bitmask.dtype == torch.int32 and bitmask.shape == (B, -(-V // 32)), "bitmask must be (B, ceil(V/32)) int32"
        bitmask = bitmask.contiguous()
    _sample_kernel[(B,)](
        logits_ptr=logits, stride_row=logits.stride(0), V=V, tokens_ptr=tokens, logprobs_ptr=logprobs,
        slot_ptr=inp.slot, index_ptr=inp.output_index, temp_ptr=inp.temperature, topk_ptr=inp.top_k,
        topp_ptr=inp.top_p, lminp_ptr=inp.log_min_p, seed_ptr=inp.seed,
        proc_ptr=processed if processed is not logits else None,
        state_slot_ptr=None if p is None else p.slot,
        rep_ptr=None if st is None else st.repetition, pres_ptr=None if st is None else st.presence,
        freq_ptr=None if st is None else st.frequency, active_ptr=None if st is None else st.active,
        counts_ptr=None if st is None else st.counts, seen_ptr=None if st is None else st.seen,
        bias_ptr=None if st is None else st.bias,
        mask_ptr=bitmask, mask_words=None if bitmask is None else bitmask.shape[1],
        cand_z_ptr=cand_z, cand_i_ptr=cand_i,
        BLOCK_V=min(triton.next_power_of_2(V), 256 if interpreting() else 4096), SEARCH_STEPS=33,
        BLOCK_C=block_c, HAS_SLOTS=inp.slot is not None, HAS_PENALTIES=p is not None,
        HAS_MASK=bitmask is not None,
        num_warps=8,
        enable_fp_fusion=False)   # no FMA contraction: round as torch does, bit for bit
    return SampleOutput(tokens, logprobs, processed)


def sample(logits: torch.Tensor, inp: SamplingInputs, backend: str = "auto",
           penalties: PenaltyInputs | None = None, bitmask: torch.Tensor | None = None,
           scratch: SamplerScratch | None = None) -> SampleOutput:
    """Select one token per row (module docstring gives the exact semantics). bitmask
    (B, ceil(V / 32)) int32: tokens whose bit is 0 are disallowed (structured output), applied
    after penalties and bias, before temperature and the filters. scratch: the kernel's
    buffers, kept by a caller that samples every step (allocated per call without it)."""
    if use_triton(logits, backend):
        return sample_triton(logits, inp, penalties, bitmask, scratch)
    return sample_ref(logits, inp, penalties, bitmask)
