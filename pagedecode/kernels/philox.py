"""Counter-based random numbers (Philox4x32-10), in torch, matching the Triton port bit for bit.

The noise for one token decision is keyed by (request seed, output index, token id): the key
is the 64-bit seed, the counter is (token id, output index, DOMAIN, stream). Nothing depends on
the batch position or the step number, so a seeded request draws the same numbers alone, in any
batch, and after preemption. Stream 0 is the target's sampler (and the Triton port); another
stream gives numbers independent of it at the same (seed, index, token): the draft model's
samples under speculation use DRAFT_STREAM (torch only).
"""
from __future__ import annotations

import torch

from ._backend import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

MASK32 = 0xFFFFFFFF
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57     # Philox multipliers
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85         # Weyl key increments
DOMAIN = 0x53414D50                          # "SAMP": keeps sampling noise apart from other uses
DRAFT_STREAM = 1                             # the draft model's samples (runtime/spec/rejection.py)
ROUNDS = 10
GUMBEL_MAX = 16.635532333438686    # -log(-log(1 - 2**-24)): the largest noise value we can draw
GUMBEL_MIN = -2.8115659163349556   # -log(-log(2**-24)): the smallest


def seed_to_int64(seed: int) -> int:
    """A seed in [0, 2**64) as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return seed - (1 << 64) if seed >= (1 << 63) else seed


def _mulhilo(a: int, b: torch.Tensor):
    """(a * b) >> 32 and (a * b) & MASK32 for a < 2**32 and int64 b in [0, 2**32), in 16-bit
    halves so no intermediate leaves the int64 range."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    b_hi, b_lo = b >> 16, b & 0xFFFF
    ll, lh, hl, hh = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi
    mid = (ll >> 16) + (lh & 0xFFFF) + (hl & 0xFFFF)
    hi = hh + (lh >> 16) + (hl >> 16) + (mid >> 16)
    lo = ((mid & 0xFFFF) << 16) | (ll & 0xFFFF)
    return hi, lo


def philox4x32(counter, key, rounds: int = ROUNDS):
    """Philox4x32 (Salmon et al., SC'11) on int64 tensors holding 32-bit words.
    counter: 4 tensors, key: 2 tensors (broadcastable); returns the 4 output words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        hi_a, lo_a = _mulhilo(ROUND_A, c0)
        hi_b, lo_b = _mulhilo(ROUND_B, c2)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + KEY_A) & MASK32
        k1 = (k1 + KEY_B) & MASK32
    return c0, c1, c2, c3


def _compiled():
    """The compiled extension's philox_c0 (csrc/philox.h, the same words ~100x faster), or None
    where pagedecode._cpu is absent or older than it."""
    try:
        from .. import _cpu
    except ImportError:
        return None
    return getattr(_cpu, "philox_c0", None)


_COMPILED = _compiled()


def philox_c0(seed: torch.Tensor, index: torch.Tensor, token: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """First output word of Philox4x32-10 for key=seed, counter=(token, index, DOMAIN, stream).
    All inputs int64 and broadcastable; returns int64 in [0, 2**32). On CPU tensors the compiled
    extension computes it where present; philox_c0_torch is the definition."""
    if _COMPILED is not None and seed.device.type == "cpu":
        seed, index, token = torch.broadcast_tensors(seed, index, token)
        return _COMPILED(seed.long(), index.long(), token.long(), stream & MASK32)
    return philox_c0_torch(seed, index, token, stream)


def philox_c0_torch(seed: torch.Tensor, index: torch.Tensor, token: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """philox_c0 in torch operations: any device, and the reference the compiled form is tested against."""
    c0, c1 = torch.broadcast_tensors(token & MASK32, index & MASK32)
    key = (seed & MASK32, (seed >> 32) & MASK32)
    return philox4x32((c0, c1, torch.full_like(c0, DOMAIN), torch.full_like(c0, stream & MASK32)), key)[0]


def uniform(seed, index, token, stream: int = 0) -> torch.Tensor:
    """Uniform floats (2m + 1) / 2**24, m < 2**23: exactly representable, never 0 or 1."""
    m = philox_c0(seed, index, token, stream) >> 9
    return m.to(torch.float32) * (2.0 ** -23) + (2.0 ** -24)


def gumbel(seed, index, token, stream: int = 0) -> torch.Tensor:
    """Gumbel(0, 1) noise in float32: -log(-log(u))."""
    return -torch.log(-torch.log(uniform(seed, index, token, stream)))


if HAS_TRITON:
    @triton.jit
    def _philox_gumbel(seed, index, token):
        # Philox4x32-10, key = seed, counter = (token, index, DOMAIN, 0); mirrors philox4x32 / uniform / gumbel above
        k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        c0 = token.to(tl.uint32)
        c1 = (index & 0xFFFFFFFF).to(tl.uint32) + c0 * 0
        c2 = c0 * 0 + 0x53414D50
        c3 = c0 * 0
        for _ in tl.static_range(10):
            a0 = c0
            a2 = c2
            c0 = tl.umulhi(a2, 0xCD9E8D57) ^ c1 ^ k0
            c2 = tl.umulhi(a0, 0xD2511F53) ^ c3 ^ k1
            c1 = a2 * 0xCD9E8D57
            c3 = a0 * 0xD2511F53
            k0 = k0 + 0x9E3779B9
            k1 = k1 + 0xBB67AE85
        u = (c0 >> 9).to(tl.float32) * 1.1920928955078125e-07 + 5.960464477539063e-08
        return -tl.log(-tl.log(u))
