"""Cross-entropy, and cross-entropy fused with the LM head's projection (SPEC.md section 6).

    cross_entropy(logits[N,V], labels[N])                -> scalar float32
    linear_cross_entropy(h[N,H], weight[V,H], labels[N]) -> scalar float32, logits = h @ weight^T

With valid rows R = {n : labels[n] != ignore_index} and lse_n = logsumexp_v logits[n,v]:

    loss = sum_{n in R} (lse_n - logits[n, labels[n]])     reduction="sum"
         = that sum / |R|                                   reduction="mean" (the default)
    dloss/dlogits[n,v] = (softmax(logits[n])_v - [v == labels[n]]) / |R|   for n in R, else 0

all in float32 whatever the logits dtype. With a softcap c (Gemma 2's and Beam's
final_logit_softcapping) the logits are first capped, logits <- c tanh(logits / c), and the
gradient carries the cap's derivative 1 - tanh^2. When every row is ignored (|R| = 0) the loss is 0
with a zero gradient, where torch.nn.functional.cross_entropy returns NaN: a micro-batch of
padding must not poison a sum of losses. reduction="sum" is what a train loop needs that
divides by the valid-token count of the whole global batch (DESIGN.md, Parallelism).

The Triton path: the forward kernel runs an online logsumexp over each row's vocabulary in
BLOCK_V steps and writes the row's loss, max and log-sum (one read of the logits); the backward
kernel reads the logits once more and writes their gradient in the logits' dtype, times the
incoming gradient, read through a pointer as |R| is (no host sync). Three passes over N x V
in all, the fewest an exact softmax gradient takes when a row does not fit on chip (a first
version that made the gradient in the forward, then scaled it in the backward, took five).
No N x V float32 tensor ever exists. With inplace_grad the backward writes the gradient over
the logits themselves.

linear_cross_entropy never holds all N x V logits: per chunk of rows it forms the chunk's
logits h_c @ weight^T, runs the same kernel writing dlogits_c over them, and right away
adds dh_c = dlogits_c @ weight and dweight += dlogits_c^T @ h_c (in the weight's dtype by
default, each chunk's product accumulated in float32 by its GEMM; accumulate_dtype=torch.float32
keeps a float32 accumulator), as Liger-Kernel's fused linear cross-entropy does.

Legend: N rows (tokens), V vocabulary size (classes), H hidden size, C rows of a chunk.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.utils.checkpoint import checkpoint

from fmoe.ops.backend import autocast_off, next_pow2, tanh, use_triton
from fmoe.ops.checks import check_bools, check_device, check_float, check_index, check_positive_int, checking

REDUCTIONS = ("mean", "sum")

# ----------------------------------------------------------------------------------------
# 1. Reference (the definition of correctness)
# ----------------------------------------------------------------------------------------


def softcap_ref(x, softcap):
    """c tanh(x / c) for c = softcap; x itself for None."""
    return x if softcap is None else torch.tanh(x / softcap) * softcap


def cross_entropy_ref(logits_NV, labels_N, ignore_index, mean, softcap=None):
    """Plain torch in float32; differentiable through torch autograd. Ignored rows' logits
    are replaced by zeros first, so their gradient is exactly zero even where they hold inf
    or NaN (as in the kernel), not 0 times NaN."""
    valid_N = labels_N != ignore_index
    x_NV = softcap_ref(logits_NV.masked_fill(~valid_N[:, None], 0).float(), softcap)
    V = x_NV.shape[1]
    # unchecked labels outside [0, V) get a NaN loss, as in the kernel, not a bad gather
    known_N = valid_N & (labels_N >= 0) & (labels_N < V)
    target_N = torch.where(known_N, labels_N, 0).long()
    # -log_softmax: (max - x) + log-sum, which logsumexp(x) - x would round away for huge logits
    row_N = -torch.log_softmax(x_NV, dim=-1).gather(1, target_N[:, None]).squeeze(1)
    row_N = torch.where(known_N, row_N, float("nan"))
    total = torch.where(valid_N, row_N, 0.0).sum()
    return total / valid_N.sum().clamp(min=1) if mean else total


@autocast_off
def linear_cross_entropy_ref(h_NH, weight_VH, labels_N, ignore_index, mean, bias_V=None, softcap=None):
    """The unfused computation: all N x V logits in h's dtype (+ bias), then cross_entropy_ref."""
    logits_NV = h_NH @ weight_VH.T if bias_V is None else torch.addmm(bias_V, h_NH, weight_VH.T)
    return cross_entropy_ref(logits_NV, labels_N, ignore_index, mean, softcap)


def _chunk_loss(h_NH, weight_VH, labels_N, ignore_index, bias_V, softcap, dtype):
    """One chunk's summed loss, its weight and bias used in h's dtype (a float32 master cast
    back exactly): the chunks' gradients then add up in the master's dtype."""
    bias_V = None if bias_V is None else bias_V.to(dtype)
    return linear_cross_entropy_ref(h_NH, weight_VH.to(dtype), labels_N, ignore_index, False, bias_V, softcap)


def _linear_ce_chunks_ref(h_NH, weight_VH, labels_N, ignore_index, mean, bias_V, softcap, chunk_rows, fp32_accumulate):
    """linear_cross_entropy_ref over chunk_rows rows at a time, each chunk's logits recomputed
    in the backward (torch.utils.checkpoint): one chunk's logits and their float32 copies live
    at a time, not N x V three times over. The chunks' sums add up in order; their dweight in
    weight's dtype (rounded once per chunk), or with fp32_accumulate in float32 (a float32
    copy of weight that each chunk casts back, rounded once at the end), their dbias in
    float32 (rounded once), as on the Triton path."""
    if torch.compiler.is_compiling():  # the loop, traced, made a graph per chunk count: one op of its own there
        total = _linear_ce_chunks_op(h_NH, weight_VH, labels_N, ignore_index, bias_V, softcap, chunk_rows, fp32_accumulate)
    else:
        total = None
        master_VH = weight_VH.float() if fp32_accumulate else weight_VH
        master_V = None if bias_V is None else bias_V.float()
        for lo in range(0, h_NH.shape[0], chunk_rows):
            part = checkpoint(_chunk_loss, h_NH[lo:lo + chunk_rows], master_VH, labels_N[lo:lo + chunk_rows], ignore_index,
                              master_V, softcap, h_NH.dtype, use_reentrant=False)
            total = part if total is None else total + part
    return total / (labels_N != ignore_index).sum().clamp(min=1) if mean else total


# The chunks under torch.compile: traced, the loop over N / chunk_rows chunks specialised the
# count (a graph per count; with fullgraph=True the 9th failed on the recompile limit). As ops
# of their own the sum and its backward run the same reference, chunk by chunk, opaque to it.
@torch.library.custom_op("fmoe::linear_ce_chunks_ref", mutates_args=())
def _linear_ce_chunks_op(h_NH: torch.Tensor, weight_VH: torch.Tensor, labels_N: torch.Tensor, ignore_index: int,
                         bias_V: Optional[torch.Tensor], softcap: Optional[float], chunk_rows: int, fp32_accumulate: bool) -> torch.Tensor:
    """The summed loss of _linear_ce_chunks_ref (float32, 0-D)."""
    parts = [linear_cross_entropy_ref(h_NH[lo:lo + chunk_rows], weight_VH, labels_N[lo:lo + chunk_rows], ignore_index, False, bias_V, softcap)
             for lo in range(0, h_NH.shape[0], chunk_rows)]
    return torch.stack(parts).sum()


@_linear_ce_chunks_op.register_fake
def _(h_NH, weight_VH, labels_N, ignore_index, bias_V, softcap, chunk_rows, fp32_accumulate):
    return h_NH.new_empty((), dtype=torch.float32)


@torch.library.custom_op("fmoe::linear_ce_chunks_ref_bwd", mutates_args=())
def _linear_ce_chunks_bwd_op(grad: torch.Tensor, h_NH: torch.Tensor, weight_VH: torch.Tensor, labels_N: torch.Tensor, ignore_index: int,
                             bias_V: Optional[torch.Tensor], softcap: Optional[float], chunk_rows: int,
                             fp32_accumulate: bool) -> list[torch.Tensor]:
    """(dh, dweight, dbias: [0] without a bias) of the summed loss times grad: each chunk's
    logits recomputed, their gradient (softmax - onehot(label)) times the cap's derivative
    1 - (z / c)^2, none for ignored rows and unknown labels (cross_entropy_ref's, as its
    autograd gives it), in h's dtype for the products; dweight summed over the chunks in
    weight's dtype (float32 with fp32_accumulate), dbias in float32, as eager's."""
    dh = torch.empty_like(h_NH)
    dw = torch.zeros_like(weight_VH, dtype=torch.float32 if fp32_accumulate else weight_VH.dtype)
    db = torch.zeros_like(bias_V, dtype=torch.float32) if bias_V is not None else h_NH.new_empty((0,))
    V = weight_VH.shape[0]
    for lo in range(0, h_NH.shape[0], chunk_rows):
        h, labels = h_NH[lo:lo + chunk_rows], labels_N[lo:lo + chunk_rows]
        x = h @ weight_VH.T if bias_V is None else torch.addmm(bias_V, h, weight_VH.T)
        valid = labels != ignore_index
        z = softcap_ref(x.masked_fill(~valid[:, None], 0).float(), softcap)
        known = valid & (labels >= 0) & (labels < V)
        dz = torch.softmax(z, dim=-1) - torch.nn.functional.one_hot(torch.where(known, labels, 0).long(), V)
        if softcap is not None:
            dz = dz * (1 - (z / softcap).square())
        dx = (torch.where(known[:, None], dz, 0.0) * grad.float()).to(h.dtype)
        dh[lo:lo + chunk_rows] = dx @ weight_VH
        dw += dx.T @ h
        if bias_V is not None:
            db += dx.sum(0)
    return [dh, dw.to(weight_VH.dtype), db.to(h_NH.dtype) if bias_V is not None else db]


@_linear_ce_chunks_bwd_op.register_fake
def _(grad, h_NH, weight_VH, labels_N, ignore_index, bias_V, softcap, chunk_rows, fp32_accumulate):
    return [torch.empty_like(h_NH), torch.empty_like(weight_VH), torch.empty_like(bias_V) if bias_V is not None else h_NH.new_empty((0,))]


def _linear_ce_chunks_setup(ctx, inputs, output):
    h_NH, weight_VH, labels_N, ctx.ignore_index, bias_V, ctx.softcap, ctx.chunk_rows, ctx.fp32_accumulate = inputs
    ctx.save_for_backward(h_NH, weight_VH, labels_N, bias_V)


def _linear_ce_chunks_backward(ctx, grad):
    h_NH, weight_VH, labels_N, bias_V = ctx.saved_tensors
    dh, dw, db = _linear_ce_chunks_bwd_op(grad, h_NH, weight_VH, labels_N, ctx.ignore_index, bias_V, ctx.softcap, ctx.chunk_rows,
                                          ctx.fp32_accumulate)
    return dh, dw, None, None, None if bias_V is None else db, None, None, None


_linear_ce_chunks_op.register_autograd(_linear_ce_chunks_backward, setup_context=_linear_ce_chunks_setup)


# ----------------------------------------------------------------------------------------
# 2. Triton kernel
# ----------------------------------------------------------------------------------------


@triton.jit
def _ce_rows(labels_ptr, N, V, ignore_index, BLOCK_R: tl.constexpr):
    """The rows of this program: (rows, in range, counted (label not ignored), target column
    or -1). An unchecked out-of-range label (check=False, or under torch.compile) gives a NaN
    loss instead of an out-of-bounds read: target -1 never matches a column."""
    rows_R = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok_R = rows_R < N
    label_R = tl.load(labels_ptr + rows_R, mask=row_ok_R, other=ignore_index)
    valid_R = row_ok_R & (label_R != ignore_index)
    known_R = valid_R & (label_R >= 0) & (label_R < V)
    return rows_R, row_ok_R, valid_R, tl.where(known_R, label_R, -1).to(tl.int32)


@triton.jit
def _capped(x, softcap, SOFTCAP: tl.constexpr):
    """c tanh(x / c) with SOFTCAP (c = softcap), else x (fmoe.ops.backend.tanh: from one exp);
    -inf gives -c."""
    if SOFTCAP:
        x = tanh(x / softcap) * softcap
    return x


@triton.jit
def _ce_grad_sweep(logits_ptr, grad_ptr, x_row_R, g_row_R, row_ok_R, valid_R, target_R, m_R, log_s_R, scale, V, softcap,
                   SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """grad = (softmax - onehot(target)) * scale over the rows, softmax = exp((x - m) - log s)
    from the row's max m and log-sum log s (never m + log s rounded), in BLOCK_V steps, last block
    first (after a forward sweep the end of the row is the part most likely still in L2);
    with SOFTCAP, of the capped logits z, times the cap's derivative 1 - (z / c)^2.
    grad_ptr may be logits_ptr: each element is read before this program overwrites it."""
    cols_V = tl.arange(0, BLOCK_V)
    n_blocks = tl.cdiv(V, BLOCK_V)
    for i in range(n_blocks):
        cols = (n_blocks - 1 - i) * BLOCK_V + cols_V
        live = row_ok_R[:, None] & (cols[None, :] < V)
        x = _capped(tl.load(logits_ptr + x_row_R[:, None] + cols[None, :], mask=live, other=0.0).to(tl.float32), softcap, SOFTCAP)
        g = tl.exp((x - m_R[:, None]) - log_s_R[:, None]) - tl.where(cols[None, :] == target_R[:, None], 1.0, 0.0)
        if SOFTCAP:
            g = g * (1.0 - (x / softcap) * (x / softcap))
        # ignored rows get exact zeros, even where their logits hold inf or NaN
        g = tl.where(valid_R[:, None], g * scale, 0.0)
        tl.store(grad_ptr + g_row_R[:, None] + cols[None, :], g.to(grad_ptr.dtype.element_ty), mask=live)


@triton.jit
def _ce_fwd_kernel(
    logits_ptr, labels_ptr, grad_ptr, loss_ptr, lse_ptr, n_valid_ptr,
    N, V, stride_x, stride_g, stride_l, ignore_index, softcap,
    MEAN: tl.constexpr, WRITE_GRAD: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Loss, max and log-sum (lse_ptr[0, n] and lse_ptr[stride_l + n]: m and log s, lse = m + log s)
    of BLOCK_R rows and, with WRITE_GRAD (linear_cross_entropy's chunks), their gradient too, in a
    second sweep (grad_ptr may be logits_ptr). The loss is (m - x[label]) + log s: a row of huge
    logits (1e6, or float32's min in every column) keeps log s, which m + log s would round away."""
    rows_R, row_ok_R, valid_R, target_R = _ce_rows(labels_ptr, N, V, ignore_index, BLOCK_R)
    x_row_R = rows_R.to(tl.int64) * stride_x  # N * V can pass 2^31
    cols_V = tl.arange(0, BLOCK_V)

    # online logsumexp; a finite start keeps exp(m - m_new) = 1, not NaN, while a row has
    # seen only -inf (masked vocabulary entries); float32's min, so a row of it starts there
    m_R = tl.full([BLOCK_R], -3.4028234663852886e38, tl.float32)
    s_R = tl.zeros([BLOCK_R], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + cols_V
        live = row_ok_R[:, None] & (cols[None, :] < V)
        x = tl.load(logits_ptr + x_row_R[:, None] + cols[None, :], mask=live, other=float("-inf")).to(tl.float32)
        if SOFTCAP:  # the masked lanes stay -inf
            x = tl.where(live, _capped(x, softcap, SOFTCAP), float("-inf"))
        m_new_R = tl.maximum(m_R, tl.max(x, axis=1))
        s_R = s_R * tl.exp(m_R - m_new_R) + tl.sum(tl.exp(x - m_new_R[:, None]), axis=1)
        m_R = m_new_R
    # padding rows (past N) get m = log s = 0: no log(0) or exp overflow on lanes never stored
    m_R = tl.where(row_ok_R, m_R, 0.0)
    log_s_R = tl.log(tl.where(row_ok_R, s_R, 1.0))
    x_target_R = _capped(tl.load(logits_ptr + x_row_R + target_R, mask=target_R >= 0, other=0.0).to(tl.float32), softcap, SOFTCAP)
    loss_R = tl.where(target_R >= 0, (m_R - x_target_R) + log_s_R, float("nan"))
    tl.store(loss_ptr + rows_R, tl.where(valid_R, loss_R, 0.0), mask=row_ok_R)
    tl.store(lse_ptr + rows_R, m_R, mask=row_ok_R)
    tl.store(lse_ptr + stride_l + rows_R, log_s_R, mask=row_ok_R)

    if WRITE_GRAD:
        scale = 1.0
        if MEAN:
            scale = 1.0 / tl.maximum(tl.load(n_valid_ptr), 1).to(tl.float32)
        _ce_grad_sweep(logits_ptr, grad_ptr, x_row_R, rows_R.to(tl.int64) * stride_g, row_ok_R, valid_R, target_R, m_R,
                       log_s_R, scale, V, softcap, SOFTCAP, BLOCK_V)


@triton.jit
def _ce_bwd_kernel(
    logits_ptr, labels_ptr, lse_ptr, grad_loss_ptr, grad_ptr, n_valid_ptr,
    N, V, stride_x, stride_g, stride_l, ignore_index, softcap,
    MEAN: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """The gradient of BLOCK_R rows from their logits and the forward's logsumexp, times the
    incoming gradient (a float32 scalar on the device); grad_ptr may be logits_ptr."""
    rows_R, row_ok_R, valid_R, target_R = _ce_rows(labels_ptr, N, V, ignore_index, BLOCK_R)
    m_R = tl.load(lse_ptr + rows_R, mask=row_ok_R, other=0.0)
    log_s_R = tl.load(lse_ptr + stride_l + rows_R, mask=row_ok_R, other=0.0)
    scale = tl.load(grad_loss_ptr).to(tl.float32)
    if MEAN:
        scale = scale / tl.maximum(tl.load(n_valid_ptr), 1).to(tl.float32)
    _ce_grad_sweep(logits_ptr, grad_ptr, rows_R.to(tl.int64) * stride_x, rows_R.to(tl.int64) * stride_g, row_ok_R, valid_R,
                   target_R, m_R, log_s_R, scale, V, softcap, SOFTCAP, BLOCK_V)


# columns per loop step; tests lower it to run the loop over V on small vocabularies
_MAX_BLOCK_V = 4096


def _ce_blocks(V: int) -> dict:
    """A [BLOCK_R, BLOCK_V] tile of about 16 elements per lane, up to 8 warps: one row per
    program for a real vocabulary, several rows of a small one."""
    block_v = min(next_pow2(V), _MAX_BLOCK_V)
    block_r = max(1, min(16, 1024 // block_v))
    return dict(BLOCK_R=block_r, BLOCK_V=block_v, num_warps=max(1, min(8, block_r * block_v // 512)))


def _ce_grid(N: int, V: int) -> tuple[tuple[int], dict]:
    """The launch grid and block sizes of the cross-entropy kernels over N rows of V."""
    meta = _ce_blocks(V)
    return (triton.cdiv(N, meta["BLOCK_R"]),), meta


def _check_row_labels(labels_N, N):
    """The custom ops' labels: one per logits row (the kernels read them by row index)."""
    if labels_N.shape != (N,):
        raise ValueError(f"labels: expected shape [N] = [{N}], one per logits row, got {tuple(labels_N.shape)}")


def _launch_ce(logits_NV, labels_N, grad_NV, loss_N, lse_2N, n_valid, ignore_index, mean, write_grad, softcap=0.0):
    """Run _ce_fwd_kernel; logits_NV and grad_NV have unit column stride (may be the same);
    lse_2N [2, N] float32 (unit column stride) gets each row's max and log-sum; softcap 0: none."""
    N, V = logits_NV.shape
    _check_row_labels(labels_N, N)
    if N == 0:
        return
    grid, meta = _ce_grid(N, V)
    _ce_fwd_kernel[grid](
        logits_NV, labels_N, grad_NV, loss_N, lse_2N, n_valid,
        N, V, logits_NV.stride(0), grad_NV.stride(0), lse_2N.stride(0), ignore_index, softcap,
        MEAN=mean, WRITE_GRAD=write_grad, SOFTCAP=softcap > 0, **meta,
    )


def _launch_ce_bwd(grad_loss, logits_NV, labels_N, lse_2N, grad_NV, ignore_index, mean, softcap=0.0):
    """Run _ce_bwd_kernel; logits_NV and grad_NV have unit column stride (may be the same)."""
    N, V = logits_NV.shape
    _check_row_labels(labels_N, N)
    # the kernel reads both rows of the forward's lse by offset: a logsumexp of shape [N] would be read past its end
    if lse_2N.shape != (2, N) or lse_2N.dtype != torch.float32 or lse_2N.stride(1) != 1:
        raise ValueError(
            f"lse: expected the forward's [2, N] = [2, {N}] float32 rows (max, log-sum) with unit column stride, "
            f"got shape {tuple(lse_2N.shape)}, {lse_2N.dtype}, strides {lse_2N.stride()}"
        )
    if N == 0:
        return
    grid, meta = _ce_grid(N, V)
    _ce_bwd_kernel[grid](
        logits_NV, labels_N, lse_2N, grad_loss.float(), grad_NV, (labels_N != ignore_index).sum(),
        N, V, logits_NV.stride(0), grad_NV.stride(0), lse_2N.stride(0), ignore_index, softcap,
        MEAN=mean, SOFTCAP=softcap > 0, **meta,
    )


def _row_major(x):
    """x itself when its columns are contiguous (any row stride), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _finish(loss_N, n_valid, mean):
    total = loss_N.sum()
    return total / n_valid.clamp(min=1) if mean else total


# ----------------------------------------------------------------------------------------
# 3. torch.library registration
# ----------------------------------------------------------------------------------------


@torch.library.custom_op("fmoe::cross_entropy_fwd", mutates_args=())
def _ce_fwd(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, mean: bool, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse [2, N] float32: each row's max and log-sum, lse = max + log-sum its logsumexp
    (of the capped logits with a softcap > 0), what the backward needs beside the logits)."""
    logits = _row_major(logits)
    labels = labels.contiguous()
    N = logits.shape[0]
    n_valid = (labels != ignore_index).sum()
    loss_N = torch.empty(N, dtype=torch.float32, device=logits.device)
    lse_2N = torch.empty(2, N, dtype=torch.float32, device=logits.device)
    _launch_ce(logits, labels, logits, loss_N, lse_2N, n_valid, ignore_index, mean, False, softcap)
    return _finish(loss_N, n_valid, mean), lse_2N


@_ce_fwd.register_fake
def _(logits, labels, ignore_index, mean, softcap=0.0):
    return logits.new_empty((), dtype=torch.float32), logits.new_empty((2, logits.shape[0]), dtype=torch.float32)


@torch.library.custom_op("fmoe::cross_entropy_bwd", mutates_args=())
def _ce_bwd(
    grad_loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, ignore_index: int, mean: bool,
    softcap: float = 0.0,
) -> torch.Tensor:
    """dloss/dlogits [N, V] in logits' dtype, times grad_loss (a 0-D tensor)."""
    logits = _row_major(logits)
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    _launch_ce_bwd(grad_loss, logits, labels.contiguous(), lse, grad, ignore_index, mean, softcap)
    return grad


@_ce_bwd.register_fake
def _(grad_loss, logits, labels, lse, ignore_index, mean, softcap=0.0):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


@torch.library.custom_op("fmoe::cross_entropy_bwd_", mutates_args=("logits",))
def _ce_bwd_inplace(
    grad_loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, ignore_index: int, mean: bool,
    softcap: float = 0.0,
) -> None:
    """_ce_bwd written over the logits themselves (unit column stride)."""
    _launch_ce_bwd(grad_loss, logits, labels.contiguous(), lse, logits, ignore_index, mean, softcap)


def _ce_setup_context(ctx, inputs, output):
    logits, labels, ctx.ignore_index, ctx.mean, ctx.softcap = inputs
    # the logsumexp output gets no incoming gradient: left None, not a tensor of zeros
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(logits, labels, output[1])


def _ce_backward(ctx, grad_loss, _grad_lse):
    if grad_loss is None:
        return None, None, None, None, None
    logits, labels, lse = ctx.saved_tensors
    return _ce_bwd(grad_loss, logits, labels, lse, ctx.ignore_index, ctx.mean, ctx.softcap), None, None, None, None


_ce_fwd.register_autograd(_ce_backward, setup_context=_ce_setup_context)


def _saved_once(ctx, op):
    """ctx.saved_tensors, which a backward overwrites in place: the in-place write moves their
    version on, so a second backward fails here instead of reading the gradient as logits."""
    try:
        return ctx.saved_tensors
    except RuntimeError as err:
        raise RuntimeError(
            f"{op}: the saved tensors were already overwritten in place by a backward, or "
            "changed since; the graph takes one backward only (retain_graph=True is not supported)"
        ) from err


class _CrossEntropyInplace(torch.autograd.Function):
    """Autograd for the backward that writes over the logits (torch.library attaches
    autograd to functional ops only)."""

    @staticmethod
    def forward(ctx, logits, labels, ignore_index, mean, softcap):
        loss, lse = _ce_fwd(logits, labels, ignore_index, mean, softcap)
        ctx.ignore_index, ctx.mean, ctx.softcap = ignore_index, mean, softcap
        ctx.save_for_backward(logits, labels, lse)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, labels, lse = _saved_once(ctx, "cross_entropy(inplace_grad=True)")
        # detached: autograd takes the overwritten logits as the gradient of a leaf instead of cloning them
        logits = logits.detach()
        _ce_bwd_inplace(grad_loss, logits, labels, lse, ctx.ignore_index, ctx.mean, ctx.softcap)
        return logits, None, None, None, None


def _accumulate(acc_VH, dlogits_CV, h_CH):
    """acc_VH += dlogits_CV^T @ h_CH without a V x H temporary where the backend allows."""
    if acc_VH.dtype == h_CH.dtype:
        acc_VH.addmm_(dlogits_CV.T, h_CH)
    elif acc_VH.is_cuda:  # cuBLAS adds the bf16/fp16 product into the float32 accumulator
        torch.addmm(acc_VH, dlogits_CV.T, h_CH, out_dtype=torch.float32, out=acc_VH)
    else:  # CPU has no mixed-dtype addmm: float32 copies of the chunk's operands
        acc_VH.addmm_(dlogits_CV.T.float(), h_CH.float())


@torch.library.custom_op("fmoe::linear_cross_entropy_fwd", mutates_args=())
def _linear_ce_fwd(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int, mean: bool,
    chunk_rows: int, need_dh: bool, need_dw: bool, fp32_accumulate: bool, bias: Optional[torch.Tensor] = None, need_db: bool = False,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, dloss/dh or empty, dloss/dweight or empty, dloss/dbias or empty), chunk_rows
    rows of logits at a time (each chunk's h @ weight.T + bias)."""
    N, H = h.shape
    V = weight.shape[0]
    labels = labels.contiguous()
    n_valid = (labels != ignore_index).sum()
    loss_N = torch.empty(N, dtype=torch.float32, device=h.device)
    rows = max(1, min(chunk_rows, N))
    lse_2C = torch.empty(2, rows, dtype=torch.float32, device=h.device)  # written by the kernel, not needed here
    dh_NH = torch.empty((N, H) if need_dh else (0,), dtype=h.dtype, device=h.device)
    acc_dtype = torch.float32 if fp32_accumulate else weight.dtype
    dw_VH = torch.zeros((V, H) if need_dw else (0,), dtype=acc_dtype, device=h.device)
    db_V = torch.zeros(V if need_db else 0, dtype=torch.float32, device=h.device)  # the bias's gradient: column sums, in float32
    logits_CV = torch.empty(rows, V, dtype=h.dtype, device=h.device)  # reused by every chunk
    for start in range(0, N, rows):
        end = min(start + rows, N)
        h_CH, x_CV = h[start:end], logits_CV[: end - start]
        if bias is None:
            torch.mm(h_CH, weight.T, out=x_CV)
        else:
            torch.addmm(bias, h_CH, weight.T, out=x_CV)
        # the kernel turns the chunk's logits into their gradient, in place
        _launch_ce(x_CV, labels[start:end], x_CV, loss_N[start:end], lse_2C[:, : end - start], n_valid, ignore_index, mean,
                   need_dh or need_dw or need_db, softcap)
        if need_dh:
            torch.mm(x_CV, weight, out=dh_NH[start:end])
        if need_dw:
            _accumulate(dw_VH, x_CV, h_CH)
        if need_db:
            db_V += x_CV.sum(0, dtype=torch.float32)
    del logits_CV  # freed before the accumulator's rounded copy is made
    return _finish(loss_N, n_valid, mean), dh_NH, dw_VH.to(weight.dtype), db_V.to(bias.dtype) if need_db else db_V


@_linear_ce_fwd.register_fake
def _(h, weight, labels, ignore_index, mean, chunk_rows, need_dh, need_dw, fp32_accumulate, bias=None, need_db=False, softcap=0.0):
    return (
        h.new_empty((), dtype=torch.float32),
        h.new_empty(h.shape if need_dh else (0,)),
        weight.new_empty(weight.shape if need_dw else (0,)),
        (bias.new_empty(bias.shape) if need_db else h.new_empty((0,), dtype=torch.float32)),
    )


def _linear_ce_setup_context(ctx, inputs, output):
    ctx.need_dh, ctx.need_dw, ctx.need_db = inputs[6], inputs[7], inputs[10]
    ctx.set_materialize_grads(False)  # as in _ce_setup_context
    ctx.save_for_backward(output[1], output[2], output[3])


def _linear_ce_backward(ctx, grad_loss, _grad_dh, _grad_dw, _grad_db):
    if torch.is_grad_enabled():  # create_graph=True: the gradients below would be constants
        raise RuntimeError("linear_cross_entropy(impl='triton'): its gradients are computed in the forward, with no graph of their own: "
                           "a double backward (create_graph=True, a gradient penalty) needs impl='torch'")
    dh, dw, db = _saved_once(ctx, "linear_cross_entropy")  # scaled in place: a second backward fails there
    return (
        dh.detach().mul_(grad_loss) if ctx.need_dh else None,
        dw.detach().mul_(grad_loss) if ctx.need_dw else None,
        None, None, None, None, None, None, None,
        db.detach().mul_(grad_loss) if ctx.need_db else None,
        None, None,
    )


_linear_ce_fwd.register_autograd(_linear_ce_backward, setup_context=_linear_ce_setup_context)


# ----------------------------------------------------------------------------------------
# 4. Public functions
# ----------------------------------------------------------------------------------------

# default rows per chunk of linear_cross_entropy: a chunk's logits take at most this
_CHUNK_BYTES = 256 << 20


def _check_labels(labels, n_rows, ignore_index, reduction, device):
    check_index("labels", labels, 1, "[N]")
    if labels.shape[0] != n_rows:
        raise ValueError(f"labels: expected {n_rows} labels, one per row, got {labels.shape[0]}")
    check_device("labels", labels, device)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index: expected an int, got {ignore_index!r}")
    info = torch.iinfo(labels.dtype)
    if not info.min <= ignore_index <= info.max:  # a comparison with labels would wrap it
        raise ValueError(f"ignore_index: expected an int that {labels.dtype} labels can hold, in [{info.min}, {info.max}], got {ignore_index}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")


def _check_softcap(softcap) -> float:
    """The kernels' softcap argument: 0.0 for None; ValueError unless None or a positive finite number."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < float("inf"):
        raise ValueError(f"softcap: expected None or a positive finite number, got {softcap!r}")
    return float(softcap)


def _check_label_values(labels, n_classes, ignore_index, check):
    """Labels lie in [0, V) or equal ignore_index. One device->host sync."""
    if not checking(check, labels):
        return
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= n_classes))
    if bad.any():
        rows = bad.nonzero().flatten()
        raise ValueError(
            f"labels: {rows.numel()} label(s) outside [0, {n_classes}) that are not "
            f"ignore_index={ignore_index}, first labels[{int(rows[0])}] = {int(labels[rows[0]])}"
        )


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    inplace_grad: bool = False,
    check: bool = True,
    impl: str = "auto",
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Cross-entropy of logits against class labels, in float32 (SPEC.md section 6).

    Args:
        logits: [N, V] float32 / bfloat16 / float16.
        labels: [N] int32 / int64 in [0, V), or ignore_index for rows that do not count.
        ignore_index: label of the rows to skip.
        reduction: "mean" over the non-ignored rows, or their "sum". All rows ignored: 0
            (torch returns NaN for "mean"), with a zero gradient.
        inplace_grad: the Triton path's backward may write the gradient over the logits
            themselves, saving an N x V buffer. The forward leaves them as they are; after
            backward they hold the gradient (logits.grad of a leaf shares their memory), so
            the graph takes one backward only. If another op's backward needs these logits
            (torch.tanh saves its output, for one), that backward raises instead of reading
            the gradient. Needs unit column stride. The torch path ignores the flag.
        check: raise a ValueError on labels outside [0, V) other than ignore_index (one
            device->host sync; skipped under torch.compile). Unchecked, such rows get a
            NaN loss.
        impl: "auto" (Triton on CUDA, torch otherwise), "triton" or "torch".
        softcap: None, or c > 0: the loss of the capped logits c tanh(logits / c) (Gemma 2's
            and Beam's final_logit_softcapping), capped inside the kernels' passes (no capped
            N x V copy).

    Returns:
        0-D float32 tensor, differentiable with respect to logits. The Triton path saves the
        logits and each row's logsumexp; its backward makes the gradient from them, in
        logits' dtype.

    Example:
        >>> cross_entropy(torch.tensor([[0.0, 0.0], [5.0, 5.0]]), torch.tensor([1, -100]))
        tensor(0.6931)
    """
    check_float("logits", logits, 2, "[N, V]")
    N, V = logits.shape
    if V == 0:
        raise ValueError(f"logits: expected at least one class, got shape {tuple(logits.shape)}")
    _check_labels(labels, N, ignore_index, reduction, logits.device)
    cap = _check_softcap(softcap)
    _check_label_values(labels, V, ignore_index, check)
    check_bools(inplace_grad=inplace_grad)
    mean = reduction == "mean"
    if not use_triton(impl, logits, labels):
        return cross_entropy_ref(logits, labels, ignore_index, mean, softcap)
    if inplace_grad:
        if N > 0 and V > 1 and logits.stride(-1) != 1:  # no rows, or one column: no column stride is read
            raise ValueError(f"logits: inplace_grad needs unit column stride, got strides {logits.stride()}")
        if N > 1 and logits.stride(0) < V:  # an expand of one row: each row's gradient would overwrite the others'
            raise ValueError(f"logits: inplace_grad writes each row's gradient over it: rows must not share memory (row stride "
                             f">= {V}), got strides {logits.stride()}")
        return _CrossEntropyInplace.apply(logits, labels, ignore_index, mean, cap)
    return _ce_fwd(logits, labels, ignore_index, mean, cap)[0]


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_rows: Optional[int] = None,
    accumulate_dtype: Optional[torch.dtype] = None,
    check: bool = True,
    impl: str = "auto",
    bias: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """cross_entropy(h @ weight.T + bias, labels) without holding the N x V logits (SPEC.md 6).

    The Triton path takes chunk_rows rows at a time: the chunk's logits (in h's dtype, as
    h @ weight.T makes them), the fused cross-entropy kernel turning them into their
    gradient in place, then dh for the chunk and its share of dweight, all in the forward;
    the backward scales the two by the incoming scalar, in place (one backward only). The
    value and gradients equal the unfused computation's up to rounding. The torch path is
    that unfused computation where the rows fit one chunk; past it, the same chunk by chunk,
    each chunk's logits recomputed in the backward (N = 2048, V = 32768 in float32: its peak
    was the logits three times over, 768 MiB).

    Args:
        h: [N, H] hidden states, float32 / bfloat16 / float16.
        weight: [V, H] output projection (the LM head), h's dtype.
        labels: [N] int32 / int64 in [0, V), or ignore_index.
        ignore_index, reduction, check, impl: as in cross_entropy.
        chunk_rows: rows per chunk; default: as many as keep a chunk's logits within 256 MiB
            (1024 rows for V = 131072 in bf16). Memory: chunk_rows x V in h's dtype (the torch
            path's: a chunk's logits and their float32 copies, 3 x chunk_rows x V floats).
        accumulate_dtype: dtype of the dweight accumulator over chunks. None (default):
            weight's dtype: each chunk's product (accumulated in float32 by the GEMM) adds
            into the final gradient in place, rounded once per chunk, as torch's own
            linear_cross_entropy and Liger do: the least memory. torch.float32: a float32
            V x H buffer rounded once at the end, the unfused computation's rounding, for
            an extra V x H x 4 bytes while the forward runs.
        bias: None, or [V] in h's dtype added to every row's logits (an LM head with a
            bias: Phi-3.5-MoE's); its gradient is the logits' gradients summed over the rows
            (in float32, rounded once).
        softcap: as in cross_entropy: each chunk's logits capped in the kernel.
    Returns:
        0-D float32 tensor, differentiable with respect to h, weight and bias (any may not
        require grad; only the needed gradients are computed).
    """
    check_float("h", h, 2, "[N, H]")
    check_float("weight", weight, 2, "[V, H]")
    N, H = h.shape
    V = weight.shape[0]
    if weight.shape[1] != H:
        raise ValueError(f"weight: expected shape [V, {H}] to match h's hidden size, got {tuple(weight.shape)}")
    if weight.dtype != h.dtype:
        raise ValueError(f"weight: expected h's dtype {h.dtype}, got {weight.dtype}")
    if weight.device != h.device:
        raise ValueError(f"weight: expected h's device {h.device}, got {weight.device}")
    if V == 0:
        raise ValueError(f"weight: expected at least one class (row), got shape {tuple(weight.shape)}")
    _check_labels(labels, N, ignore_index, reduction, h.device)
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (V,) or bias.dtype != h.dtype or bias.device != h.device):
        got = f"{bias.dtype} {list(bias.shape)} on {bias.device}" if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"bias: expected None or [{V}] (one per row of weight) in h's dtype {h.dtype} on {h.device}, got {got}")
    if chunk_rows is None:
        chunk_rows = max(1, _CHUNK_BYTES // (V * h.element_size()))
    check_positive_int("chunk_rows", chunk_rows)
    if accumulate_dtype is None:
        accumulate_dtype = weight.dtype
    if accumulate_dtype not in (torch.float32, weight.dtype):
        raise ValueError(f"accumulate_dtype: expected torch.float32 or weight's dtype {weight.dtype}, got {accumulate_dtype}")
    cap = _check_softcap(softcap)
    _check_label_values(labels, V, ignore_index, check)
    mean = reduction == "mean"
    if not use_triton(impl, h, weight, labels, bias):
        if h.shape[0] <= chunk_rows:
            return linear_cross_entropy_ref(h, weight, labels, ignore_index, mean, bias, softcap)
        return _linear_ce_chunks_ref(h, weight, labels, ignore_index, mean, bias, softcap, chunk_rows,
                                     accumulate_dtype == torch.float32 and weight.dtype != torch.float32)
    grad_on = torch.is_grad_enabled()
    need_dh, need_dw = grad_on and h.requires_grad, grad_on and weight.requires_grad
    need_db = grad_on and bias is not None and bias.requires_grad
    fp32_accumulate = accumulate_dtype == torch.float32
    return _linear_ce_fwd(h, weight, labels, ignore_index, mean, chunk_rows, need_dh, need_dw, fp32_accumulate, bias, need_db, cap)[0]
