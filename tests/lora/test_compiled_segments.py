"""The compiled forward's LoRA deltas (csrc/lora_delta.h: short segments batched on the work pool,
long ones through at::mm) against the torch ops, over one batch of many segments: single rows,
odd row counts, one past the batched path's 16 rows, rows without an adapter, ranks 8 and 64 and
an adapter on three projections only."""
import pytest
import torch

import pagedecode as pd
from pagedecode.lora.adapter import load_adapter
from pagedecode.lora.stacks import LoRABatch, LoRAStacks, segments, stack_dtype
from pagedecode.model.batch import ForwardBatch

SEQS = [(1, 0), (3, 1), (1, -1), (20, 2), (5, 0), (2, 1), (7, 2), (1, 1)]      # (rows, slot)
PAGE = 8


def batch_of(seqs, stacks) -> ForwardBatch:
    """Each sequence a prefill of its rows on its own pages, every row's logits asked for."""
    per = max(-(-rows // PAGE) for rows, _ in seqs)
    ids, pos, slots, table, lens, cu = [], [], [], [], [], [0]
    for i, (rows, _) in enumerate(seqs):
        pages = [i * per + p for p in range(per)]
        ids += [(7 * i + 3 * t) % 400 + 5 for t in range(rows)]
        pos += list(range(rows))
        slots += [pages[t // PAGE] * PAGE + t % PAGE for t in range(rows)]
        table.append(pages)
        lens.append(rows)
        cu.append(cu[-1] + rows)
    b = ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.tensor(slots), torch.tensor(table, dtype=torch.int32),
                     torch.tensor(lens, dtype=torch.int32), torch.tensor(cu, dtype=torch.int32),
                     torch.arange(cu[-1]), num_decode=0, max_new=max(lens))
    starts, seg_slots = segments([s for _, s in seqs], [r for r, _ in seqs])
    b.lora = LoRABatch(stacks, torch.tensor(starts, dtype=torch.int32), torch.tensor(seg_slots, dtype=torch.int32))
    return b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("deterministic", [False, True])
def test_compiled_segments_equal_the_torch_ops(base, adapters, deterministic, dtype):
    """bfloat16 stacks (a quantized base's, lora/stacks.py stack_dtype) under float32 rows: the
    compiled forward widens A and B as it reads them, the torch ops read the same values."""
    path, _ = base
    compiled, _ = pd.load_model(path, attention_backend="auto")
    compiled.deterministic = deterministic
    reference, _ = pd.load_model(path, attention_backend="torch")
    assert compiled.uses_cpu_extension() and not reference.uses_cpu_extension()
    c = compiled.config
    stacks = LoRAStacks(c, 3, 64, dtype, torch.device("cpu"))
    for slot, name in enumerate(["r8", "r64", "qvd8"]):
        stacks.write(slot, load_adapter(name, adapters[name][0], c, 64))
    pages = len(SEQS) * -(-max(r for r, _ in SEQS) // PAGE)
    out = []
    for model in (compiled, reference):
        kv = pd.KVCache(c.num_layers, pages, PAGE, c.num_kv_heads, c.head_dim, torch.float32)
        out.append(model.forward(batch_of(SEQS, stacks), kv))
    bare = LoRAStacks(c, 3, 64, torch.float32, torch.device("cpu"))
    kv = pd.KVCache(c.num_layers, pages, PAGE, c.num_kv_heads, c.head_dim, torch.float32)
    plain = reference.forward(batch_of(SEQS, bare), kv)
    rows_with = torch.tensor([s >= 0 for r, s in SEQS for _ in range(r)])
    assert ((out[1] - plain).abs().amax(-1)[rows_with] > 1e-2).all()          # every adapter row moves
    assert (out[0] - out[1]).abs().max().item() < 1e-4


def test_a_quantized_base_holds_its_adapters_in_bfloat16(base):
    """stack_dtype: a float32 base keeps float32 adapters (exact against peft), quantized layer
    weights with float32 activations take bfloat16 ones (half the bytes a step reads)."""
    path, _ = base
    dense, _ = pd.load_model(path)
    quantized, _ = pd.load_model(path, quantization="q8_0")
    assert not dense.quantized and quantized.quantized and quantized.dtype == torch.float32
    assert stack_dtype(dense) == torch.float32 and stack_dtype(quantized) == torch.bfloat16
