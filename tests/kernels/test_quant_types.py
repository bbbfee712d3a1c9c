"""Every GGUF block type pagedecode keeps in memory dequantizes to exactly the floats the `gguf`
package's gguf.quants.dequantize gives, on random blocks with ordinary and extreme scales."""
import numpy as np
import pytest
import torch

from pagedecode.kernels.quant_types import BLOCK_TYPES, KINDS, dequantize, random_blocks, row_bytes

gguf = pytest.importorskip("gguf")


def finite_half_bits(n: int, g: torch.Generator) -> torch.Tensor:
    """n random float16 bit patterns, every finite one possible (subnormals, zeros, +-65504)."""
    bits = torch.randint(0, 1 << 16, (n,), generator=g, dtype=torch.int32)
    exponent_all_ones = (bits & 0x7C00) == 0x7C00
    return torch.where(exponent_all_ones, bits & ~0x4000, bits).to(torch.int16)    # inf / nan -> finite


FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2),
          "q5_k": (0, 2), "q6_k": (208,)}


def extreme_blocks(n: int, k: int, kind: str, g: torch.Generator) -> torch.Tensor:
    """Every byte random, every float16 field (d, m, dmin) any finite value."""
    t = BLOCK_TYPES[kind]
    b = torch.randint(0, 256, (n, k // t.block, t.type_size), dtype=torch.uint8, generator=g)
    for at in FIELDS[kind]:
        half = finite_half_bits(b.shape[0] * b.shape[1], g).view(b.shape[0], b.shape[1])
        b[..., at:at + 2] = half.view(torch.uint8).view(b.shape[0], b.shape[1], 2)
    return b.view(n, -1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("extreme", [False, True])
def test_dequantize_is_gguf_bit_for_bit(kind, extreme):
    g = torch.Generator().manual_seed(len(kind) + 7 * extreme)
    k = BLOCK_TYPES[kind].block * 3
    blocks = extreme_blocks(37, k, kind, g) if extreme else random_blocks(37, k, kind, generator=g)
    assert blocks.shape == (37, row_bytes(kind, k)) and blocks.dtype == torch.uint8
    want = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[kind.upper()])
    got = dequantize(blocks, kind).numpy()
    assert got.shape == want.shape == (37, k)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))    # the same bits (nan-free here)
    assert np.isfinite(got).all()


@pytest.mark.parametrize("kind", KINDS)
def test_sizes_are_ggmls(kind):
    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind.upper()]]
    assert BLOCK_TYPES[kind] == (block, type_size)
    with pytest.raises(ValueError, match="multiple of"):
        row_bytes(kind, block + 16)
