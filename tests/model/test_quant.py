"""Q8_0 / Q4_0 weights kept quantized in memory: the blocks against gguf's own dequantizer, and
`quantization=` on a float checkpoint against the float model (logit error, memory)."""
import numpy as np
import pytest
import torch

import pagedecode as pd
from pagedecode import cli
from pagedecode.kernels._backend import HAS_TRITON, interpreting
from pagedecode.model.config import ModelConfig
from pagedecode.model.llama import LlamaModel
from pagedecode.model.cpu_forward import _cpu_ext as _cpu
from pagedecode.model.quant import QuantizedWeight

from .gguf_files import Q, gguf, random_llama
from .test_gguf import logits_of

STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_blocks_dequantize_as_gguf_does(kind):
    w = torch.randn(7, 96, generator=torch.Generator().manual_seed(0)) * 3
    q = QuantizedWeight.quantize(w, kind)
    assert q.blocks.shape == (7, 3 * (34 if kind == "q8_0" else 18)) and q.nbytes == q.blocks.numel()
    qtype = Q.Q8_0 if kind == "q8_0" else Q.Q4_0
    want = torch.from_numpy(gguf.quants.dequantize(q.blocks.numpy(), qtype))
    assert torch.equal(q.dequantize(), want)
    rows = torch.tensor([5, 0, 5])
    assert torch.equal(q.dequantize(rows=rows), want[rows])
    assert torch.equal(q.select_rows(rows).dequantize(), want[rows])
    # a block's error: half a step (q8_0; q4_0's far side clamps at +7: a whole step), plus the
    # fp16 rounding of the scale
    step = w.abs().reshape(7, 3, 32).amax(-1, keepdim=True) / (127 if kind == "q8_0" else 8)
    assert ((q.dequantize() - w).abs().reshape(7, 3, 32) <= step * (0.6 if kind == "q8_0" else 1.1)).all()


needs_kernel = pytest.mark.skipif(not hasattr(_cpu, "quant_pack"), reason="pagedecode._cpu not built")
LAYOUTS = ["gguf", "packed"]


PACKED_KINDS = ["q8_0", "q4_0", "q5_0", "q4_1", "q5_1"]     # the kinds the packed layout takes


def blocks_in(q, layout):
    """The weight's blocks as the kernel takes them: GGUF's layout (uint8; Q5_0 / Q4_1 / Q5_1 as
    (N, blocks, type size), csrc/quant_types.h's), or packed (int8: csrc/quant_lanes.h, 16 rows a group)."""
    return q.kernel_blocks() if layout == "gguf" else _cpu.quant_pack(q.blocks, q.shape[1])


@needs_kernel
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", PACKED_KINDS)
@pytest.mark.parametrize("T, K, N", [(1, 64, 96), (3, 96, 7), (17, 576, 100), (2, 1536, 33), (11, 160, 37),
                                     (1, 576, 300), (130, 96, 48)])
def test_kernel_against_dequantized_reference(kind, T, K, N, layout):
    """The compiled kernel (csrc/quant_lanes.h packed, csrc/quant_matmul.h GGUF's layout) quantizes
    activations per block to int8: its error against float
    activations is that rounding (half a step of each block's largest |x| / 127), ~0.7% here."""
    g = torch.Generator().manual_seed(T * K + N)
    q = QuantizedWeight.quantize(torch.randn(N, K, generator=g), kind)
    x = torch.randn(T, K, generator=g)
    x[0, :32] = 0.0                                                   # an all-zero activation block
    ref = x @ q.dequantize().t()
    blocks = blocks_in(q, layout)
    y = _cpu.quant_linear(x, blocks, N)
    assert y.shape == (T, N) and y.dtype == torch.float32
    w = q.dequantize().abs().reshape(N, K // 32, 32).sum(-1)          # (N, blocks): sum |w| per block
    step = x.abs().reshape(T, K // 32, 32).amax(-1) / 127             # (T, blocks)
    bound = 0.5 * step @ w.t() + 1e-4 * ref.abs().max()
    assert ((y - ref).abs() <= bound).all()
    assert (y - ref).abs().max() < 0.02 * ref.abs().max()
    assert _cpu.quant_linear(x[:0], blocks, N).shape == (0, N)


@needs_kernel
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", PACKED_KINDS)
def test_gemm_equals_the_gemv_row_by_row(kind, layout):
    """Several tokens go through the blocked GEMM (tiles of weight rows x tokens, the blocks decoded
    once per tile), one token through the gemv: the same int8 activations, the same exact int32 block
    dots and the same float operations per output, so each row of the GEMM is the gemv's bit for bit
    (what keeps a request's tokens independent of its batch), at 1 and 2 threads. Odd shapes: T not
    a multiple of the 4-token tile (5, 17, 65), N not of the 4-row tile, K a multiple of 32 but not of 64 / 256
    (Q4_0's odd last block), tokens past one 128-token block. Packed: N past and not a multiple of
    the 16-row group (the rest of the rows in GGUF's layout), T past the 8-token tile and past one
    128-token block with whole row groups (131 x 37, 130 x 48)."""
    g = torch.Generator().manual_seed(11)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for T, K, N in [(2, 96, 7), (3, 800, 33), (17, 608, 65), (64, 576, 9), (131, 160, 5), (15, 64, 48),
                            (5, 96, 300), (131, 160, 37), (130, 64, 48), (5, 576, 9), (65, 576, 33)]:
                q = QuantizedWeight.quantize(torch.randn(N, K, generator=g), kind)
                x = torch.randn(T, K, generator=g) * torch.rand(T, 1, generator=g) * 4
                blocks = blocks_in(q, layout)
                y = _cpu.quant_linear(x, blocks, N)
                rows = torch.cat([_cpu.quant_linear(x[t:t + 1], blocks, N) for t in range(T)])
                assert torch.equal(y, rows), (n, T, K, N, (y - rows).abs().max())
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("kind", PACKED_KINDS)
def test_packed_kernel_is_its_scalar_form_bit_for_bit(kind):
    """The rows past the last whole 16-row group are computed by the packed layout's scalar form;
    rows 1..15 of the first group repeated there must come out with the same bits as in the group
    (AVX-512 VNNI, or AVX2's two halves of 8 rows: every row position in a register checked), one
    token and several, activations with extreme values included (Q4_0's int16 sums at their bound)."""
    g = torch.Generator().manual_seed(5)
    for T, K in [(1, 96), (3, 576), (9, 1536), (6, 64)]:
        w = torch.randn(16, K, generator=g)
        w[:, :32] = torch.where(w[:, :32] > 0, 1.0, -1.0)        # whole blocks at the quantizer's extremes
        q = QuantizedWeight.quantize(torch.cat([w, w[1:]]), kind)
        x = torch.randn(T, K, generator=g) * 3
        x[:, :32] = 5.0                                          # a block whose activations all round to 127
        y = _cpu.quant_linear(x, q.pack().blocks, 31)
        assert torch.equal(y[:, 16:], y[:, 1:16]), (T, K)
        assert torch.equal(y, _cpu.quant_linear(x, q.pack().blocks, 31))


@needs_kernel
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", PACKED_KINDS)
def test_kernel_is_the_same_bit_for_bit_at_any_thread_count(kind, layout):
    """The matmul's chunks (csrc/work_pool.h) go to whichever thread claims them first, and a
    worker's chunk may be taken back and recomputed by the caller: the rows of each chunk are fixed
    by the call alone, so the result may not depend on any of it, even with more threads than cores
    (workers descheduled mid-chunk). 3 blocks a row: Q4_0's odd last block too."""
    g = torch.Generator().manual_seed(7)
    shapes = [(1, 96, 4001), (3, 96, 2000), (5, 576, 700), (9, 576, 700), (40, 96, 2000)]   # 8+ rows: OpenMP
    cases = [(QuantizedWeight.quantize(torch.randn(N, K, generator=g), kind), torch.randn(T, K, generator=g), N)
             for T, K, N in shapes]
    cases = [(blocks_in(q, layout), x, N) for q, x, N in cases]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = [_cpu.quant_linear(x, b, N) for b, x, N in cases]
        for n in (2, 4):
            torch.set_num_threads(n)
            for _ in range(30):
                for (b, x, N), w in zip(cases, want):
                    assert torch.equal(_cpu.quant_linear(x, b, N), w)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_kernel_refuses_what_is_not_blocks():
    q = QuantizedWeight.quantize(torch.randn(4, 64), "q8_0")
    with pytest.raises(RuntimeError, match="float32"):
        _cpu.quant_linear(torch.randn(1, 64, dtype=torch.float64), q.blocks, 4)
    with pytest.raises(RuntimeError, match="neither Q8_0"):
        _cpu.quant_linear(torch.randn(1, 64), q.blocks[:, :60].contiguous(), 4)


@needs_kernel
@pytest.mark.parametrize("kind", PACKED_KINDS)
def test_packed_layout_is_the_same_weight(kind):
    """quant_pack rearranges the blocks (16 rows to a register, the rest of the rows as they were)
    and quant_unpack puts them back bit for bit; every view of a packed QuantizedWeight (dequantized,
    rows of it, rows selected, stacked, its size) is the GGUF-layout weight's."""
    g = torch.Generator().manual_seed(3)
    for N, K in [(7, 64), (16, 96), (37, 160), (48, 32)]:
        q = QuantizedWeight.quantize(torch.randn(N, K, generator=g), kind)
        p = q.pack()
        assert p.packed and not q.packed and p.blocks.dtype == torch.int8 and p.blocks.shape == q.blocks.shape
        assert p.pack() is p and p.nbytes == q.nbytes
        assert N < 16 or not torch.equal(p.blocks.view(torch.uint8), q.blocks)     # rearranged
        assert torch.equal(_cpu.quant_unpack(p.blocks, K), q.blocks) and torch.equal(p.gguf_blocks(), q.blocks)
        assert torch.equal(p.dequantize(), q.dequantize())
        rows = torch.tensor([N - 1, 0, N // 2, N - 1])
        assert torch.equal(p.dequantize(rows=rows), q.dequantize(rows=rows))
        assert torch.equal(p.dequantize(torch.bfloat16, rows=rows), q.dequantize(torch.bfloat16, rows=rows))
        assert torch.equal(p.select_rows(rows).blocks, q.select_rows(rows).blocks)
        assert torch.equal(QuantizedWeight.cat([p, q]).blocks, torch.cat([q.blocks, q.blocks]))
        assert torch.equal(_cpu.quant_embedding_rows(p.blocks, rows, K),
                           _cpu.quant_embedding_rows(q.kernel_blocks(), rows, K))
    with pytest.raises(RuntimeError, match="must be uint8"):
        _cpu.quant_pack(p.blocks, K)
    with pytest.raises(RuntimeError, match="must be int8"):
        _cpu.quant_unpack(q.blocks, K)
    with pytest.raises(RuntimeError, match="out of range"):
        _cpu.quant_embedding_rows(p.blocks, torch.tensor([N]), K)


@needs_kernel
@pytest.mark.parametrize("kind", PACKED_KINDS)
def test_packed_kernel_forms_the_gguf_kernels_integer_dots(kind):
    """Both kernels quantize the activations alike and form the same exact int32 block dots; only
    how the float products are summed differs (here: in block order per output; there: in lanes,
    then one horizontal sum), so they agree to float rounding, far inside the int8 error."""
    g = torch.Generator().manual_seed(4)
    for T, K, N in [(1, 576, 960), (9, 1536, 576), (40, 576, 3072)]:
        q = QuantizedWeight.quantize(torch.randn(N, K, generator=g), kind)
        x = torch.randn(T, K, generator=g)
        a, b = _cpu.quant_linear(x, q.kernel_blocks(), N), _cpu.quant_linear(x, q.pack().blocks, N)
        assert (a - b).abs().max() <= 1e-5 * a.abs().max()


@needs_kernel
@pytest.mark.skipif(not getattr(_cpu, "quant_packed_is_fast", False), reason="a build without AVX2 packs nothing")
def test_the_compiled_forward_holds_quantized_weights_packed(stories_path, monkeypatch):
    """A model on the compiled CPU forward packs its quantized weights at load, in place of the
    GGUF-layout blocks (the same bytes: weight_bytes does not move), the tied head staying the
    embedding; the torch path keeps GGUF's layout."""
    engine = pd.Engine.from_pretrained(stories_path, quantization="q8_0")
    torch_path = pd.Engine.from_pretrained(stories_path, quantization="q8_0", attention_backend="torch")
    layers = [w for L in engine.model.layers for w in (L.qkv_w, L.o_w, L.gate_up_w) if isinstance(w, QuantizedWeight)]
    assert layers and all(w.packed for w in layers) and engine.model.lm_head.packed
    assert not any(w.packed for L in torch_path.model.layers for w in (L.qkv_w, L.o_w, L.gate_up_w))
    monkeypatch.setattr(_cpu, "quant_packed_kinds", [])         # a build without the packed kernel
    unpacked = pd.Engine.from_pretrained(stories_path, quantization="q8_0")
    assert not unpacked.model.lm_head.packed and engine.weight_bytes == unpacked.weight_bytes
    ids = engine.tokenizer.encode(STORY)
    a, b = logits_of(engine.model, ids), logits_of(unpacked.model, ids)
    assert 0 < (a - b).abs().max() <= 1e-4 * a.abs().max()           # the sums' order: float rounding
    unpacked_q5 = pd.Engine.from_pretrained(stories_path, quantization="q5_0")
    monkeypatch.undo()
    q5 = pd.Engine.from_pretrained(stories_path, quantization="q5_0")  # packed where the build has its kernel (AVX2)
    layers = [w for L in q5.model.layers for w in (L.qkv_w, L.o_w, L.gate_up_w) if isinstance(w, QuantizedWeight)]
    assert layers and all(w.kind == "q5_0" and w.packed == ("q5_0" in _cpu.quant_packed_kinds) for w in layers)
    assert q5.weight_bytes == unpacked_q5.weight_bytes
    # each matmul agrees to float rounding (test_packed_kernel_forms_the_gguf_kernels_integer_dots); over
    # the layers a last-bit difference can move an activation across a rounding step of the next
    # layer's int8 quantization, so the logits agree to a fraction of that error, not to the last bit
    a, b = logits_of(q5.model, ids), logits_of(unpacked_q5.model, ids)
    assert (a - b).abs().max() <= 5e-3 * a.abs().max()


def test_bad_blocks_and_kind_are_refused():
    with pytest.raises(ValueError, match="block type must be one of"):
        QuantizedWeight("q3_k", torch.zeros(1, 110, dtype=torch.uint8), (1, 256))
    with pytest.raises(ValueError, match="do not hold"):
        QuantizedWeight("q5_0", torch.zeros(1, 34, dtype=torch.uint8), (1, 32))
    with pytest.raises(ValueError, match="do not hold"):                    # the K-quants are never packed
        QuantizedWeight("q4_k", torch.zeros(1, 144, dtype=torch.int8), (1, 256))
    with pytest.raises(ValueError, match="quantization must be one of"):   # K-quants come from files
        QuantizedWeight.quantize(torch.zeros(1, 256), "q4_k")
    with pytest.raises(ValueError, match="do not hold"):
        QuantizedWeight("q8_0", torch.zeros(2, 34, dtype=torch.uint8), (2, 64))
    with pytest.raises(ValueError, match="quantization must be one of"):
        pd.Engine.from_pretrained("unused", quantization="int8")


# max |logit - float logit| over a 32-token story (logits reach ~22), measured: q8_0 0.21 with
# float activations, 0.29 with the int8 kernel; q4_0 6.9 either way (the head in Q8_0 both times)
@pytest.mark.parametrize("kind, max_error, same_greedy", [("q8_0", 0.4, True), ("q4_0", 10.0, False)])
def test_stories_quantized_logits_and_memory(stories_path, kind, max_error, same_greedy):
    dense = pd.Engine.from_pretrained(stories_path, attention_backend="torch")
    engine = pd.Engine.from_pretrained(stories_path, quantization=kind)
    model = engine.model
    assert model.quantized and model.uses_cpu_extension() == (_cpu is not None)   # the one-call forward
    assert isinstance(model.layers[0].qkv_w, QuantizedWeight) and model.layers[0].qkv_w.kind == kind
    assert isinstance(model.layers[0].down_w, torch.Tensor)        # 172 inputs: not a multiple of 32
    assert isinstance(model.embed, torch.Tensor)                   # the embedding keeps its type,
    assert isinstance(model.lm_head, QuantizedWeight) and model.lm_head.kind == "q8_0"   # the head: Q8_0
    ids = engine.tokenizer.encode(STORY)
    error = (logits_of(model, ids) - logits_of(dense.model, ids)).abs().max().item()
    assert 0 < error < max_error
    reference = pd.Engine.from_pretrained(stories_path, quantization=kind, attention_backend="torch").model
    kernel_vs_reference = (logits_of(model, ids) - logits_of(reference, ids)).abs().max().item()
    assert kernel_vs_reference < 0.4 and (kernel_vs_reference > 0) == (_cpu is not None)   # int8 activations
    out = engine.generate("Once upon a time", pd.SamplingParams(max_tokens=16))[0]
    assert out.text.startswith(", there was a little girl") and len(out.token_ids) == 16
    if same_greedy:
        assert out.token_ids == dense.generate("Once upon a time", pd.SamplingParams(max_tokens=16))[0].token_ids
    assert engine.weight_bytes < 0.5 * dense.weight_bytes       # both with the compiled forward's copies


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_weight_bytes_count_blocks_at_their_size(stories_path, kind, monkeypatch):
    from safetensors.torch import load_file

    from pagedecode.model import cpu_forward
    monkeypatch.setattr(cpu_forward, "_cpu_ext", None)                 # no compiled forward: no derived copies
    engine = pd.Engine.from_pretrained(stories_path, quantization=kind)
    checkpoint = load_file(str(stories_path / "model.safetensors"))
    layer_floats = sum(t.numel() for n, t in checkpoint.items() if n.endswith("proj.weight") and "down" not in n)
    saved = layer_floats * 4 - layer_floats // 32 * (34 if kind == "q8_0" else 18)
    head_blocks = 512 * 64 // 32 * 34                               # the tied head, now apart in Q8_0
    assert engine.weight_bytes == sum(t.numel() * 4 for t in checkpoint.values()) - saved + head_blocks
    assert pd.Engine.from_pretrained(stories_path).weight_bytes == sum(t.numel() * 4 for t in checkpoint.values())


@pytest.mark.parametrize("kind, max_error", [("q8_0", 0.05), ("q4_0", 0.5)])
def test_random_model_quantized_logits(kind, max_error):
    cfg, weights = random_llama(seed=5)
    config = ModelConfig.from_hf(cfg)
    dense = LlamaModel(config, weights, attention_backend="torch")
    quant = LlamaModel(config, weights, attention_backend="torch", quantization=kind)
    ids = list(range(3, 40))
    ref = logits_of(dense, ids)
    error = (logits_of(quant, ids) - ref).abs().max().item()
    assert 0 < error < max_error * ref.abs().max().item()
    assert quant.weight_bytes < dense.weight_bytes * (0.55 if kind == "q8_0" else 0.45)


def test_cli_quantization_flag(stories_path, capsys):
    assert cli.main(["generate", "--model", str(stories_path), "--quantization", "q8_0",
                     "--prompt", "Once upon a time", "--max-tokens", "16"]) == 0
    assert capsys.readouterr().out.strip() == ", there was a little girl named Lily. She loved to play"


def test_quantized_weights_survive_a_bfloat16_model(stories_path):
    engine = pd.Engine.from_pretrained(stories_path, quantization="q8_0", dtype="bfloat16")
    out = engine.generate("Once upon a time", pd.SamplingParams(max_tokens=8))[0]
    assert len(out.token_ids) == 8 and np.isfinite(out.token_ids).all()


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_quantized_tokens_do_not_depend_on_the_batch(stories_path, kind):
    """Each row's activations are quantized on their own: a request alone, in a batch, and in
    chunked prefill picks the same greedy tokens (the gemv and the gemm paths)."""
    alone = pd.Engine.from_pretrained(stories_path, quantization=kind)
    batched = pd.Engine.from_pretrained(stories_path, quantization=kind, max_tokens_per_step=7, page_size=8)
    prompts = ["Once upon a time", "Lily and Tom", "Tom had a big red ball and a small blue car. He", "Sue"]
    params = pd.SamplingParams(max_tokens=24)
    together = batched.generate(prompts, params)
    for prompt, out in zip(prompts, together):
        assert out.token_ids == alone.generate(prompt, params)[0].token_ids


@pytest.mark.skipif(not HAS_TRITON or not interpreting(), reason="needs triton's interpreter")
def test_triton_backend_multiplies_quantized_weights_with_the_triton_kernels(stories_path, monkeypatch):
    """The forward's path for CUDA (attention_backend "auto" there, "triton" here in the
    interpreter): every quantized linear goes through kernels/quant_matmul.py's GEMV (1 token) or
    GEMM (9 tokens), never a per-call dequantization, and agrees with the torch reference path.
    One kind (the interpreter is slow); tests/kernels/test_quant_matmul.py covers both."""
    kind = "q8_0"
    from pagedecode.kernels import quant_matmul as QM
    calls = []
    real = QM.quant_matmul_triton
    monkeypatch.setattr(QM, "quant_matmul_triton", lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    triton_model = pd.Engine.from_pretrained(stories_path, quantization=kind, attention_backend="triton").model
    reference = pd.Engine.from_pretrained(stories_path, quantization=kind, attention_backend="torch").model
    quantized = sum(isinstance(w, QuantizedWeight) for L in triton_model.layers for w in (L.qkv_w, L.o_w, L.gate_up_w,
                                                                                         L.down_w)) + 1   # + the head
    for ids in ([1], [1, 403, 407, 261, 378, 286, 438, 289, 13]):
        calls.clear()
        got = logits_of(triton_model, ids)
        assert calls == [len(ids)] * quantized
        want = logits_of(reference, ids)
        assert (got - want).abs().max().item() < 1e-3 * want.abs().max().item()


@needs_kernel
@pytest.mark.parametrize("layout", LAYOUTS)
def test_det_linear_takes_quantized_blocks(layout):
    """Deterministic mode's det_linear hands Q8_0 / Q4_0 blocks to quant_linear (its shape check
    compared K with the blocks' width in bytes, refusing every quantized weight)."""
    q = QuantizedWeight.quantize(torch.randn(40, 96, generator=torch.Generator().manual_seed(5)), "q4_0")
    blocks, x = blocks_in(q, layout), torch.randn(3, 96)
    assert torch.equal(_cpu.det_linear(x, blocks), _cpu.quant_linear(x, blocks, 40))
    with pytest.raises(RuntimeError, match="det_linear"):
        _cpu.det_linear(x, torch.randn(40, 95))


# max |logit - float logit| over the story (logits reach ~22), measured with the compiled kernels:
# q4_1 3.2, q5_0 1.7, q5_1 1.7 (q4_0: 6.9)
@pytest.mark.parametrize("kind, max_error", [("q4_1", 5.0), ("q5_0", 3.0), ("q5_1", 3.0)])
def test_quantization_to_the_other_blocks_of_32(stories_path, kind, max_error):
    """quantization="q4_1" / "q5_0" / "q5_1": the layer weights in blocks that are exactly gguf's
    reference quantizer's (llama.cpp's quantize_row_*_ref), run by the compiled kernels."""
    from safetensors.torch import load_file
    dense = pd.Engine.from_pretrained(stories_path, attention_backend="torch")
    engine = pd.Engine.from_pretrained(stories_path, quantization=kind)
    model = engine.model
    assert model.uses_cpu_extension() == (_cpu is not None)
    checkpoint = load_file(str(stories_path / "model.safetensors"))
    o_proj = checkpoint["model.layers.0.self_attn.o_proj.weight"].float().numpy()
    want = gguf.quants.quantize(o_proj, Q[kind.upper()])
    assert model.layers[0].o_w.kind == kind and np.array_equal(model.layers[0].o_w.gguf_blocks().numpy(), want)
    ids = engine.tokenizer.encode(STORY)
    error = (logits_of(model, ids) - logits_of(dense.model, ids)).abs().max().item()
    assert 0 < error < max_error
    out = engine.generate("Once upon a time", pd.SamplingParams(max_tokens=16))[0]
    assert out.text.startswith(", there was a little") and len(out.token_ids) == 16
