"""csrc/work_pool.h: the pooled kernels (quantized matmuls, a quantized model's decode attention)
give the same bits at any thread count, with every input dropped right after its call: the pool
holds a call's inputs until no late worker reads them, with no finalizer and no quiesce by the
caller. (Freed memory read late is what `make sanitize` catches, under AddressSanitizer.)"""
import pytest
import torch

from pagedecode.model.cpu_forward import cpu_ext

ext = cpu_ext()
pytestmark = pytest.mark.skipif(ext is None, reason="pagedecode._cpu not built")


def q8_blocks(n, k, g):
    scale = torch.full((n, k // 32, 1), 0.01, dtype=torch.float16).view(torch.uint8)
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g, dtype=torch.int8).view(torch.uint8)
    return torch.cat([scale, q], -1).reshape(n, -1).contiguous()


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("packed", [False, True])
def test_quant_linear_with_its_inputs_dropped_gives_the_same_bits_at_any_thread_count(threads, packed):
    cases = []
    g = torch.Generator().manual_seed(0)
    for rows in (1, 3, 7):
        blocks = q8_blocks(768, 512, g)
        cases.append((torch.randn(rows, 512, generator=g), ext.quant_pack(blocks, 512) if packed else blocks))
    torch.set_num_threads(1)
    want = [ext.quant_linear(x, b, 768) for x, b in cases]
    for n in (2, 3, 4):
        torch.set_num_threads(n)
        for _ in range(20):
            for (x, b), w in zip(cases, want):
                x2, b2 = x.clone(), b.clone()          # fresh copies, dropped as the call returns
                got = ext.quant_linear(x2, b2, 768)
                del x2, b2
                assert torch.equal(got, w)


def test_pooled_decode_attention_with_its_inputs_dropped_gives_the_same_bits(threads):
    g = torch.Generator().manual_seed(1)
    page, num_pages, seqs = 16, 256, 3
    lens = torch.tensor([300, 411, 260], dtype=torch.int32)
    table = torch.randperm(num_pages, generator=g)[:seqs * 26].view(seqs, 26).to(torch.int32).contiguous()
    cu = torch.arange(seqs + 1, dtype=torch.int32)
    k = torch.randn(num_pages, page, 2, 64, generator=g)
    v = torch.randn(num_pages, page, 2, 64, generator=g)
    q = torch.randn(seqs, 8, 64, generator=g)
    want = ext.det_attention(q, k, v, table, lens, cu, 0.125, pool=False)
    for n in (2, 3, 4):
        torch.set_num_threads(n)
        for _ in range(10):
            k2, v2, q2, t2 = k.clone(), v.clone(), q.clone(), table.clone()
            got = ext.det_attention(q2, k2, v2, t2, lens, cu, 0.125, pool=True)
            del k2, v2, q2, t2
            assert torch.equal(got, want)
    ext.drain_pool()                       # every late worker out, the pool's inputs dropped
