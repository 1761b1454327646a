"""Mamba-1's selective scan (the mixer of Mamba, Falcon Mamba and Jamba), over packed documents.

    selective_scan(u[B,T,C], dt[B,T,C], A[C,N], b[B,T,N], c[B,T,N], cu_seqlens=None, *,
                   initial_state=None, final_state=False, impl="auto") -> y[B,T,C]  (, state[B,C,N])

Each of the C channels keeps a state h [N] (float32) over the tokens of a document, t = 1, 2, ...:

    h_t = exp(dt_t A) * h_{t-1} + u_t b_t      elementwise over N: a decay per channel and state channel
    y_t = h_t . c_t                            b and c shared by every channel

h_0 = 0 at each document's first token (documents: the rows of the batch, or with cu_seqlens
(B = 1) the packed documents of the one row); initial_state[b] is h_0 of row b's first
document (decoding), and the final state (final_state=True) is h after row b's last token.
Mamba's u is its convolved x times dt; its skip D u and its gate stay outside the scan.

This is fmoe.ops.gated_linear_attention with a head per channel (Dv = 1), q = c, k = b, v = u
and a decay per key channel g = dt A: that chunked form is the torch path (and the
reference). It holds, for every channel, the pairs of a chunk's tokens (T C chunk_size
numbers) and each token's decays per state channel (T C N numbers), tensors of several GB at
Jamba's sizes (C = 8192 channels, T = 4096, chunks of 64: 8.6 GB for the pairs), so CUDA runs a
scan instead: one Triton program per (batch row, block of BC channels) keeps its [BC, N]
states in registers and walks the tokens a chunk of K = 16 at a time. It loads the chunk's
inputs at once and forms its states [K, BC, N] by one associative scan over the tokens of
the pairs (a_t = exp(dt_t A), x_t = u_t b_t) (two steps h -> a h + x compose to one of the
same form), then h_t = a_t..a_t0 h_before + the scanned writes; it writes y and, before each
chunk, the state (the checkpoints, T C N / K numbers). The backward kernel walks the chunks
back from the last: it recomputes the chunk's states from its checkpoint by the same scan,
and the gradient of every state by a reverse one,

    g_t = dy_t c_t + exp(dt_t+1 A) g_t+1 (0 across a document's start),
    du_t = g_t . b_t,  db_t = sum over channels of u_t g_t,  dc_t = sum over channels of dy_t h_t,
    ddt_t = sum_N g_t exp(dt_t A) A h_t-1,  dA = sum over tokens of g_t exp(dt_t A) dt_t h_t-1,

with exp(dt_t A) h_t-1 = h_t - u_t b_t (no shift of the states along the tokens); the
channel sums of db and dc per program (summed in torch after), dA per program and row.
No value is read on the host. On an H200 (2026-11-29, bf16 inputs, one packed row) the
chunks' scan took the forward from 3.33 to 1.25 ms and the forward and backward from 11.50
to 9.53 ms at 4096 tokens and 8192 channels, and from 13.36 to 2.35 ms and 44.79 to 20.15 ms
at 16384 tokens and 4096 channels, against the token walk it replaced (a program of 32
channels per token in turn); benchmarks/RESULTS.md has the run.

Legend: B batch rows, T tokens, C channels, N state channels, K tokens per checkpoint, BC
channels per program, M = ceil(T / K) checkpoints.
"""

from __future__ import annotations

from typing import Optional

import torch

import triton
import triton.language as tl

from fmoe.ops.backend import next_pow2, use_triton
from fmoe.ops.checks import check_bools, check_cu_seqlens, check_float, check_positive_int, check_rows_and_state, checking, largest
from fmoe.ops.delta import gated_linear_attention, gated_linear_attention_loop
from fmoe.ops.packed import sequence_ids

CHECKPOINT = 16  # K: tokens per chunk, between the forward's saved states
BLOCK_C = 8  # BC: channels per program (sm_90a, 4 warps: 72 registers forward, 168 backward, no spills; 16 needs 254 backward)


def _starts(cu_seqlens: Optional[torch.Tensor], B: int, T: int, device) -> torch.Tensor:
    """[B, T] float32: 1 where a token starts a document after the row's first token (its
    state restarts from 0), else 0."""
    out = torch.zeros(B, T, device=device)
    if cu_seqlens is not None and T > 1:
        doc = sequence_ids(cu_seqlens.to(device), T)
        out[:, 1:] = (doc[1:] != doc[:-1]).float()
    return out


@triton.jit
def _channels(pid_c, C, N, BC: tl.constexpr, BN: tl.constexpr):
    """A program's block of channels: their indices, the state channels', both masks, the
    [BC, BN] tile's mask and its offsets into a [C, N]."""
    cs = pid_c * BC + tl.arange(0, BC)
    ns = tl.arange(0, BN)
    mask_c, mask_n = cs < C, ns < N
    return cs, ns, mask_c, mask_n, mask_c[:, None] & mask_n[None, :], cs[:, None] * N + ns[None, :]


@triton.jit
def _linear(a1, x1, a2, x2):
    """Two steps of h -> a h + x, the first (a1, x1) then (a2, x2), as one: the scans' combine."""
    return a1 * a2, x1 * a2 + x2


@triton.jit
def _decays(dt_ptr, start_ptr, A, row, ts, T, C, cs, mask_c):
    """[K, BC, BN] each token's decay exp(dt A), 0 at a document's start, 1 past T (the
    identity: a chunk's padding passes the state on); and dt [K, BC] (0 past T)."""
    mask_t = ts < T
    keep = 1.0 - tl.load(start_ptr + row * T + ts, mask=mask_t, other=0.0)
    dt = tl.load(dt_ptr + (row * T + ts)[:, None] * C + cs[None, :], mask=mask_t[:, None] & mask_c[None, :], other=0.0)
    decay = tl.where(mask_t[:, None, None], tl.exp(dt[:, :, None] * A[None, :, :]), 1.0)  # past T: 0 * A, NaN for A = -inf
    return decay * keep[:, None, None], dt


@triton.jit
def _chunk(u_ptr, dt_ptr, b_ptr, c_ptr, start_ptr, A, h, row, t0, T, C, N, cs, ns, mask_c, mask_n, K: tl.constexpr):
    """The chunk of K tokens from t0, scanned from the state h [BC, BN] before it: its tokens ts
    [K], their mask [K, BC], dt, u [K, BC], b, c [K, BN], the writes x = u b and the states
    after each token [K, BC, BN] (h_t = a_t h_t-1 + x_t, one associative scan)."""
    ts = t0 + tl.arange(0, K)
    mask_t = ts < T
    a, dt = _decays(dt_ptr, start_ptr, A, row, ts, T, C, cs, mask_c)
    mask_tc, mask_tn = mask_t[:, None] & mask_c[None, :], mask_t[:, None] & mask_n[None, :]
    u = tl.load(u_ptr + (row * T + ts)[:, None] * C + cs[None, :], mask=mask_tc, other=0.0)
    bv = tl.load(b_ptr + (row * T + ts)[:, None] * N + ns[None, :], mask=mask_tn, other=0.0)
    cv = tl.load(c_ptr + (row * T + ts)[:, None] * N + ns[None, :], mask=mask_tn, other=0.0)
    x = u[:, :, None] * bv[:, None, :]
    decay, write = tl.associative_scan((a, x), 0, _linear)
    return ts, mask_tc, dt, u, bv, cv, x, decay * h[None, :, :] + write


@triton.jit
def _row(tile, i, K: tl.constexpr):
    """Row i of a [K, BC, BN] tile."""
    return tl.sum(tl.where((tl.arange(0, K) == i)[:, None, None], tile, 0.0), axis=0)


@triton.jit
def _scan_fwd_kernel(u_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, start_ptr, h0_ptr, y_ptr, hT_ptr, ckpt_ptr, T, C, N, M,
                     K: tl.constexpr, BC: tl.constexpr, BN: tl.constexpr):
    pid_c, row = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64: B T C passes 2**31 at long T
    cs, ns, mask_c, mask_n, mask, tile = _channels(pid_c, C, N, BC, BN)
    A = tl.load(a_ptr + tile, mask=mask, other=0.0)
    h = tl.load(h0_ptr + row * C * N + tile, mask=mask, other=0.0)
    for m in range(M):  # a chunk of K tokens at a time, its state before it saved (checkpoint m)
        tl.store(ckpt_ptr + (row * M + m) * C * N + tile, h, mask=mask)
        ts, mask_tc, _, _, _, cv, _, hs = _chunk(u_ptr, dt_ptr, b_ptr, c_ptr, start_ptr, A, h, row, m * K, T, C, N, cs, ns, mask_c, mask_n, K)
        tl.store(y_ptr + (row * T + ts)[:, None] * C + cs[None, :], tl.sum(hs * cv[:, None, :], axis=2), mask=mask_tc)
        h = _row(hs, K - 1, K)  # past T the decay is 1 and the write 0: the state after the row's last token
    tl.store(hT_ptr + row * C * N + tile, h, mask=mask)


@triton.jit
def _scan_bwd_kernel(u_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, start_ptr, ckpt_ptr, dy_ptr, dhT_ptr,
                     du_ptr, ddt_ptr, db_ptr, dc_ptr, da_ptr, dh0_ptr, T, C, N, M, n_blocks,
                     K: tl.constexpr, BC: tl.constexpr, BN: tl.constexpr):
    pid_c, row = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64: B T C passes 2**31 at long T
    cs, ns, mask_c, mask_n, mask, tile = _channels(pid_c, C, N, BC, BN)
    partial = (row * n_blocks + pid_c) * T  # this program's rows of db's and dc's channel sums [B, n_blocks, T, N]
    A = tl.load(a_ptr + tile, mask=mask, other=0.0)
    g = tl.load(dhT_ptr + row * C * N + tile, mask=mask, other=0.0)  # the gradient of the state after the chunk
    dA = tl.zeros([BC, BN], dtype=tl.float32)
    for i in range(M):
        t0 = (M - 1 - i) * K
        h = tl.load(ckpt_ptr + (row * M + M - 1 - i) * C * N + tile, mask=mask, other=0.0)
        ts, mask_tc, dt, u, bv, cv, x, hs = _chunk(u_ptr, dt_ptr, b_ptr, c_ptr, start_ptr, A, h, row, t0, T, C, N, cs, ns, mask_c, mask_n, K)
        mask_tn = (ts < T)[:, None] & mask_n[None, :]
        dy = tl.load(dy_ptr + (row * T + ts)[:, None] * C + cs[None, :], mask=mask_tc, other=0.0)
        nxt, _ = _decays(dt_ptr, start_ptr, A, row, ts + 1, T, C, cs, mask_c)  # a_t+1 (1 after the row's last token)
        # gs_t = dy_t c_t + a_t+1 gs_t+1 from the chunk's end back: the gradient of each state
        carry, back = tl.associative_scan((nxt, dy[:, :, None] * cv[:, None, :]), 0, _linear, reverse=True)
        gs = carry * g[None, :, :] + back
        through = gs * (hs - x)  # dL/d(dt A): the gradient of h_t times a_t h_t-1
        tl.store(dc_ptr + (partial + ts)[:, None] * N + ns[None, :], tl.sum(dy[:, :, None] * hs, axis=1), mask=mask_tn)
        tl.store(db_ptr + (partial + ts)[:, None] * N + ns[None, :], tl.sum(gs * u[:, :, None], axis=1), mask=mask_tn)
        tl.store(du_ptr + (row * T + ts)[:, None] * C + cs[None, :], tl.sum(gs * bv[:, None, :], axis=2), mask=mask_tc)
        tl.store(ddt_ptr + (row * T + ts)[:, None] * C + cs[None, :], tl.sum(through * A[None, :, :], axis=2), mask=mask_tc)
        dA += tl.sum(through * dt[:, :, None], axis=0)
        g = _row(gs, 0, K)
    first, _ = _decays(dt_ptr, start_ptr, A, row, tl.arange(0, 1), T, C, cs, mask_c)  # token 0's decay
    tl.store(dh0_ptr + row * C * N + tile, g * _row(first, 0, 1), mask=mask)
    tl.store(da_ptr + row * C * N + tile, dA, mask=mask)


@torch.library.custom_op("fmoe::selective_scan", mutates_args=())
def _scan_kernel(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor, starts: torch.Tensor,
                 h0: torch.Tensor) -> list[torch.Tensor]:
    """[y [B, T, C] float32, the final state [B, C, N], the checkpoints [B, M, C, N]] by the
    forward kernel."""
    B, T, C = u.shape
    N = A.shape[1]
    M = triton.cdiv(T, CHECKPOINT)
    y = u.new_empty((B, T, C), dtype=torch.float32)
    hT, ckpt = h0.new_empty((B, C, N)), h0.new_empty((B, M, C, N))
    _scan_fwd_kernel[(triton.cdiv(C, BLOCK_C), B)](u, dt, A, b, c, starts, h0, y, hT, ckpt, T, C, N, M, K=CHECKPOINT, BC=BLOCK_C,
                                                   BN=max(16, next_pow2(N)))
    return [y, hT, ckpt]


@_scan_kernel.register_fake
def _(u, dt, A, b, c, starts, h0):
    B, T, C = u.shape
    N = A.shape[1]
    return [u.new_empty((B, T, C), dtype=torch.float32), h0.new_empty((B, C, N)), h0.new_empty((B, triton.cdiv(T, CHECKPOINT), C, N))]


@torch.library.custom_op("fmoe::selective_scan_bwd", mutates_args=())
def _scan_bwd(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor, starts: torch.Tensor, ckpt: torch.Tensor,
              dy: torch.Tensor, dhT: torch.Tensor) -> list[torch.Tensor]:
    """[du, ddt [B, T, C], dA [C, N], db, dc [B, T, N], dh0 [B, C, N]] by the backward kernel
    (float32; db's and dc's channel sums and dA's row sums per program added here)."""
    B, T, C = u.shape
    N, M, BN = A.shape[1], ckpt.shape[1], max(16, next_pow2(A.shape[1]))
    n_blocks = triton.cdiv(C, BLOCK_C)
    f32 = dict(dtype=torch.float32, device=u.device)
    du, ddt = torch.empty(B, T, C, **f32), torch.empty(B, T, C, **f32)
    db, dc = torch.empty(B, n_blocks, T, N, **f32), torch.empty(B, n_blocks, T, N, **f32)
    dA, dh0 = torch.empty(B, C, N, **f32), torch.empty(B, C, N, **f32)
    _scan_bwd_kernel[(n_blocks, B)](u, dt, A, b, c, starts, ckpt, dy, dhT, du, ddt, db, dc, dA, dh0, T, C, N, M, n_blocks,
                                    K=CHECKPOINT, BC=BLOCK_C, BN=BN)
    return [du, ddt, dA.sum(0), db.sum(1), dc.sum(1), dh0]


@_scan_bwd.register_fake
def _(u, dt, A, b, c, starts, ckpt, dy, dhT):
    B, T, C = u.shape
    N = A.shape[1]
    f32 = dict(dtype=torch.float32, device=u.device)
    return [torch.empty(B, T, C, **f32), torch.empty(B, T, C, **f32), torch.empty(C, N, **f32), torch.empty(B, T, N, **f32),
            torch.empty(B, T, N, **f32), torch.empty(B, C, N, **f32)]


def _scan_setup_context(ctx, inputs, output):
    u, dt, A, b, c, starts, _h0 = inputs
    ctx.save_for_backward(u, dt, A, b, c, starts, output[2])


def _scan_backward(ctx, grads):
    grad_y, grad_hT, _ = grads  # the checkpoints' gradient: none (they are the kernel's own)
    u, dt, A, b, c, starts, ckpt = ctx.saved_tensors
    dy = torch.zeros_like(u, dtype=torch.float32) if grad_y is None else grad_y.float().contiguous()
    dhT = torch.zeros(u.shape[0], *A.shape, device=u.device) if grad_hT is None else grad_hT.float().contiguous()
    du, ddt, dA, db, dc, dh0 = _scan_bwd(u, dt, A, b, c, starts, ckpt, dy, dhT)
    return du.to(u.dtype), ddt.to(dt.dtype), dA.to(A.dtype), db.to(b.dtype), dc.to(c.dtype), None, dh0


_scan_kernel.register_autograd(_scan_backward, setup_context=_scan_setup_context)


def check_scan_inputs(u, dt, A, b, c, cu_seqlens, initial_state, *, check: bool = False) -> None:
    """Shapes, dtypes and devices; with check also cu_seqlens' values, A <= 0 and dt >= 0 (a
    device->host sync each)."""
    check_float("u", u, 3, "[B, T, C]")
    check_float("A", A, 2, "[C, N]")
    B, T, C = u.shape
    N = A.shape[1]
    expected = dict(dt=(B, T, C), A=(C, N), b=(B, T, N), c=(B, T, N))
    for name, x in (("dt", dt), ("A", A), ("b", b), ("c", c)):
        check_float(name, x, len(expected[name]), "[B, T, C]" if name == "dt" else "[C, N]" if name == "A" else "[B, T, N]")
        if tuple(x.shape) != expected[name] or x.device != u.device:
            raise ValueError(f"{name}: expected {list(expected[name])} (of u's B, T, C and A's N) on {u.device}, got {list(x.shape)} on {x.device}")
    check_rows_and_state(cu_seqlens, B, initial_state, (B, C, N), "[B, C, N]", u.device)
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, T, check=check, like=("u", u))
    for name, x, sign, why in (("A", A, 1, "<= 0 (a positive rate grows the state without bound)"), ("dt", dt, -1, ">= 0 (softplus's)")):
        if checking(check, x) and x.numel() and (worst := largest(sign * x.detach())) > 0:  # NaN alone passes: the scan's result shows it
            raise ValueError(f"{name}: expected {why}, got {sign * worst:g}")


def _as_linear_attention(u, dt, A, b, c):
    """selective_scan's arguments as gated_linear_attention's: q = c, k = b over every channel (a
    head each), v = u [B, T, C, 1], g = dt A [B, T, C, N]."""
    B, T, C = u.shape
    N = A.shape[1]
    q, k = (t.float()[:, :, None, :].expand(B, T, C, N) for t in (c, b))
    return q, k, u.float()[..., None], dt.float()[..., None] * A.float()


def selective_scan(u, dt, A, b, c, cu_seqlens=None, *, initial_state=None, final_state: bool = False, chunk_size: int = 64,
                   impl: str = "auto", check: bool = True):
    """Mamba-1's selective scan over packed documents (module docstring).

    Args:
        u: [B, T, C] each token's input to each channel's state (Mamba's convolved x times dt).
        dt: [B, T, C] each token's step per channel (> 0: softplus of its projection).
        A: [C, N] the continuous decay rates (<= 0: Mamba's -exp(A_log)).
        b, c: [B, T, N] the state's write and read vectors, shared by every channel.
        cu_seqlens: None (each batch row one document), or [n + 1] int document bounds 0 ... T
            of the packed documents of the one row (B = 1).
        initial_state: None (zeros), or [B, C, N]: the state before row b's first token.
        final_state: also return the state after each row's last token, [B, C, N] float32.
        chunk_size: the torch path's chunk (fmoe.ops.gated_linear_attention's).
        impl: "auto" (the scan kernels on CUDA, torch elsewhere), "triton" or "torch".
        check: read cu_seqlens, A's largest and dt's smallest value (a device->host sync
            each, skipped under torch.compile): a ValueError unless the bounds start at 0,
            never decrease and end at T, A <= 0 and dt >= 0; False trusts them (fmoe's
            layers: make_batch checked the batch's bounds).
    Returns:
        y [B, T, C] float32, and with final_state the state [B, C, N] float32.

    Example: y = selective_scan(x * dt, dt, -A_log.exp(), b, c, cu_seqlens) + D * x
    """
    check_bools(check=check)  # "no" ran the checks, 0 skipped them
    check_scan_inputs(u, dt, A, b, c, cu_seqlens, initial_state, check=check)
    check_bools(final_state=final_state)
    check_positive_int("chunk_size", chunk_size)  # the torch path's, checked on every path (CUDA's "auto" runs the kernel)
    B, T, C = u.shape
    N = A.shape[1]
    if use_triton(impl, u, dt, A, b, c, initial_state) and T > 0:
        h0 = torch.zeros(B, C, N, device=u.device) if initial_state is None else initial_state.float().contiguous()
        y, hT, _ = _scan_kernel(*(t.float().contiguous() for t in (u, dt, A, b, c)), _starts(cu_seqlens, B, T, u.device), h0)
        return (y, hT) if final_state else y
    state = None if initial_state is None else initial_state[..., None]
    out = gated_linear_attention(*_as_linear_attention(u, dt, A, b, c), cu_seqlens, scale=1.0, initial_state=state, final_state=final_state,
                                 chunk_size=chunk_size, impl=impl, check=False)  # checked above
    return (out[0][..., 0], out[1][..., 0]) if final_state else out[..., 0]


def selective_scan_loop(u, dt, A, b, c, cu_seqlens=None, *, initial_state=None, final_state: bool = False, check: bool = True):
    """selective_scan token by token (gated_linear_attention_loop's form): its definition."""
    check_bools(check=check)
    check_scan_inputs(u, dt, A, b, c, cu_seqlens, initial_state, check=check)
    check_bools(final_state=final_state)
    state = None if initial_state is None else initial_state.float()[..., None]
    out = gated_linear_attention_loop(*_as_linear_attention(u, dt, A, b, c), cu_seqlens, scale=1.0, initial_state=state, final_state=final_state,
                                      check=False)  # checked above
    return (out[0][..., 0], out[1][..., 0]) if final_state else out[..., 0]
