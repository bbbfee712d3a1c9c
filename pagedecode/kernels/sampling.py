"""Token selection: penalties and logit bias, greedy, temperature, top-k, min-p, top-p and
Gumbel-max noise, plus the chosen token's logprob, over the vocabulary in tiles.

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

The kernels' plan (three launches, vocabulary tiles) is sampling_kernels.py's.

Semantics (both paths): z = logits / temperature; the kept set is z >= threshold; the token is
argmax over kept of z + g, g = Gumbel noise keyed by (seed, output index, token id). With
PenaltyInputs, `logits` above means the logits after penalties and bias (penalties.py). The
logprob is log_softmax(logits)[token] of those logits (before temperature and filters).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ._backend import HAS_TRITON, interpreting, use_triton
from .penalties import PenaltyInputs, apply_penalties_ref
from .philox import GUMBEL_MAX, GUMBEL_MIN, gumbel

if HAS_TRITON:
    import triton

    from .sampling_kernels import _finish_kernel, _tile_draw_kernel, _tile_kernel


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


@dataclass
class TileScratch:
    """The tiled kernel's per-(row, vocab tile) results, (rows, tiles) each unless noted."""
    m: torch.Tensor              # float32: max of the tile's processed logits
    l: torch.Tensor              # float32: sum of exp(x - m) over the tile
    arg: torch.Tensor            # int32: the tile's first maximum
    zmax: torch.Tensor           # float32: max of z = x / temperature
    n: torch.Tensor              # int32: tokens at or above the tile's CAND-th key (small top-k rows)
    key: torch.Tensor            # int64: that key
    cand_z: torch.Tensor         # (rows, tiles, CAND) float32: the tile's top-CAND z, then ties
    cand_i: torch.Tensor         # (rows, tiles, CAND) int32: their token ids
    draw_score: torch.Tensor     # float32: best z + noise in the tile (temperature / min-p rows)
    draw_at: torch.Tensor        # int32: its token

    @staticmethod
    def empty(rows: int, num_tiles: int, cand: int, device: torch.device) -> "TileScratch":
        def e(dtype, *extra):
            return torch.empty(rows, num_tiles, *extra, dtype=dtype, device=device)
        f32, i32 = torch.float32, torch.int32
        return TileScratch(e(f32), e(f32), e(i32), e(f32), e(i32), e(torch.int64), e(f32, cand), e(i32, cand),
                           e(f32), e(i32))

    def first(self, rows: int) -> "TileScratch":
        return TileScratch(*(getattr(self, f.name)[:rows] for f in fields(self)))


class SamplerScratch:
    """The kernel's working buffers, owned by the caller and reused by every call: the processed
    rows (with penalties or a mask) and the top-k / min-p candidates. Grown to the largest batch
    seen, never shrunk; what a call returns in `processed` is valid until the next call."""

    def __init__(self) -> None:
        self._proc: torch.Tensor | None = None
        self._cand_z: torch.Tensor | None = None
        self._cand_i: torch.Tensor | None = None
        self._tiles: TileScratch | None = None

    @staticmethod
    def _fits(t: torch.Tensor | None, rows: int, cols: int, device: torch.device) -> bool:
        return t is not None and t.shape[0] >= rows and t.shape[1] == cols and t.device == device

    def processed(self, rows: int, V: int, device: torch.device) -> torch.Tensor:
        if not self._fits(self._proc, rows, V, device):
            self._proc = torch.empty(rows, V, dtype=torch.float32, device=device)
        assert self._proc is not None
        return self._proc[:rows]

    def tiles(self, rows: int, num_tiles: int, cand: int, device: torch.device) -> "TileScratch":
        t = self._tiles
        if t is None or t.m.shape[0] < rows or t.m.shape[1] != num_tiles or t.cand_z.shape[2] != cand \
                or t.m.device != device:
            t = self._tiles = TileScratch.empty(rows, num_tiles, cand, device)
        return t.first(rows)

    def candidates(self, rows: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._fits(self._cand_z, rows, width, device):
            self._cand_z = torch.empty(rows, width, dtype=torch.float32, device=device)
            self._cand_i = torch.empty(rows, width, dtype=torch.int32, device=device)
        assert self._cand_z is not None and self._cand_i is not None
        return self._cand_z[:rows], self._cand_i[:rows]


# Top-k / min-p survivors kept in registers for top-p and the draw by the row fallback
# (_select_row); more than this falls back to passes over the whole row. Small in the
# interpreter so tests reach both paths.
CANDIDATES = 1024
CANDIDATES_INTERPRETED = 32
# Candidates each vocab tile keeps for a top-k row: top-k up to this many is finished from the
# tiles' candidates in registers; a larger k takes the row fallback.
TILE_CANDIDATES = 64
TILE_CANDIDATES_INTERPRETED = 8
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
    if not bool(((top_k > 0) & (top_k < V) | (top_p < 1.0) | (log_min_p > float("-inf"))).any()):
        return torch.full((R,), float("-inf"), device=z.device)     # no filter: every token kept, no sort
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
    compares the target's and the draft's (runtime/spec/rejection.py)."""
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
    log_probs = torch.log_softmax(x, dim=-1)
    logprobs = log_probs.gather(1, tokens[:, None])[:, 0]
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
        logprobs[rows] = log_probs[rows].gather(1, chosen[:, None])[:, 0]
    return SampleOutput(tokens, logprobs, x)


def tile_sizes(V: int) -> tuple[int, int, int]:
    """(vocab tile, candidates per tile, row pass width): tiles of 4096 on the GPU (128,256 tokens:
    32 tiles, 64 rows x 32 = 2048 programs), 64 wide in the interpreter so tests cross tiles."""
    if interpreting():
        return min(triton.next_power_of_2(V), 64), TILE_CANDIDATES_INTERPRETED, 256
    return min(triton.next_power_of_2(V), 4096), TILE_CANDIDATES, 4096


def sample_triton(logits: torch.Tensor, inp: SamplingInputs, penalties: PenaltyInputs | None = None,
                  bitmask: torch.Tensor | None = None, scratch: SamplerScratch | None = None) -> SampleOutput:
    B, V = logits.shape
    if logits.stride(-1) != 1 or logits.stride(0) != V:
        logits = logits.contiguous()          # passes 2 and 3 read rows V apart (the processed buffer's layout)
    dev = logits.device
    tokens = torch.empty(B, dtype=torch.int64, device=dev)
    logprobs = torch.empty(B, dtype=torch.float32, device=dev)
    if B == 0:
        return SampleOutput(tokens, logprobs, logits)
    scratch = scratch if scratch is not None else SamplerScratch()
    processed = scratch.processed(B, V, dev) if (penalties is not None or bitmask is not None) else logits
    block_c = CANDIDATES_INTERPRETED if interpreting() else CANDIDATES
    row_z, row_i = scratch.candidates(B, block_c, dev)
    tile, cand, block_v = tile_sizes(V)
    T = -(-V // tile)
    tiles = scratch.tiles(B, T, cand, dev)
    p = penalties
    st = p.state if p is not None else None
    if st is not None:
        assert st.counts.shape[1] == V, "penalty state and logits disagree on the vocabulary"
    if bitmask is not None:
        assert bitmask.dtype == torch.int32 and bitmask.shape == (B, -(-V // 32)), "bitmask must be (B, ceil(V/32)) int32"
        bitmask = bitmask.contiguous()
    settings = dict(slot_ptr=inp.slot, temp_ptr=inp.temperature, topk_ptr=inp.top_k, topp_ptr=inp.top_p,
                    lminp_ptr=inp.log_min_p, seed_ptr=inp.seed)
    has_slots = inp.slot is not None
    _tile_kernel[(B, T)](
        logits_ptr=logits, stride_row=logits.stride(0), V=V, **settings,
        proc_ptr=processed if processed is not logits else None,
        state_slot_ptr=None if p is None else p.slot,
        rep_ptr=None if st is None else st.repetition, pres_ptr=None if st is None else st.presence,
        freq_ptr=None if st is None else st.frequency, active_ptr=None if st is None else st.active,
        counts_ptr=None if st is None else st.counts, seen_ptr=None if st is None else st.seen,
        bias_ptr=None if st is None else st.bias,
        mask_ptr=bitmask, mask_words=None if bitmask is None else bitmask.shape[1],
        tile_m_ptr=tiles.m, tile_l_ptr=tiles.l, tile_arg_ptr=tiles.arg, tile_zmax_ptr=tiles.zmax,
        tile_n_ptr=tiles.n, tile_key_ptr=tiles.key, cand_z_ptr=tiles.cand_z, cand_i_ptr=tiles.cand_i,
        TILE=tile, CAND=cand, HAS_SLOTS=has_slots, HAS_PENALTIES=p is not None, HAS_MASK=bitmask is not None,
        num_warps=8, enable_fp_fusion=False)   # no FMA contraction: round as torch does, bit for bit
    block_t = triton.next_power_of_2(T)
    _tile_draw_kernel[(B, T)](
        base_ptr=processed, V=V, index_ptr=inp.output_index, **settings, tile_zmax_ptr=tiles.zmax,
        draw_score_ptr=tiles.draw_score, draw_at_ptr=tiles.draw_at, TILE=tile, BLOCK_T=block_t,
        HAS_SLOTS=has_slots, num_warps=8, enable_fp_fusion=False)
    _finish_kernel[(B,)](
        base_ptr=processed, V=V, tokens_ptr=tokens, logprobs_ptr=logprobs, index_ptr=inp.output_index, **settings,
        num_tiles=T, tile_m_ptr=tiles.m, tile_l_ptr=tiles.l, tile_arg_ptr=tiles.arg, tile_zmax_ptr=tiles.zmax,
        tile_n_ptr=tiles.n, tile_key_ptr=tiles.key, cand_z_ptr=tiles.cand_z, cand_i_ptr=tiles.cand_i,
        draw_score_ptr=tiles.draw_score, draw_at_ptr=tiles.draw_at, row_z_ptr=row_z, row_i_ptr=row_i,
        CAND=cand, BLOCK_T=block_t, BLOCK_V=block_v, SEARCH_STEPS=33, BLOCK_C=block_c, HAS_SLOTS=has_slots,
        num_warps=8, enable_fp_fusion=False)
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
