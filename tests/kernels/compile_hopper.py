"""Compile every Triton kernel ahead of time for Hopper (sm_90), no GPU needed: catches what the
interpreter accepts but the real compiler rejects. Run as a script (not under TRITON_INTERPRET)."""
import inspect
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

os.environ.setdefault("PAGEDECODE_TRITON", "1")     # Triton under a CPU-only torch: compiling for sm_90 here

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import pagedecode.kernels.decode_attention as DA
import pagedecode.kernels.extend_attention as EA
import pagedecode.kernels.gguf_matmul as GM
import pagedecode.kernels.kv_quant as KQ
import pagedecode.kernels.kv_write as KW
import pagedecode.kernels.lora as LO
import pagedecode.kernels.matmul as MM
import pagedecode.kernels.quant_matmul as QM
import pagedecode.kernels.rejection as RJ
import pagedecode.kernels.rmsnorm as RN
import pagedecode.kernels.sampling as S

DTYPES = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}


def signature(kernel, pointer_types, constexprs):
    names = inspect.signature(kernel.fn).parameters
    return {n: "constexpr" if n in constexprs else pointer_types.get(n, "i32") for n in names}


def cases():
    sampling = {"logits_ptr": "*fp32", "base_ptr": "*fp32", "tokens_ptr": "*i64", "logprobs_ptr": "*fp32",
                "slot_ptr": "*i64", "index_ptr": "*i64", "temp_ptr": "*fp32", "topk_ptr": "*i32", "topp_ptr": "*fp32",
                "lminp_ptr": "*fp32", "seed_ptr": "*i64", "proc_ptr": "*fp32", "state_slot_ptr": "*i64",
                "rep_ptr": "*fp32", "pres_ptr": "*fp32", "freq_ptr": "*fp32", "active_ptr": "*i32",
                "counts_ptr": "*i32", "seen_ptr": "*u8", "bias_ptr": "*fp32", "mask_ptr": "*i32",
                "tile_m_ptr": "*fp32", "tile_l_ptr": "*fp32", "tile_arg_ptr": "*i32", "tile_zmax_ptr": "*fp32",
                "tile_n_ptr": "*i32", "tile_key_ptr": "*i64", "cand_z_ptr": "*fp32", "cand_i_ptr": "*i32",
                "draw_score_ptr": "*fp32", "draw_at_ptr": "*i32", "row_z_ptr": "*fp32", "row_i_ptr": "*i32"}
    penalty_args = ("state_slot_ptr", "rep_ptr", "pres_ptr", "freq_ptr", "active_ptr", "counts_ptr", "seen_ptr",
                    "bias_ptr")
    for pen, mask in ((False, False), (True, False), (False, True), (True, True)):
        # as sample_triton launches it: each absent input None (a constexpr); settings per slot (the
        # engine's launch) with penalties or a mask, per row (tests, benchmarks) without
        slots = pen or mask
        absent = dict.fromkeys((() if pen else penalty_args) + (() if mask else ("mask_ptr", "mask_words"))
                               + (() if slots else ("proc_ptr", "slot_ptr")))
        yield f"sampling tiles penalties={pen} bitmask={mask}", S._tile_kernel, sampling, dict(
            TILE=4096, CAND=S.TILE_CANDIDATES, HAS_SLOTS=slots, HAS_PENALTIES=pen, HAS_MASK=mask, **absent)
    for slots in (False, True):
        absent = {} if slots else {"slot_ptr": None}
        yield f"sampling tile draws slots={slots}", S._tile_draw_kernel, sampling, dict(
            TILE=4096, BLOCK_T=32, HAS_SLOTS=slots, **absent)
        yield f"sampling finish slots={slots}", S._finish_kernel, sampling, dict(
            CAND=S.TILE_CANDIDATES, BLOCK_T=32, BLOCK_V=4096, SEARCH_STEPS=33, BLOCK_C=S.CANDIDATES,
            HAS_SLOTS=slots, **absent)
    for dt, tdt in DTYPES.items():
        kv = {"q_ptr": f"*{dt}", "kc_ptr": f"*{dt}", "vc_ptr": f"*{dt}", "pt_ptr": "*i32", "lens_ptr": "*i32",
              "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "sm_scale_log2": "fp32", "cu_ptr": "*i32",
              "out_ptr": f"*{dt}", "k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "slot_ptr": "*i64",
              "ks_ptr": "*fp32", "vs_ptr": "*fp32"}
        for block_n in ((32, 64, 128) if dt == "bf16" else (64,)):
            yield f"decode split {dt} n={block_n}", DA._decode_split_kernel, kv, dict(
                GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_G=16, BLOCK_N=block_n, BLOCK_D=128, DOT_DTYPE=tdt,
                WRITE_OUT=False, QUANT=False)
        # one split per sequence: the split kernel writes the output itself (no merge launch)
        yield f"decode split direct {dt}", DA._decode_split_kernel, kv, dict(
            GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_G=16, BLOCK_N=64, BLOCK_D=128, DOT_DTYPE=tdt, WRITE_OUT=True,
            QUANT=False)
        yield f"decode merge {dt}", DA._decode_merge_kernel, kv, dict(HEAD_DIM=128, BLOCK_D=128,
                                                                            BLOCK_S=DA.MERGE_BLOCK)
        for bm, bn in (((64, 64), (128, 64), (128, 32), (64, 32)) if dt == "bf16" else ((64, 64),)):
            yield f"extend {dt} m={bm} n={bn}", EA._extend_kernel, kv, dict(
                GROUP=4, GROUP_PAD=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_M=bm // 4, BLOCK_N=bn, BLOCK_D=128,
                DOT_DTYPE=tdt, QUANT=False)
        yield f"kv write {dt}", KW._write_kv_kernel, kv, dict(PAGE_SIZE=16, HEADS=8, HEAD_DIM=128, BLOCK_H=8,
                                                            BLOCK_D=128)
    # 8-bit KV caches (kernels/kv_quant.py) under a float32 model: the attention kernels' scaled
    # loads and the quantizing write, int8 and fp8 e4m3 (sm_90 converts e4m3 in hardware)
    for cdt, qmax in (("i8", 127.0), ("fp8e4nv", 448.0)):
        kv = {"q_ptr": "*fp32", "kc_ptr": f"*{cdt}", "vc_ptr": f"*{cdt}", "ks_ptr": "*bf16", "vs_ptr": "*bf16",
              "pt_ptr": "*i32", "lens_ptr": "*i32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
              "sm_scale_log2": "fp32", "cu_ptr": "*i32", "out_ptr": "*fp32", "k_ptr": "*fp32", "v_ptr": "*fp32",
              "slot_ptr": "*i64"}
        yield f"decode split {cdt} cache", DA._decode_split_kernel, kv, dict(
            GROUP=4, HEAD_DIM=64, PAGE_SIZE=16, BLOCK_G=16, BLOCK_N=64, BLOCK_D=64, DOT_DTYPE=tl.float32,
            WRITE_OUT=False, QUANT=True)
        yield f"extend {cdt} cache", EA._extend_kernel, kv, dict(
            GROUP=4, GROUP_PAD=4, HEAD_DIM=64, PAGE_SIZE=16, BLOCK_M=16, BLOCK_N=64, BLOCK_D=64,
            DOT_DTYPE=tl.float32, QUANT=True)
        yield f"kv write {cdt} cache", KW._write_kv_quant_kernel, kv, dict(
            PAGE_SIZE=16, HEADS=3, HEAD_DIM=64, BLOCK_H=4, BLOCK_D=64, QLIMIT=qmax, IS_INT=cdt == "i8",
            FP8_STEPS=KQ.FP8_STEPS)
    yield "speculative rejection", RJ._rejection_kernel, {
        "target_ptr": "*fp32", "draft_ptr": "*fp32", "ids_ptr": "*i64", "n_ptr": "*i32", "seed_ptr": "*i64",
        "index_ptr": "*i64", "tokens_ptr": "*i64", "accepted_ptr": "*i32"}, dict(BLOCK_V=4096)
    yield from quant_cases()
    yield from deterministic_cases()
    yield from lora_cases()           # last: the device check's build step has a time limit
    yield from gguf_cases()


def deterministic_cases():
    """Deterministic mode's matmul (the config matmul_config gives on the GPU, with and without a
    bias), RMSNorm (one row per program; 16 warps for an 8192-wide row) and quantized GEMM config."""
    import torch
    for dt, tdt in DTYPES.items():
        cfg = MM.matmul_config(4096, 4096, {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt])
        types = {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "b_ptr": f"*{dt}", "out_ptr": f"*{dt}", "eps": "fp32"}
        for bias in ((False, True) if dt == "bf16" else (False,)):
            yield f"deterministic matmul {dt} bias={bias}", MM._matmul_kernel, types, dict(
                HAS_BIAS=bias, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], GROUP_M=8,
                DOT_DTYPE=tdt), dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        yield f"rmsnorm {dt}", RN._rms_norm_kernel, types, dict(BLOCK_H=8192), dict(num_warps=16)
    # the quantized GEMM's one deterministic config where the sweep's list lacks it (bf16 has it)
    for kind, dt, tdt in (("q8_0", "fp16", tl.float16), ("q8_0", "fp32", tl.float32), ("q4_0", "fp32", tl.float32)):
        q4 = kind == "q4_0"
        types = {"x_ptr": f"*{dt}", "q_ptr": "*u8" if q4 else "*i8", "d_ptr": "*fp16", "out_ptr": f"*{dt}"}
        c = QM.deterministic_gemm_config()
        yield f"deterministic quant gemm {kind} {dt}", QM._gemm_kernel, types, dict(
            Q4=q4, BYTES=QM.BLOCK_BYTES[kind], BLOCK_M=c["block_m"], BLOCK_N=c["block_n"], BLOCK_K=c["block_k"],
            GROUP_M=8, DOT_DTYPE=tdt), dict(num_warps=c["num_warps"], num_stages=c["num_stages"])


# the quantized matmuls: in bfloat16 every config kernel_sweep.py --quant --sweep times (the first
# of each, and the GEMM's first three, are the wrappers' defaults on the GPU), in float16 / float32
# the defaults (float16 for Q8_0 only: Q4_0 differs in its loads, not in the dot):
# (block_n, block_k, warps) for the GEMV, (block_m, block_n, block_k, warps, stages) for the GEMM
QUANT_GEMV = ((4, 256, 1), (16, 256, 4), (8, 1024, 4))
QUANT_GEMM = ((16, 32, 128, 4, 4), (32, 32, 128, 4, 4), (128, 128, 64, 8, 3), (16, 64, 128, 4, 3),
              (64, 128, 64, 4, 4))


def quant_cases():
    for kind, q4 in (("q8_0", False), ("q4_0", True)):
        for dt, tdt in DTYPES.items():
            if q4 and dt == "fp16":
                continue
            types = {"x_ptr": f"*{dt}", "q_ptr": "*u8" if q4 else "*i8", "d_ptr": "*fp16", "out_ptr": f"*{dt}"}
            for bn, bk, warps in (QUANT_GEMV if dt == "bf16" else QUANT_GEMV[:1]):
                yield f"quant gemv {kind} {dt} n={bn} k={bk} w={warps}", QM._gemv_kernel, types, dict(
                    Q4=q4, BYTES=QM.BLOCK_BYTES[kind], BLOCK_N=bn, BLOCK_KB=bk // 32), dict(num_warps=warps)
            for bm, bn, bk, warps, stages in (QUANT_GEMM if dt == "bf16" else (QUANT_GEMM[0], QUANT_GEMM[2])):
                yield f"quant gemm {kind} {dt} m={bm} n={bn} k={bk} w={warps} s={stages}", QM._gemm_kernel, types, dict(
                    Q4=q4, BYTES=QM.BLOCK_BYTES[kind], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, DOT_DTYPE=tdt), \
                    dict(num_warps=warps, num_stages=stages)


def gguf_cases():
    """The other GGUF types' kernels: in bfloat16 the GEMV's default, the GEMM's small- and large-M
    defaults and deterministic config, the dequantizing kernel; the GEMM's dot in float32 and
    float16 once each (the dequantization does not depend on the activations' type)."""
    det = GM.deterministic_gemm_config()
    gemms = (QUANT_GEMM[0], QUANT_GEMM[2], (det["block_m"], det["block_n"], det["block_k"], det["num_warps"],
                                            det["num_stages"]))
    for kind in GM.KINDS:
        for dt, tdt in DTYPES.items():
            if dt != "bf16" and (dt, kind) not in (("fp32", "q4_k"), ("fp16", "q5_0")):
                continue
            types = {"x_ptr": f"*{dt}", "q_ptr": "*u8", "h_ptr": "*fp16", "out_ptr": f"*{dt}"}
            if dt == "bf16":
                bn, bk, warps = QUANT_GEMV[0]
                yield f"gguf gemv {kind} {dt} n={bn} k={bk} w={warps}", GM._gemv_kernel, types, dict(
                    KIND=kind, BLOCK_N=bn, BLOCK_K=bk, SUB=16 if kind == "q6_k" else 32), dict(num_warps=warps)
                yield f"gguf dequantize {kind} {dt}", GM._dequantize_kernel, types, dict(
                    KIND=kind, BLOCK_N=16, BLOCK_K=256), dict(num_warps=4)
            for bm, bn, bk, warps, stages in (gemms if dt == "bf16" else gemms[:1]):
                yield f"gguf gemm {kind} {dt} m={bm} n={bn} k={bk} w={warps} s={stages}", GM._gemm_kernel, types, dict(
                    KIND=kind, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, DOT_DTYPE=tdt), \
                    dict(num_warps=warps, num_stages=stages)


def lora_cases():
    """The segmented LoRA shrink and expand, each activation type, at max_lora_rank 64 (BLOCK_R 64)."""
    cfg = LO.lora_config(16, 4096)
    for dt, tdt in DTYPES.items():
        types = {"x_ptr": f"*{dt}", "a_ptr": f"*{dt}", "b_ptr": f"*{dt}", "out_ptr": f"*{dt}", "shrunk_ptr": "*fp32",
                 "scaling_ptr": "*fp32", "seg_starts_ptr": "*i32", "seg_slots_ptr": "*i32"}
        yield f"lora shrink {dt}", LO._shrink_kernel, types, dict(
            BLOCK_M=cfg["block_m"], BLOCK_R=64, BLOCK_K=cfg["block_k"], DOT_DTYPE=tdt), dict(num_warps=4)
        yield f"lora expand {dt}", LO._expand_kernel, types, dict(
            BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_R=64), dict(num_warps=4)


def compile_case(i: int) -> tuple[str, bool]:
    """Case i of cases(), compiled: its report line(s), and whether it failed."""
    name, kernel, types, consts, *options = list(cases())[i]
    if options:
        stages = options[0]
    else:
        stages = {"num_stages": 3, "num_warps": 8} if " m=128" in name or " n=128" in name else {}
    start = time.perf_counter()
    try:
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature(kernel, types, consts),
                                            constexprs=consts), target=GPUTarget("cuda", 90, 32), options=stages)
    except Exception as e:
        cause = e
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        return f"FAIL {name}: {type(e).__name__}: {str(e)[:600]}\n    cause: {str(cause)[-600:]}", True
    line = f"ok   {name}: shared {compiled.metadata.shared} bytes ({time.perf_counter() - start:.1f} s)"
    if compiled.metadata.shared > 227 * 1024:
        return line + f"\nFAIL {name}: needs more shared memory than Hopper has", True
    return line, False


def main() -> int:
    # each compile (Triton's front end, LLVM, ptxas) runs on one core: one worker per core this
    # process may use (a cold cache compiles ~60 kernels; on 2 cores this halves the wait)
    n = len(list(cases()))
    workers = max(1, min(len(os.sched_getaffinity(0)), n))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        results = list(pool.map(compile_case, range(n)))
    for line, _ in results:
        print(line)
    return 1 if any(failed for _, failed in results) else 0


if __name__ == "__main__":
    sys.exit(main())
