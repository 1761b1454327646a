"""Compile fmoe's Triton kernels for Hopper (sm_90a) without a GPU and report their cost.

    python benchmarks/kernel_stats.py

Runs Triton's real compiler and the ptxas it ships (no device needed) at the benchmark
shapes and prints, per kernel: registers per thread, spill bytes, and the SASS instruction
count with the counts of shuffles and shared-memory loads (cross-lane and cross-warp
reductions). A static read, not a timing: it shows what a change does to the generated
code before any GPU time is spent, and catches kernels the interpreter accepts but the
compiler rejects.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from fmoe.ops import balance, delta, dispatch, experts, fp8, loss, packed, rope, routing, scan, sparse  # noqa: E402
from fmoe.optim import adamw  # noqa: E402

BIN = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
TARGET = GPUTarget("cuda", 90, 32)


def _signature(kernel, pointers, scalars, constexprs):
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        else:
            sig[name] = scalars[name]
    return sig


def _aligned(kernel, pointers, scalars):
    """What a real launch specialises on: 16-byte aligned tensors (torch's allocations are)
    and integer arguments divisible by 16 (the benchmark's token counts are)."""
    hint = [["tt.divisibility", 16]]
    return {(i,): hint for i, name in enumerate(kernel.arg_names) if name in pointers or scalars.get(name) == "i32"}


def compile_stats(kernel, pointers, scalars, constexprs, num_warps):
    src = ASTSource(
        fn=kernel, signature=_signature(kernel, pointers, scalars, constexprs), constexprs=constexprs,
        attrs=_aligned(kernel, pointers, scalars),
    )
    compiled = triton.compile(src, target=TARGET, options={"num_warps": num_warps})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = pathlib.Path(tmp, "k.ptx")
        ptx.write_text(compiled.asm["ptx"])
        info = subprocess.run([BIN / "ptxas", "-arch=sm_90a", "-v", ptx, "-o", pathlib.Path(tmp, "k.cubin")], capture_output=True, text=True).stderr
        cubin = pathlib.Path(tmp, "c.cubin")
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([BIN / "cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
    ops = collections.Counter(m.split(".")[0] for m in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([A-Z][A-Z0-9_.]*)", sass))
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores", info)
    return dict(
        regs=int(regs.group(1)) if regs else -1,
        spill=int(spill.group(1)) if spill else 0,
        sass=sum(ops.values()),
        shfl=ops["SHFL"],
        lds=ops["LDS"],
    )


def cases():
    ds = dict(E=256, K=8, G=8, GS=32, TOPK_GROUPS=4, PER_GROUP=2, SCORE=routing.SIGMOID, HAS_BIAS=True)
    qw = dict(E=128, K=8, G=1, GS=128, TOPK_GROUPS=1, PER_GROUP=8, SCORE=routing.SOFTMAX_POST, HAS_BIAS=False)
    fwd_ptrs = dict(logits_ptr="*bf16", bias_ptr="*fp32", weights_ptr="*fp32", experts_ptr="*i64")
    fwd_scalars = dict(T="i32", scale="fp32")
    ernie = dict(E=64, K=6, G=1, GS=64, TOPK_GROUPS=1, PER_GROUP=6, SCORE=routing.SOFTMAX_POST, HAS_BIAS=True)  # probabilities + bias
    # logits + bias choose, raw sigmoids
    kolibri = dict(E=384, K=6, G=1, GS=384, TOPK_GROUPS=1, PER_GROUP=6, SCORE=routing.SIGMOID_RAW, HAS_BIAS=True, BIAS_ON_LOGITS=True)
    # sqrt(softplus) + bias choose, renormalised (DeepSeek-V4)
    dsv4 = dict(E=256, K=6, G=1, GS=256, TOPK_GROUPS=1, PER_GROUP=6, SCORE=routing.SQRT_SOFTPLUS, HAS_BIAS=True)
    for name, meta in (("route_fwd deepseek", ds), ("route_fwd qwen", qw), ("route_fwd ernie", ernie), ("route_fwd kolibri", kolibri),
                       ("route_fwd deepseek-v4", dsv4)):
        yield name, routing._route_fwd_kernel, fwd_ptrs, fwd_scalars, {"BIAS_ON_LOGITS": False, **meta, **routing._fwd_blocks(meta["E"], meta["G"], meta["K"])}
    bwd_ptrs = dict(logits_ptr="*bf16", experts_ptr="*i64", grad_w_ptr="*fp32", grad_logits_ptr="*bf16")
    for name, E, K, score in (("route_bwd deepseek", 256, 8, routing.SIGMOID), ("route_bwd qwen", 128, 8, routing.SOFTMAX_POST),
                              ("route_bwd deepseek-v4", 256, 6, routing.SQRT_SOFTPLUS)):
        yield name, routing._route_bwd_kernel, bwd_ptrs, fwd_scalars, dict(E=E, K=K, SCORE=score, **routing._bwd_blocks(E, K))
    rows = dict(E=256, **balance._row_blocks(256))
    for score in ("sigmoid", "sqrtsoftplus"):  # the aux scores' kernels: DeepSeek-V3's and DeepSeek-V4's
        code = balance.AUX_SCORES.index(score)
        yield f"aux_fwd {score}", balance._aux_fwd_kernel, dict(logits_ptr="*bf16", scores_ptr="*fp32", experts_ptr="*i64", counts_ptr="*i32"), \
            dict(T="i32"), dict(K=8, SCORE=code, **rows)
        yield f"aux_bwd {score}", balance._aux_bwd_kernel, dict(logits_ptr="*bf16", grad_scores_ptr="*fp32", grad_logits_ptr="*bf16"), \
            dict(T="i32"), dict(SCORE=code, **rows)
    yield "lse_fwd", balance._lse_fwd_kernel, dict(logits_ptr="*bf16", lse_ptr="*fp32"), dict(T="i32"), rows
    yield "lse_bwd", balance._lse_bwd_kernel, dict(logits_ptr="*bf16", lse_ptr="*fp32", grad_lse_ptr="*fp32", grad_logits_ptr="*bf16"), dict(T="i32"), rows
    # dispatch at T=16384, k=8, E=128, H=2048, bf16
    E, K, H = 128, 8, 2048
    plan = dispatch._plan_blocks(E)
    tile = dispatch._row_blocks(H)
    block_rows = tile.pop("BLOCK_ROWS")
    warps = dict(num_warps=plan["num_warps"])
    yield "plan_count", dispatch._plan_count_kernel, dict(experts_ptr="*i64", hist_ptr="*i32", slot_of_row_ptr="*i32"), dict(S="i32", R="i32"), dict(
        E=E, BLOCK_S=plan["BLOCK_S"], BLOCK_E=plan["BLOCK_E"], **warps)
    yield "plan_scan", dispatch._plan_scan_kernel, dict(hist_ptr="*i32", counts_ptr="*i64"), dict(n_chunks="i32"), dict(
        E=E, BLOCK_C=plan["SCAN_C"], BLOCK_E=plan["SCAN_E"], **warps)
    yield "plan_rank", dispatch._plan_rank_kernel, dict(experts_ptr="*i64", before_ptr="*i32", counts_ptr="*i64", offsets_ptr="*i32",
                                                        row_of_slot_ptr="*i32", slot_of_row_ptr="*i32"), dict(S="i32", align="i32"), dict(
        E=E, BLOCK_S=plan["BLOCK_S"], BLOCK_E=plan["RANK_E"], **warps)
    perm_ptrs = dict(src_ptr="*bf16", slot_of_row_ptr="*i32", weights_ptr="*fp32", y_perm_ptr="*bf16", dst_ptr="*bf16", grad_w_ptr="*fp32")
    yield "permute_fwd", dispatch._permute_rows_kernel, perm_ptrs, dict(R="i32", H="i32"), dict(K=K, WEIGHTED=False, BLOCK_R=block_rows, **tile)
    yield "unpermute_bwd", dispatch._permute_rows_kernel, perm_ptrs, dict(R="i32", H="i32"), dict(K=K, WEIGHTED=True, BLOCK_R=block_rows, **tile)
    scatter_ptrs = dict(src_ptr="*bf16", row_of_slot_ptr="*i32", weights_ptr="*fp32", y_perm_ptr="*bf16", dst_ptr="*bf16", grad_w_ptr="*fp32")
    for name, weighted in (("permute_fwd scatter", False), ("unpermute_bwd scatter", True)):
        yield name, dispatch._scatter_rows_kernel, scatter_ptrs, dict(T="i32", H="i32"), dict(K=K, WEIGHTED=weighted, BLOCK_T=block_rows, BLOCK_K=K, **tile)
    yield "zero_empty_rows", dispatch._zero_empty_rows_kernel, dict(slot_of_row_ptr="*i32", dst_ptr="*bf16"), dict(R="i32", H="i32"), dict(BLOCK_R=64, BLOCK_H=64, num_warps=4)
    unperm_ptrs = dict(y_perm_ptr="*bf16", row_of_slot_ptr="*i32", weights_ptr="*fp32", y_ptr="*bf16")
    yield "unpermute_fwd", dispatch._unpermute_rows_kernel, unperm_ptrs, dict(T="i32", H="i32"), dict(K=K, WEIGHTED=True, BLOCK_T=block_rows, **tile)
    yield "permute_bwd", dispatch._unpermute_rows_kernel, unperm_ptrs, dict(T="i32", H="i32"), dict(K=K, WEIGHTED=False, BLOCK_T=block_rows, **tile)
    # experts at H=2048, F=768, E=128, bf16 (the GEMMs loop over K: no per-row count)
    gemm_ptrs = dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", offsets_ptr="*i32")
    gemm_scalars = dict(R="i32", K="i32", N="i32", E="i32")
    for name, trans in (("grouped_gemm_fwd", False), ("grouped_gemm_dx", True)):
        yield name, experts._grouped_gemm_fwd_kernel, gemm_ptrs, gemm_scalars, dict(TRANS_W=trans, BLOCK_E=128, **experts._gemm_blocks(torch.bfloat16))
    yield "grouped_gemm_dw", experts._grouped_gemm_dw_kernel, dict(x_ptr="*bf16", dy_ptr="*bf16", dw_ptr="*bf16", offsets_ptr="*i32"), dict(R="i32", K="i32", N="i32"), experts._dw_blocks(torch.bfloat16)
    glu_scalars = dict(n="i32", alpha="fp32", limit="fp32", offset="fp32")
    # silu(gate) * up; gpt-oss's; Gemma's; Step 3.7's (the activation capped)
    for suffix, clamp, gelu, cap in (("", False, False, False), (" clamped", True, False, False), (" geglu", False, True, False),
                                     (" capped", True, False, True)):
        flags = dict(CLAMP=clamp, GELU=gelu, CAP=cap, **experts._SWIGLU_META)
        yield f"swiglu_fwd{suffix}", experts._swiglu_fwd_kernel, dict(gate_ptr="*bf16", up_ptr="*bf16", h_ptr="*bf16"), glu_scalars, flags
        yield f"swiglu_bwd{suffix}", experts._swiglu_bwd_kernel, dict(gate_ptr="*bf16", up_ptr="*bf16", grad_h_ptr="*bf16", grad_gate_ptr="*bf16", grad_up_ptr="*bf16"), glu_scalars, flags
    for name, per_expert in (("zero_unowned rows", False), ("zero_unowned dW", True)):
        yield name, experts._zero_unowned_kernel, dict(out_ptr="*bf16", offsets_ptr="*i32"), dict(n_rows="i32", n_cols="i32", E="i32"), dict(PER_EXPERT=per_expert, **experts._ZERO_META)
    # RoPE at T=16384, D=128, bf16: q with 32 heads, k with 8, the backward (inverse
    # rotation), interleaved pairs, and MLA's 64 rotated of 192 channels over 128 heads
    rope_ptrs = dict(x_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", out_ptr="*bf16")
    rope_scalars = dict(N="i32", T="i32", H="i32", stride_xn="i32", stride_xh="i32", stride_on="i32", stride_oh="i32")
    for name, H, F, P, interleaved, inverse in (
        ("rope_fwd q", 32, 64, 0, False, False), ("rope_bwd q", 32, 64, 0, False, True),
        ("rope_fwd k", 8, 64, 0, False, False), ("rope_fwd q inter", 32, 64, 0, True, False),
        ("rope_fwd mla", 128, 32, 128, True, False),
    ):
        yield name, rope._rope_kernel, rope_ptrs, rope_scalars, dict(F=F, P=P, INTERLEAVED=interleaved, INVERSE=inverse, **rope._blocks(H, F, P))
    # packed sequences at T=65536: hidden [T, 2048] bf16 (moved as int16) and token ids [T] int64
    roll_sc = dict(T="i32", INNER="i32", n_seqs="i32", n_steps="i32", shift="i32")
    yield "roll_packed hidden", packed._roll_packed_kernel, dict(x_ptr="*i16", cu_ptr="*i32", fill_ptr="*i16", out_ptr="*i16"), roll_sc, packed._roll_blocks(2048)
    yield "roll_packed ids", packed._roll_packed_kernel, dict(x_ptr="*i64", cu_ptr="*i32", fill_ptr="*i64", out_ptr="*i64"), roll_sc, packed._roll_blocks(1)
    # cross-entropy at V=131072, bf16 (linear_cross_entropy runs the same kernel on its chunks)
    ce_ptrs = dict(logits_ptr="*bf16", labels_ptr="*i64", grad_ptr="*bf16", loss_ptr="*fp32", lse_ptr="*fp32", n_valid_ptr="*i64")
    ce_scalars = dict(N="i32", V="i32", stride_x="i32", stride_g="i32", stride_l="i32", ignore_index="i32", softcap="fp32")
    for name, write_grad, cap in (("ce_fwd grad", True, False), ("ce_fwd", False, False), ("ce_fwd grad softcap", True, True)):
        yield name, loss._ce_fwd_kernel, ce_ptrs, ce_scalars, dict(MEAN=True, WRITE_GRAD=write_grad, SOFTCAP=cap, **loss._ce_blocks(131072))
    ce_bwd_ptrs = dict(logits_ptr="*bf16", labels_ptr="*i64", lse_ptr="*fp32", grad_loss_ptr="*fp32", grad_ptr="*bf16", n_valid_ptr="*i64")
    for name, cap in (("ce_bwd", False), ("ce_bwd softcap", True)):
        yield name, loss._ce_bwd_kernel, ce_bwd_ptrs, ce_scalars, dict(MEAN=True, SOFTCAP=cap, **loss._ce_blocks(131072))
    # the gated delta rule's states over chunks of 64 at Qwen3-Next's heads, Dk = Dv = 128 (float32 terms), and
    # gated linear attention's (no rule: no W_k)
    states_scalars = dict(M="i32", C="i32", K="i32", V="i32")
    for suffix, rule in (("", True), (" no rule", False)):
        meta = dict(delta._blocks(64, 128, 128), RULE=rule)
        yield "delta_states_fwd" + suffix, delta._delta_states_fwd_kernel, dict(wv_ptr="*fp32", wk_ptr="*fp32", kout_ptr="*fp32", keep_ptr="*fp32",
                                                                              s0_ptr="*fp32", states_ptr="*fp32"), states_scalars, meta
        yield "delta_states_bwd" + suffix, delta._delta_states_bwd_kernel, dict(wk_ptr="*fp32", kout_ptr="*fp32", keep_ptr="*fp32", dstates_ptr="*fp32",
                                                                              g_ptr="*fp32", du_ptr="*fp32"), states_scalars, meta
    # Mamba-1's selective scan at Jamba's mixer (8192 channels, a state of 16): the forward, and the backward that recomputes
    # each checkpoint's chunk (fmoe.ops.selective_scan)
    scan_meta = dict(K=scan.CHECKPOINT, BC=scan.BLOCK_C, BN=16, num_warps=4)
    scan_scalars = dict(T="i32", C="i32", N="i32", M="i32")
    yield "selective_scan_fwd", scan._scan_fwd_kernel, dict(u_ptr="*fp32", dt_ptr="*fp32", a_ptr="*fp32", b_ptr="*fp32", c_ptr="*fp32",
                                                            start_ptr="*fp32", h0_ptr="*fp32", y_ptr="*fp32", hT_ptr="*fp32", ckpt_ptr="*fp32"), \
        scan_scalars, scan_meta
    yield "selective_scan_bwd", scan._scan_bwd_kernel, dict(u_ptr="*fp32", dt_ptr="*fp32", a_ptr="*fp32", b_ptr="*fp32", c_ptr="*fp32",
                                                            start_ptr="*fp32", ckpt_ptr="*fp32", dy_ptr="*fp32", dhT_ptr="*fp32",
                                                            du_ptr="*fp32", ddt_ptr="*fp32", db_ptr="*fp32", dc_ptr="*fp32", da_ptr="*fp32",
                                                            dh0_ptr="*fp32"), dict(scan_scalars, n_blocks="i32"), scan_meta
    # DeepSeek sparse attention at one tp rank of DeepSeek-V3.2 (16 heads, rows of 512 latent + 64 rotated channels,
    # bf16): the forward, dq, and the keys' gradients (fmoe.ops.sparse_attention)
    meta = sparse._blocks(16, 576, 512)
    attn_scalars = dict(N="i32", J="i32", S="i32", scale="fp32", stride_qt="i32", stride_qn="i32", stride_kv="i32", stride_it="i32")
    yield "sparse_attention_fwd", sparse._sparse_attention_fwd_kernel, dict(q_ptr="*bf16", kv_ptr="*bf16", index_ptr="*i64", o_ptr="*bf16",
                                                                         lse_ptr="*fp32"), dict(attn_scalars, stride_ot="i32", stride_on="i32"), meta
    yield "sparse_attention_dq", sparse._sparse_attention_dq_kernel, dict(q_ptr="*bf16", kv_ptr="*bf16", index_ptr="*i64", do_ptr="*bf16",
                                                                       lse_ptr="*fp32", delta_ptr="*fp32", dq_ptr="*bf16"), dict(
        attn_scalars, stride_dot="i32", stride_don="i32"), meta
    yield "sparse_attention_probs", sparse._sparse_attention_probs_kernel, dict(q_ptr="*bf16", kv_ptr="*bf16", index_ptr="*i64", lse_ptr="*fp32",
                                                                             p_ptr="*fp32"), attn_scalars, meta
    yield "sparse_attention_dkv_atomic", sparse._sparse_attention_dkv_atomic_kernel, dict(
        q_ptr="*bf16", kv_ptr="*bf16", index_ptr="*i64", do_ptr="*bf16", lse_ptr="*fp32", delta_ptr="*fp32", dkv_ptr="*fp32"), dict(
        attn_scalars, stride_dot="i32", stride_don="i32", stride_dkv="i32"), sparse._dkv_atomic_blocks(16, 576, 512)
    # DeepSeek-V4's layers on the same kernels (fmoe.layers.attention: one kv head that is its values, 512 channels, no
    # channels beyond the value's) at one tp rank of 4 of V4-Flash's 64 heads
    v4_meta = sparse._blocks(16, 512, 512)
    yield "sparse_attention_fwd v4", sparse._sparse_attention_fwd_kernel, dict(q_ptr="*bf16", kv_ptr="*bf16", index_ptr="*i64", o_ptr="*bf16",
                                                                            lse_ptr="*fp32"), dict(attn_scalars, stride_ot="i32", stride_on="i32"), v4_meta
    yield "sparse_attention_dq v4", sparse._sparse_attention_dq_kernel, dict(q_ptr="*bf16", kv_ptr="*bf16", index_ptr="*i64", do_ptr="*bf16",
                                                                          lse_ptr="*fp32", delta_ptr="*fp32", dq_ptr="*bf16"), dict(
        attn_scalars, stride_dot="i32", stride_don="i32"), v4_meta
    yield "sparse_attention_probs v4", sparse._sparse_attention_probs_kernel, dict(q_ptr="*bf16", kv_ptr="*bf16", index_ptr="*i64",
                                                                                lse_ptr="*fp32", p_ptr="*fp32"), attn_scalars, v4_meta
    yield "sparse_attention_dkv_atomic v4", sparse._sparse_attention_dkv_atomic_kernel, dict(
        q_ptr="*bf16", kv_ptr="*bf16", index_ptr="*i64", do_ptr="*bf16", lse_ptr="*fp32", delta_ptr="*fp32", dkv_ptr="*fp32"), dict(
        attn_scalars, stride_dot="i32", stride_don="i32", stride_dkv="i32"), sparse._dkv_atomic_blocks(16, 512, 512)
    # its lightning indexer's scores (fmoe.ops.indexer_scores): 64 heads of 128 channels, bf16 and float32 (the layers' own)
    for ty, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        yield f"indexer_scores {ty}", sparse._indexer_scores_kernel, dict(q_ptr=f"*{ty}", w_ptr="*fp32", k_ptr=f"*{ty}", out_ptr="*fp32"), dict(
            T="i32", S="i32", N="i32", scale="fp32", stride_qt="i32", stride_qn="i32", stride_wt="i32", stride_ks="i32", stride_ot="i32"), dict(
            D=128, **sparse._indexer_blocks(128, dtype))
    dkv_meta = {k: v for k, v in meta.items() if k in ("DV", "DR", "BLOCK_DV", "BLOCK_DR", "num_warps")} | sparse._dkv_blocks()
    yield "sparse_attention_dkv", sparse._sparse_attention_dkv_kernel, dict(q_ptr="*bf16", kv_ptr="*bf16", do_ptr="*bf16", lse_ptr="*fp32",
                                                                         delta_ptr="*fp32", slots_ptr="*i64", offsets_ptr="*i64", dkv_ptr="*bf16"), dict(
        N="i32", J="i32", scale="fp32", stride_qt="i32", stride_qn="i32", stride_kv="i32", stride_dot="i32", stride_don="i32"), dkv_meta
    # AdamW step (fmoe.optim.adamw), one program per CHUNK elements of a tensor; "factor": the
    # clip's factor taken into the step (the train loop's)
    adamw_ptrs = dict(table_ptr="*i64", chunk_tensor_ptr="*i64", factor_ptr="*fp32")
    adamw_scalars = dict(n_tensors="i32", decay="fp32", beta1="fp32", beta2="fp32", eps="fp32", step_size="fp32", bc2_sqrt="fp32",
                         salt_m="i32", salt_v="i32")
    for name, param_ty, state_ty, master, factor in (
        ("adamw fp32", tl.float32, tl.float32, False, False), ("adamw bf16 states", tl.float32, tl.bfloat16, False, False),
        ("adamw bf16 factor", tl.float32, tl.bfloat16, False, True), ("adamw master", tl.bfloat16, tl.bfloat16, True, False),
    ):
        for aligned in (True, False):
            yield f"{name}{'' if aligned else ' unaligned'}", adamw._adamw_kernel, adamw_ptrs, adamw_scalars, dict(
                PARAM_TY=param_ty, GRAD_TY=param_ty, STATE_TY=state_ty, STOCHASTIC=state_ty == tl.bfloat16, MASTER=master, FACTOR=factor,
                ALIGNED=aligned,
                CHUNK=adamw.CHUNK, **adamw._META)
    # the clip's scale of bf16 gradients by a float32 factor (fmoe.optim.adamw.scale_)
    scale_ptrs = dict(table_ptr="*i64", chunk_tensor_ptr="*i64", factor_ptr="*fp32")
    for aligned in (True, False):
        yield f"scale bf16{'' if aligned else ' unaligned'}", adamw._scale_kernel, scale_ptrs, dict(n_tensors="i32"), dict(
            TY=tl.bfloat16, ALIGNED=aligned, ROUND_FACTOR=True, CHUNK=adamw.CHUNK, **adamw._META)
    # fp8 quantization (fmoe.ops.fp8): bf16 rows along memory (activations; K = 2048) and
    # across it (a weight's columns); a stride of 1 is a constant, as Triton specialises it
    quant_ptrs = dict(t_ptr="*bf16", out_ptr="*u8", scale_ptr="*fp32")
    strides = ("stride_tb", "stride_tr", "stride_tk", "stride_ob", "stride_or", "stride_ok")
    for name, ones, blocks in (("fp8 quantize rows", ("stride_tk", "stride_ok"), dict(BLOCK_R=4, BLOCK_K=1024)),
                               ("fp8 quantize columns", ("stride_tr", "stride_ok"), dict(BLOCK_R=64, BLOCK_K=64))):
        quant_scalars = dict(R="i32", K="i32", **{n: "i32" for n in strides if n not in ones})
        yield name, fp8._quantize_kernel, quant_ptrs, quant_scalars, dict(num_warps=4, **{n: 1 for n in ones}, **blocks)


def main(argv=None):
    argparse.ArgumentParser(description=" ".join(__doc__.strip().split("\n\n")[0].split()), epilog="It takes no options: every kernel at the benchmark shapes.").parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("kernel_stats compiles kernels: unset TRITON_INTERPRET")
    # warp-instr/row: SASS executed per row by the warps of a program; for kernels that
    # loop over H (permute, unpermute) it counts one iteration of the loop
    print(f"{'kernel':<28}{'warps':>6}{'rows/prog':>10}{'regs':>6}{'spill B':>9}{'SASS':>7}{'SHFL':>6}{'LDS':>5}{'warp-instr/row':>16}")
    for name, kernel, ptrs, scalars, meta in cases():
        const = dict(meta)
        warps = const.pop("num_warps")
        s = compile_stats(kernel, ptrs, scalars, const, num_warps=warps)
        rows = next((const[b] for b in ("BLOCK_T", "BLOCK_R", "BLOCK_S") if b in const), None)  # rows (slots) per program
        per_row = f"{s['sass'] * warps / rows:.0f}" if rows else "-"
        print(f"{name.replace(' ', '_'):<28}{warps:>6}{rows or '-':>10}{s['regs']:>6}{s['spill']:>9}{s['sass']:>7}{s['shfl']:>6}{s['lds']:>5}{per_row:>16}")


if __name__ == "__main__":
    main()
