"""Sparse attention: each query attends to its own list of keys, one key and value row
shared by every head (the multi-query form). It is the attention of DeepSeek sparse
attention (DSA: DeepSeek-V3.2, GLM-5) in multi-latent attention's absorbed form, where kv is
each token's [latent, rotated key] and the latent is also the value.

    sparse_attention(q [T, N, D], kv [S, D], index [T, J] int, *, v_dim=None, scale=None,
                     check=True, impl="auto") -> (o [T, N, Dv], lse [T, N] float32)
    sparse_attention_probs(q, kv, index, lse, *, v_dim=None, scale=None, check=True, impl="auto")
        -> p [T, J] float32: each slot's probability summed over the heads (no gradient)
    indexer_scores(q [T, N, D], w [T, N], k [S, D], *, scale=None, impl="auto")
        -> [T, S] float32: the lightning indexer's scores (no gradient)

For query t and head n, over the J slots of index[t] that hold a key (index[t, j] in
0 .. S-1; -1 marks an empty slot, as does any other value that check=False lets through):

    s_tnj  = scale q_tn . kv_{index[t, j]}                    (all D channels: the key)
    lse_tn = log sum_j exp(s_tnj)                             (-inf when no slot holds a key)
    o_tn   = sum_j exp(s_tnj - lse_tn) kv_{index[t, j], :Dv}  (the first Dv channels: the value;
                                                              0 when no slot holds a key)

In DSA, q_tn = [q_nope W_uk^n, q_rope] (absorbed per head), kv = [latent, k_rope], Dv =
kv_rank, and head n's output is o_tn W_uv^n (fmoe.layers.attention). A key written twice in
a row counts twice. o is returned in q's dtype, lse in float32; both are differentiable:
with p = exp(s - lse) and ds_tnj = p_tnj (do_tn . v_j - do_tn . o_tn + dlse_tn),

    dq_tn = scale sum_j ds_tnj kv_{index[t, j]}
    dkv_s = sum over the slots (t, j) holding s of sum_n (scale ds_tnj q_tn + p_tnj [do_tn, 0])

The kernels' work is O(T J N D) and their memory O(T N D + S D + T J): no [T, S] matrix
and no [T, J, D] gather is formed.

`_sparse_attention_ref` gathers every slot's row ([T, J, D]) and is the definition of
correctness (torch autograd). The kernels: the forward, one program per query and block of
heads, runs an online softmax over blocks of slots, each block's rows gathered by index,
every product split into the value channels and the rest (each a power-of-two block: 512 +
64 for DeepSeek's 576, no padding to 1024), multiplied in the inputs' dtype with float32
sums (bf16 on tensor cores; float32 exactly, not TF32). The backward's dq kernel has the
same grid and recomputes the probabilities from lse. dkv has two kernels:
- by default, the same grid again: each block of slots' key gradients summed over the block
  of heads by tensor-core products ([BJ, BN] x [BN, D]), then added to a float32 dkv by
  atomics (their order, so dkv's last bits, may differ from run to run);
- under torch.use_deterministic_algorithms(True) (fmoe.train.set_deterministic), one
  program per key over the (slot, head) rows that chose it, from the slots sorted by key (a
  CSR built by torch on the device): the same bits on every run, but each (slot, head) reads
  its query's row again, N times the atomic kernel's reads (8x slower on an H100 at
  DeepSeek-V3.2's shapes: benchmarks/RESULTS.md).
The probabilities' kernel (sparse_attention_probs) recomputes them from lse, one program per
query.

DSA chooses each query's keys by its lightning indexer: with N indexer heads of D channels,
one key row k_s per token, and per-query head weights w,

    scores_ts = sum_n w_tn relu(scale q_tn . k_s)

and the top J of each row (fmoe.layers.index_slots). indexer_scores computes them without the
[T, N, S] products that torch's einsums form (64 times the scores' size at DeepSeek-V3.2's 64
heads): its kernel runs one program per block of queries and keys, the heads in a loop, the
products on tensor cores in the inputs' dtype (float32: exact IEEE products, not TF32, and
slower than torch's on an H100, so impl="auto" takes the kernel for 16-bit inputs alone).

Legend: T queries, N heads, D key dim, Dv value dim (the first Dv channels of kv), Dr = D -
Dv the rest, S keys, J slots per query.
"""

from __future__ import annotations

from typing import Optional

import torch

import triton
import triton.language as tl

from fmoe.ops.backend import autocast_off, ieee_dot, next_pow2, use_triton
from fmoe.ops.checks import check_bools, check_device, check_float, check_index, checking

# ----------------------------------------------------------------------------------------
# 1. Reference
# ----------------------------------------------------------------------------------------


def _holds_key(index: torch.Tensor, S: int) -> torch.Tensor:
    """[T, J] bool: the slots that hold a key, index in 0 .. S-1 (any other value: empty)."""
    return (index >= 0) & (index < S)


def _slot_rows(kv: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[T, J, D] float32: each slot's row of kv, zeros in an empty slot. The empty slots read
    a row of zeros appended to kv, so that there is a row to read when kv has none (S = 0)."""
    S, D = kv.shape
    kv_pad = torch.cat([kv.float(), kv.new_zeros((1, D), dtype=torch.float32)])
    return kv_pad[torch.where(_holds_key(index, S), index.long(), S)]


@autocast_off
def _sparse_attention_ref(q: torch.Tensor, kv: torch.Tensor, index: torch.Tensor, v_dim: int, scale: float):
    """(o [T, N, Dv] in q's dtype, lse [T, N] float32): every slot's row gathered, float32."""
    valid_TJ = _holds_key(index, kv.shape[0])
    rows_TJD = _slot_rows(kv, index)
    s_TNJ = torch.einsum("tnd,tjd->tnj", q.float(), rows_TJD) * scale
    s_TNJ = s_TNJ.masked_fill(~valid_TJ[:, None, :], float("-inf"))
    if index.shape[1]:
        m_TN1 = s_TNJ.amax(-1, keepdim=True).detach()
    else:  # no slots at all (J = 0): amax has nothing to reduce; every row is one without keys
        m_TN1 = s_TNJ.new_zeros(s_TNJ.shape[:2] + (1,))
    m_TN1 = torch.where(torch.isfinite(m_TN1), m_TN1, torch.zeros_like(m_TN1))  # a row without keys
    e_TNJ = torch.exp(s_TNJ - m_TN1)  # 0 in the empty slots
    z_TN1 = e_TNJ.sum(-1, keepdim=True)
    has_TN1 = z_TN1 > 0
    p_TNJ = e_TNJ / torch.where(has_TN1, z_TN1, torch.ones_like(z_TN1))
    o_TNV = torch.einsum("tnj,tjv->tnv", p_TNJ, rows_TJD[..., :v_dim])
    lse_TN1 = torch.where(has_TN1, m_TN1 + torch.log(torch.where(has_TN1, z_TN1, torch.ones_like(z_TN1))), float("-inf"))
    return o_TNV.to(q.dtype), lse_TN1[..., 0]


@autocast_off
def _sparse_attention_probs_ref(q, kv, index, lse, scale: float) -> torch.Tensor:
    """[T, J] float32: each slot's probability summed over the heads (0 in an empty slot)."""
    s_TNJ = torch.einsum("tnd,tjd->tnj", q.float(), _slot_rows(kv, index)) * scale
    lse_TN1 = torch.where(torch.isfinite(lse), lse, 0.0)[..., None]
    return torch.where(_holds_key(index, kv.shape[0])[:, None, :], torch.exp(s_TNJ - lse_TN1), 0.0).sum(1)


_INDEXER_GROUP_FLOATS = 1 << 22  # the indexer reference's products at a time: 16 MiB of float32


@autocast_off
def _indexer_scores_ref(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """[T, S] float32: sum_n w[t, n] relu(scale q[t, n] . k[s]), through the [T, g, S]
    products of g heads at a time, g T S within _INDEXER_GROUP_FLOATS (16 MiB; one head at
    least), not the [T, N, S] of every head at once (1 GiB twice at T = S = 2048, N = 64)."""
    q, k, w = q.float(), k.float(), w.float()
    (T, N), S = w.shape, k.shape[0]
    g = max(1, min(N, _INDEXER_GROUP_FLOATS // max(1, T * S)))
    out_TS = q.new_zeros(T, S) if N == 0 else None  # no head: a sum of nothing (it returned None)
    for n in range(0, N, g):
        relu_TgS = torch.relu(torch.einsum("tnd,sd->tns", q[:, n:n + g], k) * scale)
        part_TS = torch.einsum("tn,tns->ts", w[:, n:n + g], relu_TgS)
        out_TS = part_TS if out_TS is None else out_TS + part_TS
    return out_TS


# ----------------------------------------------------------------------------------------
# 2. Triton kernels
# ----------------------------------------------------------------------------------------


@triton.jit
def _rows(ptr, idx, valid, offs, lo, width, stride):
    """[BJ, BD] in the tensor's dtype: columns lo + offs (< width) of the rows idx (zeros where not valid)."""
    safe = tl.where(valid, idx, 0).to(tl.int64)
    mask = valid[:, None] & (offs[None, :] < width)
    return tl.load(ptr + safe[:, None] * stride + lo + offs[None, :], mask=mask, other=0.0)


@triton.jit
def _heads(ptr, t, offs_n, N, offs, lo, width, stride_t, stride_n):
    """[BN, BD] in the tensor's dtype: channels lo + offs (< width) of query t's heads offs_n (< N)."""
    mask = (offs_n[:, None] < N) & (offs[None, :] < width)
    return tl.load(ptr + t * stride_t + offs_n[:, None] * stride_n + lo + offs[None, :], mask=mask, other=0.0)


@triton.jit
def _slot_block(q_v, q_r, kv_ptr, index_ptr, t, j0, J, S, stride_it, stride_kv, DV: tl.constexpr, DR: tl.constexpr,
                BLOCK_J: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr):
    """Query t's slots j0 .. j0 + BLOCK_J: which hold a key [BJ] (index in 0 .. S-1: no row
    outside kv is read), their rows' value channels [BJ, BDV] and the rest [BJ, BDR], and the
    heads' scores q . k [BN, BJ] (float32, unscaled)."""
    offs_j = j0 + tl.arange(0, BLOCK_J)
    offs_v, offs_r = tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_DR)
    idx = tl.load(index_ptr + t * stride_it + offs_j, mask=offs_j < J, other=-1).to(tl.int64)
    valid = (idx >= 0) & (idx < S)
    k_v = _rows(kv_ptr, idx, valid, offs_v, 0, DV, stride_kv)
    s = ieee_dot(q_v, tl.trans(k_v))
    if DR > 0:  # rows of the value channels alone (DeepSeek-V4's: the keys are the values) read and multiply nothing more
        k_r = _rows(kv_ptr, idx, valid, offs_r, DV, DR, stride_kv)
        s += ieee_dot(q_r, tl.trans(k_r))
    else:
        k_r = k_v
    return valid, k_v, k_r, s


@triton.jit
def _sparse_attention_fwd_kernel(q_ptr, kv_ptr, index_ptr, o_ptr, lse_ptr, N, J, S, scale,
                                 stride_qt, stride_qn, stride_kv, stride_it, stride_ot, stride_on,
                                 DV: tl.constexpr, DR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr,
                                 BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v, offs_r = tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_DR)
    q_v = _heads(q_ptr, t, offs_n, N, offs_v, 0, DV, stride_qt, stride_qn)
    q_r = _heads(q_ptr, t, offs_n, N, offs_r, DV, DR, stride_qt, stride_qn)
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_N,), tl.float32)
    acc = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
    for j0 in range(0, J, BLOCK_J):
        valid, k_v, k_r, s = _slot_block(q_v, q_r, kv_ptr, index_ptr, t, j0, J, S, stride_it, stride_kv, DV, DR, BLOCK_J, BLOCK_DV, BLOCK_DR)
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + ieee_dot(p.to(k_v.dtype), k_v)
        m = m_new
    has = l > 0
    o = acc / tl.where(has, l, 1.0)[:, None]
    lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
    mask_n = offs_n < N
    tl.store(o_ptr + t * stride_ot + offs_n[:, None] * stride_on + offs_v[None, :], o.to(o_ptr.dtype.element_ty),
             mask=mask_n[:, None] & (offs_v[None, :] < DV))
    tl.store(lse_ptr + t * N + offs_n, lse, mask=mask_n)


@triton.jit
def _backward_program(q_ptr, do_ptr, lse_ptr, delta_ptr, N, stride_qt, stride_qn, stride_dot, stride_don,
                      DV: tl.constexpr, DR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr):
    """A backward program's query t and block of heads offs_n (mask_n: < N), its channel
    offsets, and what it reads of them: q's value channels and the rest, do, lse (0 for a
    row without keys: every p is 0 then) and delta."""
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_v, offs_r = tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_DR)
    q_v = _heads(q_ptr, t, offs_n, N, offs_v, 0, DV, stride_qt, stride_qn)
    q_r = _heads(q_ptr, t, offs_n, N, offs_r, DV, DR, stride_qt, stride_qn)
    do = _heads(do_ptr, t, offs_n, N, offs_v, 0, DV, stride_dot, stride_don)
    lse = tl.load(lse_ptr + t * N + offs_n, mask=mask_n, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    delta = tl.load(delta_ptr + t * N + offs_n, mask=mask_n, other=0.0)
    return t, offs_n, mask_n, offs_v, offs_r, q_v, q_r, do, lse, delta


@triton.jit
def _sparse_attention_dq_kernel(q_ptr, kv_ptr, index_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, N, J, S, scale,
                                stride_qt, stride_qn, stride_kv, stride_it, stride_dot, stride_don,
                                DV: tl.constexpr, DR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr,
                                BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr):
    t, offs_n, mask_n, offs_v, offs_r, q_v, q_r, do, lse, delta = _backward_program(
        q_ptr, do_ptr, lse_ptr, delta_ptr, N, stride_qt, stride_qn, stride_dot, stride_don, DV, DR, BLOCK_N, BLOCK_DV, BLOCK_DR)
    dq_v = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
    dq_r = tl.zeros((BLOCK_N, BLOCK_DR), tl.float32)
    for j0 in range(0, J, BLOCK_J):
        valid, k_v, k_r, s = _slot_block(q_v, q_r, kv_ptr, index_ptr, t, j0, J, S, stride_it, stride_kv, DV, DR, BLOCK_J, BLOCK_DV, BLOCK_DR)
        p = tl.where(valid[None, :], tl.exp(s * scale - lse[:, None]), 0.0)
        dp = ieee_dot(do, tl.trans(k_v))
        ds = p * (dp - delta[:, None])
        dq_v += ieee_dot(ds.to(k_v.dtype), k_v)
        if DR > 0:
            dq_r += ieee_dot(ds.to(k_r.dtype), k_r)
    base = dq_ptr + t * stride_qt + offs_n[:, None] * stride_qn
    tl.store(base + offs_v[None, :], (dq_v * scale).to(dq_ptr.dtype.element_ty), mask=mask_n[:, None] & (offs_v[None, :] < DV))
    if DR > 0:
        tl.store(base + DV + offs_r[None, :], (dq_r * scale).to(dq_ptr.dtype.element_ty), mask=mask_n[:, None] & (offs_r[None, :] < DR))


@triton.jit
def _sparse_attention_dkv_atomic_kernel(q_ptr, kv_ptr, index_ptr, do_ptr, lse_ptr, delta_ptr, dkv_ptr, N, J, S, scale,
                                        stride_qt, stride_qn, stride_kv, stride_it, stride_dot, stride_don, stride_dkv,
                                        DV: tl.constexpr, DR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr,
                                        BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr):
    """Query t and a block of heads: each slot block's key gradients, summed over the heads
    by tensor-core products ([BJ, BN] x [BN, D]), added to dkv (float32) by atomics (the rows
    of the slots holding a key alone: nothing is added outside dkv)."""
    t, offs_n, mask_n, offs_v, offs_r, q_v, q_r, do, lse, delta = _backward_program(
        q_ptr, do_ptr, lse_ptr, delta_ptr, N, stride_qt, stride_qn, stride_dot, stride_don, DV, DR, BLOCK_N, BLOCK_DV, BLOCK_DR)
    for j0 in range(0, J, BLOCK_J):
        valid, k_v, k_r, s = _slot_block(q_v, q_r, kv_ptr, index_ptr, t, j0, J, S, stride_it, stride_kv, DV, DR, BLOCK_J, BLOCK_DV, BLOCK_DR)
        p = tl.where(valid[None, :] & mask_n[:, None], tl.exp(s * scale - lse[:, None]), 0.0)
        ds = p * (ieee_dot(do, tl.trans(k_v)) - delta[:, None]) * scale
        ds_t = tl.trans(ds).to(q_v.dtype)
        dk_v = ieee_dot(ds_t, q_v) + ieee_dot(tl.trans(p).to(do.dtype), do)
        idx = tl.load(index_ptr + t * stride_it + j0 + tl.arange(0, BLOCK_J), mask=j0 + tl.arange(0, BLOCK_J) < J, other=-1).to(tl.int64)
        row = dkv_ptr + tl.where(valid, idx, 0)[:, None] * stride_dkv
        tl.atomic_add(row + offs_v[None, :], dk_v, mask=valid[:, None] & (offs_v[None, :] < DV), sem="relaxed")
        if DR > 0:
            dk_r = ieee_dot(ds_t, q_r)
            tl.atomic_add(row + DV + offs_r[None, :], dk_r, mask=valid[:, None] & (offs_r[None, :] < DR), sem="relaxed")


@triton.jit
def _sparse_attention_dkv_kernel(q_ptr, kv_ptr, do_ptr, lse_ptr, delta_ptr, slots_ptr, offsets_ptr, dkv_ptr, N, J, scale,
                                 stride_qt, stride_qn, stride_kv, stride_dot, stride_don,
                                 DV: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr,
                                 BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr):
    """Key s: the rows (slot, head) of the slots holding s, BLOCK_R at a time."""
    s = tl.program_id(0).to(tl.int64)
    offs_v, offs_r = tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_DR)
    k_v = tl.load(kv_ptr + s * stride_kv + offs_v, mask=offs_v < DV, other=0.0).to(tl.float32)  # float32 sums here: no tl.dot
    k_r = tl.load(kv_ptr + s * stride_kv + DV + offs_r, mask=offs_r < DR, other=0.0).to(tl.float32)
    start = tl.load(offsets_ptr + s).to(tl.int64) * N
    end = tl.load(offsets_ptr + s + 1).to(tl.int64) * N
    acc_v = tl.zeros((BLOCK_DV,), tl.float32)
    acc_r = tl.zeros((BLOCK_DR,), tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        live = rows < end
        slot = tl.load(slots_ptr + rows // N, mask=live, other=0).to(tl.int64)
        t, n = slot // J, rows % N
        mv = live[:, None] & (offs_v[None, :] < DV)
        mr = live[:, None] & (offs_r[None, :] < DR)
        q_row = q_ptr + t[:, None] * stride_qt + n[:, None] * stride_qn
        q_v = tl.load(q_row + offs_v[None, :], mask=mv, other=0.0).to(tl.float32)
        q_r = tl.load(q_row + DV + offs_r[None, :], mask=mr, other=0.0).to(tl.float32)
        do = tl.load(do_ptr + t[:, None] * stride_dot + n[:, None] * stride_don + offs_v[None, :], mask=mv, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + t * N + n, mask=live, other=0.0)
        delta = tl.load(delta_ptr + t * N + n, mask=live, other=0.0)
        score = (tl.sum(q_v * k_v[None, :], 1) + tl.sum(q_r * k_r[None, :], 1)) * scale
        p = tl.where(live, tl.exp(score - lse), 0.0)
        ds = p * (tl.sum(do * k_v[None, :], 1) - delta)
        acc_v += tl.sum(scale * ds[:, None] * q_v + p[:, None] * do, 0)
        acc_r += tl.sum(scale * ds[:, None] * q_r, 0)
    tl.store(dkv_ptr + s * stride_kv + offs_v, acc_v.to(dkv_ptr.dtype.element_ty), mask=offs_v < DV)
    tl.store(dkv_ptr + s * stride_kv + DV + offs_r, acc_r.to(dkv_ptr.dtype.element_ty), mask=offs_r < DR)


@triton.jit
def _sparse_attention_probs_kernel(q_ptr, kv_ptr, index_ptr, lse_ptr, p_ptr, N, J, S, scale, stride_qt, stride_qn, stride_kv, stride_it,
                                   DV: tl.constexpr, DR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr,
                                   BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr):
    """Query t: each slot's probability summed over the heads, p [T, J] float32."""
    t = tl.program_id(0).to(tl.int64)
    offs_v, offs_r = tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_DR)
    for j0 in range(0, J, BLOCK_J):
        total = tl.zeros((BLOCK_J,), tl.float32)
        for n0 in range(0, N, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < N
            q_v = _heads(q_ptr, t, offs_n, N, offs_v, 0, DV, stride_qt, stride_qn)
            q_r = _heads(q_ptr, t, offs_n, N, offs_r, DV, DR, stride_qt, stride_qn)
            lse = tl.load(lse_ptr + t * N + offs_n, mask=mask_n, other=0.0)
            lse = tl.where(lse == float("-inf"), 0.0, lse)
            valid, k_v, k_r, s = _slot_block(q_v, q_r, kv_ptr, index_ptr, t, j0, J, S, stride_it, stride_kv, DV, DR, BLOCK_J, BLOCK_DV, BLOCK_DR)
            total += tl.sum(tl.where(valid[None, :] & mask_n[:, None], tl.exp(s * scale - lse[:, None]), 0.0), 0)
        offs_j = j0 + tl.arange(0, BLOCK_J)
        tl.store(p_ptr + t * J + offs_j, total, mask=offs_j < J)


@triton.jit
def _indexer_scores_kernel(q_ptr, w_ptr, k_ptr, out_ptr, T, S, N, scale, stride_qt, stride_qn, stride_wt, stride_ks, stride_ot,
                           D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """A block of queries and of keys: their scores [BT, BS] summed over the N heads."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_t, mask_s, mask_d = offs_t < T, offs_s < S, offs_d < D
    k = tl.load(k_ptr + offs_s.to(tl.int64)[:, None] * stride_ks + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    q_rows = q_ptr + offs_t.to(tl.int64)[:, None] * stride_qt + offs_d[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_S), tl.float32)
    for n in range(N):
        q = tl.load(q_rows + n * stride_qn, mask=mask_t[:, None] & mask_d[None, :], other=0.0)
        w = tl.load(w_ptr + offs_t.to(tl.int64) * stride_wt + n, mask=mask_t, other=0.0).to(tl.float32)
        prod = ieee_dot(q, tl.trans(k))
        acc += w[:, None] * tl.maximum(prod * scale, 0.0)
    tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * stride_ot + offs_s[None, :], acc, mask=mask_t[:, None] & mask_s[None, :])


def _indexer_blocks(D: int, dtype: torch.dtype) -> dict:
    """64 x 64 scores a program, the D channels in one power-of-two block (at least 16: tl.dot);
    8 warps for float32 inputs (4 spill at D = 128: the IEEE products' operands are 4 bytes)."""
    return dict(BLOCK_T=64, BLOCK_S=64, BLOCK_D=max(16, next_pow2(D)), num_warps=8 if dtype == torch.float32 else 4)


def _blocks(N: int, D: int, v_dim: int) -> dict:
    """Power-of-two blocks, at least 16 wide where tl.dot multiplies them, and the warps."""
    return dict(DV=v_dim, DR=D - v_dim, BLOCK_N=max(16, min(64, next_pow2(N))), BLOCK_J=16 if N > 16 else 32,
                BLOCK_DV=max(16, next_pow2(v_dim)), BLOCK_DR=max(16, next_pow2(D - v_dim)), num_warps=4)


def _dkv_atomic_blocks(N: int, D: int, v_dim: int) -> dict:
    """The atomic dkv kernel's: 16 slots a step and 4 warps (178 registers at DeepSeek's 576
    channels, no spills; 32 slots and 4 warps spill). The fastest of an H100 sweep at
    DeepSeek-V3.2's shapes: backward 12.8 ms, against 18.1 with 8 warps and 14.1 with 32
    slots and 8 warps (benchmarks/RESULTS.md)."""
    return _blocks(N, D, v_dim) | dict(BLOCK_J=16, num_warps=4)


def _dkv_blocks() -> dict:
    """The dkv kernel's rows per step (a slot's head each)."""
    return dict(BLOCK_R=8)


# ----------------------------------------------------------------------------------------
# 3. torch.library registration
# ----------------------------------------------------------------------------------------


@torch.library.custom_op("fmoe::sparse_attention_fwd", mutates_args=())
def _sparse_attention_fwd(q: torch.Tensor, kv: torch.Tensor, index: torch.Tensor, v_dim: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    T, N, D = q.shape
    o = q.new_empty((T, N, v_dim))
    lse = q.new_empty((T, N), dtype=torch.float32)
    meta = _blocks(N, D, v_dim)
    _sparse_attention_fwd_kernel[(T, triton.cdiv(N, meta["BLOCK_N"]))](
        q, kv, index, o, lse, N, index.shape[1], kv.shape[0], scale, q.stride(0), q.stride(1), kv.stride(0), index.stride(0),
        o.stride(0), o.stride(1), **meta)
    return o, lse


@_sparse_attention_fwd.register_fake
def _(q, kv, index, v_dim, scale):
    T, N, _ = q.shape
    return q.new_empty((T, N, v_dim)), q.new_empty((T, N), dtype=torch.float32)


@torch.library.custom_op("fmoe::sparse_attention_bwd", mutates_args=())
def _sparse_attention_bwd(q: torch.Tensor, kv: torch.Tensor, index: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
                          grad_o: torch.Tensor, v_dim: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq [T, N, D], dkv [S, D]); delta [T, N] = do . o - dlse, float32."""
    T, N, D = q.shape
    S, J = kv.shape[0], index.shape[1]
    meta = _blocks(N, D, v_dim)
    dq = torch.empty_like(q)
    _sparse_attention_dq_kernel[(T, triton.cdiv(N, meta["BLOCK_N"]))](
        q, kv, index, grad_o, lse, delta, dq, N, J, S, scale, q.stride(0), q.stride(1), kv.stride(0), index.stride(0),
        grad_o.stride(0), grad_o.stride(1), **meta)
    if not torch.are_deterministic_algorithms_enabled():
        dkv = torch.zeros(kv.shape, device=kv.device, dtype=torch.float32)
        _sparse_attention_dkv_atomic_kernel[(T, triton.cdiv(N, meta["BLOCK_N"]))](
            q, kv, index, grad_o, lse, delta, dkv, N, J, S, scale, q.stride(0), q.stride(1), kv.stride(0), index.stride(0),
            grad_o.stride(0), grad_o.stride(1), dkv.stride(0), **_dkv_atomic_blocks(N, D, v_dim))
        return dq, dkv.to(kv.dtype)
    # deterministic: the slots by key (empty ones last), key s's at slots[offsets[s]:offsets[s + 1]]
    key = index.reshape(-1).long()
    key = torch.where(_holds_key(key, S), key, S)
    slots = torch.argsort(key, stable=True)
    offsets = torch.searchsorted(key[slots], torch.arange(S + 1, device=key.device))
    dkv = torch.empty_like(kv)
    blocks = {k: v for k, v in meta.items() if k in ("DV", "DR", "BLOCK_DV", "BLOCK_DR", "num_warps")} | _dkv_blocks()
    _sparse_attention_dkv_kernel[(S,)](
        q, kv, grad_o, lse, delta, slots, offsets, dkv, N, J, scale, q.stride(0), q.stride(1), kv.stride(0),
        grad_o.stride(0), grad_o.stride(1), **blocks)
    return dq, dkv


@_sparse_attention_bwd.register_fake
def _(q, kv, index, lse, delta, grad_o, v_dim, scale):
    return torch.empty_like(q), torch.empty_like(kv)


@torch.library.custom_op("fmoe::sparse_attention_probs", mutates_args=())
def _sparse_attention_probs(q: torch.Tensor, kv: torch.Tensor, index: torch.Tensor, lse: torch.Tensor, v_dim: int, scale: float) -> torch.Tensor:
    T, N, D = q.shape
    J = index.shape[1]
    p = q.new_empty((T, J), dtype=torch.float32)
    meta = _blocks(N, D, v_dim)
    _sparse_attention_probs_kernel[(T,)](q, kv, index, lse, p, N, J, kv.shape[0], scale, q.stride(0), q.stride(1), kv.stride(0),
                                         index.stride(0), **meta)
    return p


@_sparse_attention_probs.register_fake
def _(q, kv, index, lse, v_dim, scale):
    return q.new_empty(index.shape, dtype=torch.float32)


@torch.library.custom_op("fmoe::indexer_scores", mutates_args=())
def _indexer_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    T, N, D = q.shape
    S = k.shape[0]
    out = q.new_empty((T, S), dtype=torch.float32)
    meta = _indexer_blocks(D, q.dtype)
    grid = (triton.cdiv(T, meta["BLOCK_T"]), triton.cdiv(S, meta["BLOCK_S"]))
    _indexer_scores_kernel[grid](q, w, k, out, T, S, N, scale, q.stride(0), q.stride(1), w.stride(0), k.stride(0), out.stride(0), D=D, **meta)
    return out


@_indexer_scores.register_fake
def _(q, w, k, scale):
    return q.new_empty((q.shape[0], k.shape[0]), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, kv, index, v_dim, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, kv, index, o, lse)
    ctx.v_dim, ctx.scale = v_dim, scale


def _backward(ctx, grad_o, grad_lse):
    q, kv, index, o, lse = ctx.saved_tensors
    if grad_o is None:
        grad_o = torch.zeros_like(o)
    delta = (grad_o.float() * o.float()).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse
    dq, dkv = _sparse_attention_bwd(q, kv, index, lse, delta, grad_o.contiguous(), ctx.v_dim, ctx.scale)
    return dq, dkv, None, None, None


_sparse_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------
# 4. Public function
# ----------------------------------------------------------------------------------------


def _check_inputs(q, kv, index) -> tuple[int, int, int]:
    """Shapes, dtypes and devices of q [T, N, D], kv [S, D] and index [T, J]; returns (T, N, D)."""
    check_float("q", q, 3, "[T, N, D]")
    check_float("kv", kv, 2, "[S, D]")
    check_index("index", index, 2, "[T, J]")
    T, N, D = q.shape
    if kv.shape[1] != D or kv.dtype != q.dtype or kv.device != q.device:
        raise ValueError(f"kv: expected [S, {D}] (q's D) in {q.dtype} on {q.device}, got {list(kv.shape)} {kv.dtype} {kv.device}")
    if index.shape[0] != T or index.device != q.device:
        raise ValueError(f"index: expected [{T}, J] (q's T) on {q.device}, got {list(index.shape)} on {index.device}")
    return T, N, D


def _check_keys(index: torch.Tensor, S: int, check: bool) -> None:
    """index's values in -1 .. S-1 (one device->host sync), where checking(check)."""
    check_bools(check=check)  # "no" ran the check
    if checking(check, index) and index.numel():
        lo, hi = int(index.min()), int(index.max())
        if lo < -1 or hi >= S:
            raise ValueError(f"index: expected keys in 0 .. S-1 = {S - 1} or -1 (an empty slot), got values in {lo} .. {hi} "
                             "(pass check=False to skip this check)")


def _check_dims(D: int, v_dim, scale) -> tuple[int, float]:
    """(v_dim, scale) with their defaults (D, 1 / sqrt(D)), checked."""
    v_dim = D if v_dim is None else v_dim
    if isinstance(v_dim, bool) or not isinstance(v_dim, int) or not 1 <= v_dim <= D:
        raise ValueError(f"v_dim: expected an int in 1 .. D = {D} (the value channels, the first of each kv row), got {v_dim!r}")
    scale = D**-0.5 if scale is None else scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        raise ValueError(f"scale: expected a positive number or None (1/sqrt(D)), got {scale!r}")
    return v_dim, float(scale)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, index: torch.Tensor, *, v_dim: Optional[int] = None, scale: Optional[float] = None,
                     check: bool = True, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's attention over the keys its index row names (module docstring).

    Args:
        q: [T, N, D] float queries, N heads sharing the keys.
        kv: [S, D] float, q's dtype and device: the rows; a row's D channels are the key,
            its first v_dim the value.
        index: [T, J] int32 or int64, q's device: the keys (rows of kv) of each query's J
            slots, -1 in an empty slot; values in -1 .. S-1 (read on the host with check=True).
        v_dim: Dv, the value channels (default D).
        scale: the scores' factor (default 1 / sqrt(D)).
        check: read index on the host to check its values (one sync; skipped under
            torch.compile); False skips it. An unchecked value outside -1 .. S-1 marks an
            empty slot, as -1 does, in every impl: no row outside kv is read or written.
        impl: "auto" (Triton on CUDA, the reference otherwise), "triton" or "torch".
    Returns:
        (o [T, N, Dv] in q's dtype, lse [T, N] float32), both differentiable; a query whose
        slots are all empty gets o = 0 and lse = -inf.
    """
    T, N, D = _check_inputs(q, kv, index)
    v_dim, scale = _check_dims(D, v_dim, scale)
    _check_keys(index, kv.shape[0], check)
    if T == 0 or index.shape[1] == 0 or kv.shape[0] == 0 or not use_triton(impl, q, kv, index):
        return _sparse_attention_ref(q, kv, index, v_dim, scale)
    return _sparse_attention_fwd(q.contiguous(), kv.contiguous(), index.contiguous(), v_dim, scale)


def sparse_attention_probs(q: torch.Tensor, kv: torch.Tensor, index: torch.Tensor, lse: torch.Tensor, *, v_dim: Optional[int] = None,
                           scale: Optional[float] = None, check: bool = True, impl: str = "auto") -> torch.Tensor:
    """The attention probability of each slot's key summed over the heads, [T, J] float32
    (0 in an empty slot; each row sums to N where the query has keys), from sparse_attention's
    q, kv, index and its lse [T, N]; no gradient (DeepSeek sparse attention's indexer loss
    takes it as its target: fmoe.layers.attention). scale: sparse_attention's (default
    1 / sqrt(D)); v_dim: only how the kernel splits each row's channels, as sparse_attention
    does (default D); check: sparse_attention's (index's values in -1 .. S-1, one sync; an
    unchecked value outside them is an empty slot, p = 0). The kernel recomputes the scores a
    query's slots at a time: no [T, N, J] tensor; impl as sparse_attention's (the reference
    gathers [T, J, D])."""
    T, N, D = _check_inputs(q, kv, index)
    if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 or tuple(lse.shape) != (T, N):
        raise ValueError(f"lse: expected sparse_attention's float32 [{T}, {N}], got {getattr(lse, 'dtype', type(lse).__name__)} "
                         f"{list(getattr(lse, 'shape', []))}")
    check_device("lse", lse, q.device, "q")
    v_dim, scale = _check_dims(D, v_dim, scale)
    _check_keys(index, kv.shape[0], check)
    with torch.no_grad():
        if T == 0 or index.shape[1] == 0 or kv.shape[0] == 0 or not use_triton(impl, q, kv, index):
            return _sparse_attention_probs_ref(q, kv, index, lse, scale)
        return _sparse_attention_probs(q.contiguous(), kv.contiguous(), index.contiguous(), lse.contiguous(), v_dim, scale)


def indexer_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, *, scale: Optional[float] = None, impl: str = "auto") -> torch.Tensor:
    """DeepSeek sparse attention's lightning-indexer scores (module docstring), [T, S] float32,
    no gradient (the top-k choice they feed is not differentiable):

        scores[t, s] = sum_n w[t, n] relu(scale q[t, n] . k[s])

    Args:
        q: [T, N, D] float: each query's N indexer heads.
        w: [T, N] float, q's device: each query's head weights.
        k: [S, D] float, q's dtype and device: the keys.
        scale: the products' factor inside the relu (default 1 / sqrt(D)).
        impl: "auto" (Triton on CUDA for 16-bit q, the reference otherwise), "triton" or
            "torch". The kernel multiplies in q's dtype with float32 sums (bf16 on tensor
            cores; float32 exactly, not TF32) and forms no [T, N, S] tensor; the reference
            does. On an H100 at DeepSeek-V3.2's indexer (64 heads of 128, 4096 queries and
            keys) the kernel takes 0.68 ms in bf16, 20x the reference's 13.6 ms, but 36 ms
            in float32, where cuBLAS's float32 products make the reference faster: so
            "auto" keeps float32 on the reference (benchmarks/bench_sparse_attention.py).
    """
    check_float("q", q, 3, "[T, N, D]")
    check_float("w", w, 2, "[T, N]")
    check_float("k", k, 2, "[S, D]")
    T, N, D = q.shape
    if tuple(w.shape) != (T, N) or w.device != q.device:
        raise ValueError(f"w: expected [{T}, {N}] (q's T and N) on {q.device}, got {list(w.shape)} on {w.device}")
    if k.shape[1] != D or k.dtype != q.dtype or k.device != q.device:
        raise ValueError(f"k: expected [S, {D}] (q's D) in {q.dtype} on {q.device}, got {list(k.shape)} {k.dtype} {k.device}")
    _, scale = _check_dims(D, None, scale)
    with torch.no_grad():
        if T == 0 or N == 0 or k.shape[0] == 0 or not use_triton(impl, q, w, k) or (impl == "auto" and q.dtype == torch.float32):
            return _indexer_scores_ref(q, w, k, scale)
        return _indexer_scores(q.contiguous(), w.contiguous(), k.contiguous(), scale)
