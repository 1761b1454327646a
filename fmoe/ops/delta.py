"""The gated delta rule: the linear attention of Gated DeltaNet (arXiv 2412.06464; Qwen3-Next,
Qwen3.5), over packed documents.

    gated_delta_rule(q[B,T,N,Dk], k[B,T,N,Dk], v[B,T,N,Dv], g[B,T,N] or g[B,T,N,Dk], beta[B,T,N],
                     cu_seqlens=None, *, scale=None, initial_state=None,
                     final_state=False, chunk_size=64, impl="auto") -> o[B,T,N,Dv]  (, state[B,N,Dk,Dv])

Each head keeps a state S [Dk, Dv] (float32) over the tokens of a document, t = 1, 2, ...:

    S'_t = exp(g_t) S_{t-1}                 g_t: the log of the decay (Mamba-2's gate; <= 0)
    u_t  = beta_t (v_t - S'_t^T k_t)        the delta rule: replace what S' recalls for k_t
    S_t  = S'_t + k_t u_t^T                  by v_t, with strength beta_t in [0, 1] (or [0, 2])
    o_t  = S_t^T (scale q_t)                scale: 1/sqrt(Dk) unless given

S_0 = 0 at each document's first token: documents are the rows of the batch, and with
cu_seqlens (B = 1) the packed documents of the one row, so a document's outputs do not
depend on what it is packed with. initial_state[b] is S_0 of row b's first document instead
(a continued sequence: decoding); the final state (final_state=True) is S after row b's
last token. Everything is computed in float32; o is returned in v's dtype.

The decay is a head's (g [B, T, N]: Gated DeltaNet) or each key channel's (g [B, T, N, Dk]:
Kimi Delta Attention, KDA, of Kimi Linear): S'_t = diag(exp(g_t)) S_{t-1}, row d of the
state decayed by exp(g_t,d).

Without the delta rule (`gated_linear_attention`: Mamba-2's SSD, MiniMax's lightning
attention, RetNet, GLA) every token writes its key and value whole, u_t = v_t:

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,     o_t = S_t^T (scale q_t)

computed by the same chunks with beta = 1 and A = 0 (no solve, no recall of S0).

`gated_delta_rule_loop` is that recurrence token by token: the definition of correctness
(`gated_linear_attention_loop` without the rule).
`gated_delta_rule` computes the same in chunks of C = chunk_size tokens (the WY form of
DeltaNet, Yang et al. 2024): inside a chunk, with gamma_i = g_1 + ... + g_i (the chunk's tokens
i = 1..C), Gamma_i = exp(gamma_i), and the state S0 the chunk starts from,

    (I + A) U = beta V - carry beta Gamma K S0,   A_ij = beta_i exp(gamma_i - gamma_j) k_i.k_j  (j < i)
    O = carry Gamma (scale Q) S0 + ((scale Q K^T) * exp(gamma_i - gamma_j))_{j<=i} U
    S_end = carry_C Gamma_C S0 + sum_j exp(gamma_C - gamma_j) k_j u_j^T

with the pairs (i, j) restricted to one document, carry_i = 1 where token i continues the
document S0 belongs to, and the sums in S_end over the chunk's last document. With a decay
per key channel, gamma_i is a vector and exp(gamma_i - gamma_j) multiplies channel by channel
inside the dot products (k_i . k_j, q_i . k_j): _pair_sums computes them as matrix products
over halves of blocks, each pair (i, j) scaled through a token r between them
(exp(gamma_i - gamma_r) exp(gamma_r - gamma_j), both factors <= 1: no overflow however fast
the decay), and S0's share of the end state is a diagonal matrix. The
triangular solve and every matrix product run for all chunks at once, in torch; only the
state runs chunk after chunk (T / C steps): on CUDA in one Triton kernel that keeps it in
registers for the whole sequence (and one for its gradient), elsewhere in torch (section
2). No value is read on the host: documents come from cu_seqlens on the device, T is padded
to a multiple of C with tokens that neither write nor decay. A g of -inf (a zero decay: the state
forgotten) is read as LOG_DECAY_FLOOR, whose exp is 0 in float32 too.

Legend: B batch rows, T tokens, N heads, Dk key (and query) dim, Dv value dim, C chunk
tokens, M = T / C chunks.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

import triton
import triton.language as tl

from fmoe.ops.backend import autocast_off, next_pow2, use_triton
from fmoe.ops.checks import check_bools, check_cu_seqlens, check_float, check_positive_int, check_rows_and_state, checking, largest
from fmoe.ops.packed import sequence_ids


# exp(-110) is 0 in float32: the chunks read a log-decay below it (g = -inf, a state forgotten whole) as this,
# the same zero decay, so that their differences gamma_i - gamma_j stay finite (-inf - -inf would be NaN)
LOG_DECAY_FLOOR = -110.0


# ----------------------------------------------------------------------------------------
# 1. Reference: the recurrence token by token
# ----------------------------------------------------------------------------------------


def _documents(cu_seqlens: Optional[torch.Tensor], B: int, T: int, device) -> torch.Tensor:
    """[B, T] int64 document ids: cu_seqlens' sequence of each token, or 0 (one per row)."""
    if cu_seqlens is None:
        return torch.zeros(B, T, dtype=torch.int64, device=device)
    return sequence_ids(cu_seqlens.to(device), T)[None].expand(B, T)


def check_rule_inputs(q, k, v, g, beta, cu_seqlens, scale, initial_state, *, check: bool = False) -> float:
    """Shapes, dtypes and devices; with check also cu_seqlens' values and g <= 0 (a
    device->host sync each: fmoe.ops.checks.check_cu_seqlens); returns the scale. beta None: the linear
    attention without the delta rule (gated_linear_attention)."""
    check_float("q", q, 4, "[B, T, N, Dk]")
    check_float("v", v, 4, "[B, T, N, Dv]")
    B, T, N, Dk = q.shape
    per_channel = isinstance(g, torch.Tensor) and g.ndim == 4  # Kimi Delta Attention's decay
    expected = dict(k=(B, T, N, Dk), v=(B, T, N, v.shape[-1]), g=(B, T, N, Dk) if per_channel else (B, T, N), beta=(B, T, N))
    docs = dict(k="[B, T, N, Dk]", v="[B, T, N, Dv]", g="[B, T, N] or [B, T, N, Dk]", beta="[B, T, N]")
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta))[:None if beta is not None else 3]:  # beta None: no delta rule
        check_float(name, x, len(expected[name]), docs[name])
        if tuple(x.shape) != expected[name]:
            raise ValueError(f"{name}: expected shape {list(expected[name])} ({docs[name]} of q's B, T, N, Dk), got {list(x.shape)}")
        if x.device != q.device:
            raise ValueError(f"{name}: expected q's device {q.device}, got {x.device}")
    check_rows_and_state(cu_seqlens, B, initial_state, (B, N, Dk, v.shape[-1]), "[B, N, Dk, Dv]", q.device)
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, T, check=check, like=("q", q))
    if checking(check, g) and g.numel() and (top := largest(g)) > 0:  # NaN alone passes: the rule's own result shows it
        raise ValueError(f"g: expected the log of each token's decay of the state, <= 0 (above 0 the state grows without bound), "
                         f"got a largest value of {top:g}")
    if scale is None:
        return Dk ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        raise ValueError(f"scale: expected a positive number or None (1/sqrt(Dk)), got {scale!r}")
    return float(scale)


def gated_delta_rule_loop(q, k, v, g, beta, cu_seqlens=None, *, scale=None, initial_state=None, final_state: bool = False,
                          check: bool = True):
    """The gated delta rule token by token (module docstring): the definition the chunked
    form is tested against, and the cheapest form for a token or two (decoding). Same
    arguments and results as gated_delta_rule."""
    check_float("beta", beta, 3, "[B, T, N]")
    return _loop(q, k, v, g, beta, cu_seqlens, scale, initial_state, final_state, check)


@autocast_off
def _loop(q, k, v, g, beta, cu_seqlens, scale, initial_state, final_state: bool, check: bool = True):
    """gated_delta_rule_loop, or gated_linear_attention_loop with beta None."""
    check_bools(check=check)
    scale = check_rule_inputs(q, k, v, g, beta, cu_seqlens, scale, initial_state, check=check)
    check_bools(final_state=final_state)
    B, T, N, Dk = q.shape
    Dv = v.shape[-1]
    q32, k32, v32, g32 = (x.float() for x in (q, k, v, g))
    beta32 = None if beta is None else beta.float()
    doc_BT = _documents(cu_seqlens, B, T, q.device)
    S = torch.zeros(B, N, Dk, Dv, device=q.device) if initial_state is None else initial_state.float()
    outs = []
    for t in range(T):
        if t > 0:  # a new document starts from S = 0 (a product, not a branch on a value)
            S = S * (doc_BT[:, t] == doc_BT[:, t - 1]).float()[:, None, None, None]
        S = S * (g32[:, t].exp()[..., None] if g.ndim == 4 else g32[:, t].exp()[..., None, None])  # per channel: rows of S
        u = v32[:, t] if beta is None else beta32[:, t, :, None] * (v32[:, t] - torch.einsum("bnkv,bnk->bnv", S, k32[:, t]))
        S = S + k32[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bnkv,bnk->bnv", S, scale * q32[:, t]))
    if not outs:
        return _no_tokens(q, k, v, g, beta, S, final_state)
    o = torch.stack(outs, 1).to(v.dtype)
    return (o, S) if final_state else o


def _no_tokens(q, k, v, g, beta, state, final_state: bool):
    """T = 0: the empty output [B, 0, N, Dv] in v's dtype, in the graph of every input (their
    gradients: empty), and with final_state a copy of the state it starts from (never the
    caller's initial_state itself)."""
    none = sum(x.sum() for x in (q, k, v, g, beta) if x is not None)  # 0 over no token, carrying each input's graph
    o = v.new_zeros(v.shape[0], 0, v.shape[2], v.shape[3]) + none.to(v.dtype)
    return (o, state.clone()) if final_state else o


# ----------------------------------------------------------------------------------------
# 2. The state before each chunk: reference and Triton kernels
# ----------------------------------------------------------------------------------------
#
# With the chunks' state-free terms computed for every chunk at once (gated_delta_rule),
# only the state runs chunk after chunk, m = 0 .. M-1, from S_0 = the initial state:
#
#     S_m+1 = keep_m S_m + K_m^T (W_v,m - W_k,m S_m)          [Dk, Dv]   (K: k_out)
#
# and the outputs of every chunk then come at once from the states before them:
# u_m = W_v,m - W_k,m S_m and o_m = Q_m S_m + P_m u_m. The backward of the states, from
# G_m = dL/dS_m's part that does not come through S_m+1 (the outputs', the final state's),
# runs back from m = M - 1 with the total gradient g of S_m+1:
#
#     du_m = K_m g,   g <- G_m + keep_m g - W_k,m^T du_m   (then the total of S_m)
#
# and the rest at once: dW_v,m = du_m, dW_k,m = -du_m S_m^T, dK_m = u_m g_m+1^T,
# dkeep_m = the row sums of S_m * g_m+1 (keep_m: a factor per row of the state, the same for
# every row with a decay per head), dS_0 = g_0. On CUDA each recurrence is one Triton
# kernel, one program per (Dv block, batch row x head), the state's (or its gradient's) [Dk, BV] block
# in registers for the whole sequence, in two row halves when Dk > 64. Its products run on
# the tensor cores in 3xTF32 (each float32 operand as a TF32 part and its remainder: float32
# accuracy, about 1e-6 relative, where a single TF32 product would round to 1e-3).
#
# Without the rule (gated_linear_attention) W_v = V and nothing is recalled: W_k is None, and
# the recurrences lose its terms (the kernels' RULE False): S_m+1 = keep_m S_m + K_m^T V_m and
# g <- G_m + keep_m g, a third fewer products than a zero W_k would cost.


def _states_ref(w_v, w_k, k_out, keep, state0):
    """The states S_0 .. S_M [R, M + 1, Dk, Dv] of the recurrence above, chunk after chunk in
    torch (autograd through it). w_v [R, M, C, Dv], w_k (None: no rule, nothing recalled) and
    k_out [R, M, C, Dk], keep [R, M, Dk] (a factor per row of the state: keep_m S_m =
    diag(keep_m) S_m; the same for every row with a decay per head) float32, state0
    [R, Dk, Dv]; R = batch rows x heads."""
    states = [state0]
    for m in range(w_v.shape[1]):
        s = states[-1]
        u = w_v[:, m] if w_k is None else w_v[:, m] - w_k[:, m] @ s
        states.append(keep[:, m, :, None] * s + k_out[:, m].transpose(-1, -2) @ u)
    return torch.stack(states, 1)


@triton.jit
def _tile(ptr, rows, cols, n_rows, n_cols, row_stride):
    """[len(rows), len(cols)] float32 tile of a row-major matrix, 0 outside n_rows x n_cols."""
    return tl.load(ptr + rows[:, None] * row_stride + cols[None, :], mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)


@triton.jit
def _put(ptr, value, rows, cols, n_rows, n_cols, row_stride):
    tl.store(ptr + rows[:, None] * row_stride + cols[None, :], value, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))


@triton.jit
def _delta_states_fwd_kernel(wv_ptr, wk_ptr, kout_ptr, keep_ptr, s0_ptr, states_ptr, M, C, K, V,
                             BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, TWO: tl.constexpr, RULE: tl.constexpr):
    # keep: a factor per row of the state and chunk
    # a chunk's rows in blocks of BC: S_m+1 = keep S_m + sum over the blocks of K_b^T (W_v,b - W_k,b S_m)
    # (RULE False: no W_k, wk_ptr not read)
    pid_v = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    ka = tl.arange(0, BK)
    kb = BK + tl.arange(0, BK)  # the second half of Dk (TWO)
    v = pid_v * BV + tl.arange(0, BV)
    s_a = _tile(s0_ptr + row * K * V, ka, v, K, V, V)
    _put(states_ptr + row * (M + 1) * K * V, s_a, ka, v, K, V, V)
    if TWO:
        s_b = _tile(s0_ptr + row * K * V, kb, v, K, V, V)
        _put(states_ptr + row * (M + 1) * K * V, s_b, kb, v, K, V, V)
    for m in range(M):
        chunk = row * M + m
        new_a = tl.load(keep_ptr + chunk * K + ka, mask=ka < K, other=0.0)[:, None] * s_a
        if TWO:
            new_b = tl.load(keep_ptr + chunk * K + kb, mask=kb < K, other=0.0)[:, None] * s_b
        for c0 in range(0, C, BC):
            c = c0 + tl.arange(0, BC)
            ck = chunk * C * K
            u = _tile(wv_ptr + chunk * C * V, c, v, C, V, V)
            if RULE:
                u -= tl.dot(_tile(wk_ptr + ck, c, ka, C, K, K), s_a, input_precision="tf32x3")
                if TWO:
                    u -= tl.dot(_tile(wk_ptr + ck, c, kb, C, K, K), s_b, input_precision="tf32x3")
            new_a += tl.dot(tl.trans(_tile(kout_ptr + ck, c, ka, C, K, K)), u, input_precision="tf32x3")
            if TWO:
                new_b += tl.dot(tl.trans(_tile(kout_ptr + ck, c, kb, C, K, K)), u, input_precision="tf32x3")
        out = states_ptr + (chunk + row + 1) * K * V  # S_m+1 of this row: row (M + 1) + m + 1
        s_a = new_a
        _put(out, s_a, ka, v, K, V, V)
        if TWO:
            s_b = new_b
            _put(out, s_b, kb, v, K, V, V)


@triton.jit
def _delta_states_bwd_kernel(wk_ptr, kout_ptr, keep_ptr, dstates_ptr, g_ptr, du_ptr, M, C, K, V,
                             BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, TWO: tl.constexpr, RULE: tl.constexpr):
    pid_v = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    ka = tl.arange(0, BK)
    kb = BK + tl.arange(0, BK)
    v = pid_v * BV + tl.arange(0, BV)
    last = (row * (M + 1) + M) * K * V
    g_a = _tile(dstates_ptr + last, ka, v, K, V, V)
    _put(g_ptr + last, g_a, ka, v, K, V, V)
    if TWO:
        g_b = _tile(dstates_ptr + last, kb, v, K, V, V)
        _put(g_ptr + last, g_b, kb, v, K, V, V)
    for i in range(M):
        m = M - 1 - i
        chunk = row * M + m
        here = (chunk + row) * K * V  # S_m of this row: row (M + 1) + m
        new_a = _tile(dstates_ptr + here, ka, v, K, V, V) + tl.load(keep_ptr + chunk * K + ka, mask=ka < K, other=0.0)[:, None] * g_a
        if TWO:
            new_b = _tile(dstates_ptr + here, kb, v, K, V, V) + tl.load(keep_ptr + chunk * K + kb, mask=kb < K, other=0.0)[:, None] * g_b
        for c0 in range(0, C, BC):  # du_b = K_b g, then g loses W_k,b^T du_b, block by block
            c = c0 + tl.arange(0, BC)
            ck = chunk * C * K
            du = tl.dot(_tile(kout_ptr + ck, c, ka, C, K, K), g_a, input_precision="tf32x3")
            if TWO:
                du += tl.dot(_tile(kout_ptr + ck, c, kb, C, K, K), g_b, input_precision="tf32x3")
            _put(du_ptr + chunk * C * V, du, c, v, C, V, V)
            if RULE:
                new_a -= tl.dot(tl.trans(_tile(wk_ptr + ck, c, ka, C, K, K)), du, input_precision="tf32x3")
                if TWO:
                    new_b -= tl.dot(tl.trans(_tile(wk_ptr + ck, c, kb, C, K, K)), du, input_precision="tf32x3")
        g_a = new_a
        _put(g_ptr + here, g_a, ka, v, K, V, V)
        if TWO:
            g_b = new_b
            _put(g_ptr + here, g_b, kb, v, K, V, V)


def _blocks(C: int, K: int, V: int) -> dict:
    """The kernels' tiles: a chunk's rows in blocks of BC = 32, Dk in one or two halves of BK
    (TWO: Dk > 64), Dv in blocks of BV = 16 (so that the tf32x3 products' operands fit the
    registers: no spill at Dk = 128, benchmarks/kernel_stats.py); every tile at least 16
    wide, tl.dot's least. V does not change them: more Dv, more programs."""
    half = max(16, min(64, next_pow2(K)))
    return dict(BC=max(16, min(32, next_pow2(C))), BK=half, BV=16, TWO=K > half, num_warps=4)


@torch.library.custom_op("fmoe::delta_states", mutates_args=())
def _states_kernel(w_v: torch.Tensor, w_k: Optional[torch.Tensor], k_out: torch.Tensor, keep: torch.Tensor, state0: torch.Tensor) -> torch.Tensor:
    """_states_ref by the forward kernel: [R, M + 1, Dk, Dv] (w_k None: RULE False)."""
    R, M, C, K = k_out.shape
    V = w_v.shape[-1]
    states = w_v.new_empty((R, M + 1, K, V))
    meta = _blocks(C, K, V)
    wk = k_out if w_k is None else w_k  # not read without the rule
    _delta_states_fwd_kernel[(triton.cdiv(V, meta["BV"]), R)](w_v, wk, k_out, keep, state0, states, M, C, K, V, RULE=w_k is not None, **meta)
    return states


def _states_fake(w_v, w_k, k_out, keep, state0):
    """The states' shape [R, M + 1, Dk, Dv] (the kernel's op and the torch path's)."""
    R, M, C, K = k_out.shape
    return w_v.new_empty((R, M + 1, K, w_v.shape[-1]))


_states_kernel.register_fake(_states_fake)


@torch.library.custom_op("fmoe::delta_states_bwd", mutates_args=())
def _states_bwd_kernel(w_k: Optional[torch.Tensor], k_out: torch.Tensor, keep: torch.Tensor, grad_states: torch.Tensor) -> list[torch.Tensor]:
    """The backward kernel's recurrence: (g [R, M + 1, Dk, Dv], the total gradient of every
    state; du [R, M, C, Dv]) (w_k None: RULE False)."""
    R, M, C, K = k_out.shape
    V = grad_states.shape[-1]
    g = torch.empty_like(grad_states)
    du = grad_states.new_empty((R, M, C, V))
    meta = _blocks(C, K, V)
    wk = k_out if w_k is None else w_k  # not read without the rule
    _delta_states_bwd_kernel[(triton.cdiv(V, meta["BV"]), R)](wk, k_out, keep, grad_states, g, du, M, C, K, V, RULE=w_k is not None, **meta)
    return [g, du]


def _states_bwd_fake(w_k, k_out, keep, grad_states):
    """The backward recurrence's shapes: g as grad_states, du [R, M, C, Dv]."""
    R, M, C, _ = k_out.shape
    return [torch.empty_like(grad_states), grad_states.new_empty((R, M, C, grad_states.shape[-1]))]


_states_bwd_kernel.register_fake(_states_bwd_fake)


# The torch path under torch.compile: _states_ref's loop over the M chunks, traced, made a graph
# per chunk count (T / chunk_size rounded up; with fullgraph=True the 9th count failed on the
# recompile limit). As ops of their own, its forward and the backward recurrence (the kernels')
# are opaque to the compiler, M a size like any other.
@torch.library.custom_op("fmoe::delta_states_ref", mutates_args=())
def _states_ref_op(w_v: torch.Tensor, w_k: Optional[torch.Tensor], k_out: torch.Tensor, keep: torch.Tensor, state0: torch.Tensor) -> torch.Tensor:
    """_states_ref as one op (torch.compile's torch path)."""
    return _states_ref(w_v, w_k, k_out, keep, state0)


_states_ref_op.register_fake(_states_fake)


@torch.library.custom_op("fmoe::delta_states_bwd_ref", mutates_args=())
def _states_bwd_ref_op(w_k: Optional[torch.Tensor], k_out: torch.Tensor, keep: torch.Tensor, grad_states: torch.Tensor) -> list[torch.Tensor]:
    """_states_bwd_kernel's recurrence in torch, chunk after chunk from the last: g_M = the
    last state's gradient; du_m = K_m g_m+1, g_m = its own gradient + keep_m g_m+1 - W_k,m^T du_m."""
    M = k_out.shape[1]
    g, du = torch.empty_like(grad_states), grad_states.new_empty((*k_out.shape[:3], grad_states.shape[-1]))
    g[:, M] = grad_states[:, M]
    for m in range(M - 1, -1, -1):
        du[:, m] = k_out[:, m] @ g[:, m + 1]
        g[:, m] = grad_states[:, m] + keep[:, m, :, None] * g[:, m + 1] - (0 if w_k is None else w_k[:, m].transpose(-1, -2) @ du[:, m])
    return [g, du]


_states_bwd_ref_op.register_fake(_states_bwd_fake)


def _states_setup_context(ctx, inputs, output):
    w_v, w_k, k_out, keep, _state0 = inputs
    ctx.save_for_backward(w_v, w_k, k_out, keep, output)


def _states_backward_by(recurrence):
    """The states' backward with the gradient recurrence of the kernels or of torch."""
    def backward(ctx, grad_states):
        w_v, w_k, k_out, keep, states = ctx.saved_tensors  # w_k None without the rule
        g, du = recurrence(w_k, k_out, keep, grad_states.contiguous())
        before, after = states[:, :-1], g[:, 1:]  # S_m and the total gradient of S_m+1, every chunk at once
        u = w_v if w_k is None else w_v - w_k @ before
        grad_w_k = None if w_k is None else -du @ before.transpose(-1, -2)
        return du, grad_w_k, u @ after.transpose(-1, -2), (before * after).sum(-1), g[:, 0]

    return backward


_states_kernel.register_autograd(_states_backward_by(_states_bwd_kernel), setup_context=_states_setup_context)
_states_ref_op.register_autograd(_states_backward_by(_states_bwd_ref_op), setup_context=_states_setup_context)


def _states(w_v, w_k, k_out, keep, state0, impl: str) -> torch.Tensor:
    """The states S_0 .. S_M [R, M + 1, Dk, Dv]: the Triton kernels (use_triton(impl); Dk at
    most 128), else _states_ref (as one op under torch.compile: a graph for every chunk count
    M otherwise). w_k None: no rule."""
    if use_triton(impl, w_v, w_k, k_out, keep, state0) and k_out.shape[-1] <= 128:
        op = _states_kernel
    elif torch.compiler.is_compiling():
        op = _states_ref_op
    else:
        return _states_ref(w_v, w_k, k_out, keep, state0)
    return op(*(None if t is None else t.contiguous() for t in (w_v, w_k, k_out, keep, state0)))


def _pair_sums(x, k, gamma):
    """[..., C, C]: entry (i, j) = sum_d x_i,d k_j,d exp(gamma_i,d - gamma_j,d) for j <= i, 0
    above the diagonal; x, k, gamma [..., C, Dk] float32, gamma non-increasing along C inside
    each document (a chunk's cumulative log-decays, per key channel, restarting at each
    document: the entries of pairs across documents are finite and meaningless, for the
    caller to mask). Exact and without overflow however fast the decay: the chunk, padded to a power of two P, is cut into blocks of s = P, P/2, ..., 2
    tokens; in each block the pairs (i in its right half, j in its left half) are one product
    (x_i exp(gamma_i - gamma_r)) . (k_j exp(gamma_r - gamma_j)), r the right half's first token,
    every exponent <= 0; the diagonal is x_i . k_i. Every pair j < i is in exactly one block's
    halves (the smallest block holding both)."""
    C = x.shape[-2]
    P = next_pow2(C)
    if P != C:  # padded tokens: zero x and k (their pairs are 0), the last gamma (no growth)
        x, k = (F.pad(t, (0, 0, 0, P - C)) for t in (x, k))
        gamma = torch.cat([gamma, gamma[..., -1:, :].expand(*gamma.shape[:-2], P - C, gamma.shape[-1])], -2)
    out = torch.diag_embed((x * k).sum(-1))
    s = P
    while s >= 2:
        n, h = P // s, s // 2
        xs, ks, gs = (t.unflatten(-2, (n, 2, h)) for t in (x, k, gamma))  # [..., n blocks, halves, h, Dk]
        ref = gs[..., 1, :1, :]  # gamma at each right half's first token
        # exponents <= 0 inside a document (j < r <= i); across documents clamped (those entries are masked)
        tile = ((xs[..., 1, :, :] * (gs[..., 1, :, :] - ref).clamp_max(0).exp())
                @ (ks[..., 0, :, :] * (ref - gs[..., 0, :, :]).clamp_max(0).exp()).transpose(-1, -2))
        tile = F.pad(tile, (0, h, h, 0))  # [..., n, s, s]: the tile at (right half, left half) of its block
        eye = torch.eye(n, device=x.device)[:, None, :, None]  # block b's tile on the diagonal block (b, b)
        out = out + (tile.unsqueeze(-2) * eye).flatten(-4, -3).flatten(-2, -1)
        s = h
    return out[..., :C, :C]


# ----------------------------------------------------------------------------------------
# 3. Public function
# ----------------------------------------------------------------------------------------


def gated_delta_rule(q, k, v, g, beta, cu_seqlens=None, *, scale=None, initial_state=None, final_state: bool = False,
                     chunk_size: int = 64, impl: str = "auto", check: bool = True):
    """The gated delta rule over packed documents, in chunks (module docstring).

    Args:
        q, k: [B, T, N, Dk] queries and keys (Gated DeltaNet L2-normalises both first).
        v: [B, T, N, Dv] values.
        g: [B, T, N] the log of each token's decay of the state (<= 0).
        beta: [B, T, N] each token's write strength (in [0, 1]: a sigmoid; in [0, 2]:
            twice one, OLMo Hybrid's negative eigenvalues).
        cu_seqlens: None (each batch row one document), or [n + 1] int document bounds
            0 ... T of the packed documents of the one row (B = 1).
        scale: the queries' scale (None: 1/sqrt(Dk)).
        initial_state: None (zeros), or [B, N, Dk, Dv]: the state before row b's first token.
        final_state: also return the state after each row's last token, [B, N, Dk, Dv] float32.
        chunk_size: C, the tokens per chunk (at most T are used): the work of the parallel
            part grows with C, the T / C sequential steps shrink with it; the result is the
            same up to float32 rounding.
        impl: "auto" (the states' Triton kernels on CUDA, torch elsewhere), "triton" or
            "torch" (fmoe.ops.backend.use_triton); the rest is torch on every device.
        check: read cu_seqlens and g's largest value (a device->host sync each, skipped
            under torch.compile) and raise a ValueError unless the bounds start at 0, never
            decrease and end at T (others gave the rule over no valid packing) and g <= 0;
            False trusts them (fmoe's layers: make_batch checked the batch's bounds).
    Returns:
        o [B, T, N, Dv] in v's dtype, and with final_state the state [B, N, Dk, Dv] float32.

    Example: o = gated_delta_rule(q, k, v, -F.softplus(a), torch.sigmoid(b), cu_seqlens)
    """
    if not isinstance(beta, torch.Tensor):  # None would run gated_linear_attention's rule; a tensor is checked after q
        check_float("beta", beta, 3, "[B, T, N]")
    return _chunked(q, k, v, g, beta, cu_seqlens, scale, initial_state, final_state, chunk_size, impl, check)


def gated_linear_attention(q, k, v, g, cu_seqlens=None, *, scale=None, initial_state=None, final_state: bool = False,
                           chunk_size: int = 64, impl: str = "auto", check: bool = True):
    """Gated linear attention over packed documents, in chunks: the gated delta rule without
    the rule (module docstring), S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t).
    Mamba-2's SSD (q = C, k = B, v = x dt, g = A dt), MiniMax's lightning attention (g a
    constant per head), RetNet and GLA (g per key channel). Arguments and results as
    gated_delta_rule's, without beta.

    Example: o = gated_linear_attention(q, k, v, -slope.expand(1, T, N), cu_seqlens, scale=1.0)
    """
    return _chunked(q, k, v, g, None, cu_seqlens, scale, initial_state, final_state, chunk_size, impl, check)


def gated_linear_attention_loop(q, k, v, g, cu_seqlens=None, *, scale=None, initial_state=None, final_state: bool = False,
                                check: bool = True):
    """gated_linear_attention token by token (gated_delta_rule_loop without the rule): its
    definition, and the cheapest form for a token or two."""
    return _loop(q, k, v, g, None, cu_seqlens, scale, initial_state, final_state, check)


@autocast_off
def _chunked(q, k, v, g, beta, cu_seqlens, scale, initial_state, final_state: bool, chunk_size: int, impl: str, check: bool = True):
    """gated_delta_rule (beta [B, T, N]) or gated_linear_attention (beta None: u = v, no solve)."""
    check_bools(check=check)  # "no" ran the checks, 0 skipped them
    scale = check_rule_inputs(q, k, v, g, beta, cu_seqlens, scale, initial_state, check=check)
    check_bools(final_state=final_state)
    check_positive_int("chunk_size", chunk_size)
    B, T, N, Dk = q.shape
    Dv = v.shape[-1]
    state_BNKV = torch.zeros(B, N, Dk, Dv, device=q.device) if initial_state is None else initial_state.float()
    if T == 0:
        return _no_tokens(q, k, v, g, beta, state_BNKV, final_state)
    C = min(chunk_size, T)
    M = -(-T // C)
    pad = M * C - T
    doc_BT = _documents(cu_seqlens, B, T, q.device)
    # padding: the last document's tokens that write nothing (beta 0, k 0) and keep the state (g 0)
    doc_BT = torch.cat([doc_BT, doc_BT[:, -1:].expand(B, pad)], 1)

    def chunks(x, scale_=1.0):  # [B, T, N, ...] float32 -> [B, N, M, C, ...], padded with zeros
        x = x.float() * scale_ if scale_ != 1.0 else x.float()
        # torch.cat, not F.pad: under torch.compile(dynamic=True) F.pad's backward of a reshaped
        # projection (q, k, v made in the compiled region) failed ("view size is not compatible")
        x = torch.cat([x, x.new_zeros(B, pad, *x.shape[2:])], 1)
        return x.reshape(B, M, C, *x.shape[2:]).movedim(3, 1)

    q_BNMCK, k_BNMCK, v_BNMCV = chunks(q, scale), chunks(k), chunks(v)
    g_BNMC = chunks(g.clamp_min(LOG_DECAY_FLOOR))  # [B, N, M, C, Dk] with a decay per key channel
    doc_BMC = doc_BT.reshape(B, M, C)
    prev_BM = torch.cat([doc_BMC[:, :1, 0], doc_BMC[:, :-1, -1]], 1)  # the document each chunk's S0 belongs to
    carry_B1MC = (doc_BMC == prev_BM[..., None]).float()[:, None]  # tokens continuing it
    causal_CC = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    pairs_B1MCC = ((doc_BMC[..., :, None] == doc_BMC[..., None, :]) & causal_CC)[:, None]  # j <= i, one document
    strict_CC = ~torch.eye(C, dtype=torch.bool, device=q.device)
    last_B1M = (doc_BMC == doc_BMC[..., -1:]).float()[:, None]  # tokens of each chunk's last document
    # gamma: each token's log-decays summed over its own document's tokens in the chunk, up to it (the chunk's first
    # document from the chunk's start): a sum over the pairs. A sum running over the whole chunk gave the pairs' decays,
    # S0's reach and the decay to the chunk's end alike, but a neighbour's strong decay (log-decays of -50 .. -110 a
    # token) shifted a document's gammas by its sum, where float32 lost the document's own small decays (2e-4 relative)
    own_B1MCC = pairs_B1MCC.float()
    if g.ndim == 4:  # per key channel: gamma [B, N, M, C, Dk], the pairs' decays inside the dot products
        gamma = own_B1MCC @ g_BNMC
        kk_BNMCC = None if beta is None else _pair_sums(k_BNMCK, k_BNMCK, gamma)
        scores_BNMCC = _pair_sums(q_BNMCK, k_BNMCK, gamma) * pairs_B1MCC
        reach = carry_B1MC[..., None] * gamma.exp()  # [B, N, M, C, Dk]: S0's decay at each token
        # each token's decay to the chunk's end (the last document's tokens; another's exponent may be > 0: kept finite)
        to_end = (gamma[..., -1:, :] - gamma).clamp_max(0).exp() * last_B1M[..., None]
        keep_BNMK = carry_B1MC[..., -1, None] * gamma[..., -1, :].exp()  # S0's rows' share of the end state
    else:
        gamma = (own_B1MCC @ g_BNMC[..., None]).squeeze(-1)
        # exp(gamma_i - gamma_j) on the pairs, 0 elsewhere (the exponent is masked first: j > i would overflow)
        decay_BNMCC = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~pairs_B1MCC, float("-inf")).exp()
        kk_BNMCC = None if beta is None else (k_BNMCK @ k_BNMCK.transpose(-1, -2)) * decay_BNMCC
        scores_BNMCC = (q_BNMCK @ k_BNMCK.transpose(-1, -2)) * decay_BNMCC
        reach = (carry_B1MC * gamma.exp())[..., None]
        to_end = ((gamma[..., -1:] - gamma).clamp_max(0).exp() * last_B1M)[..., None]
        keep_BNMK = (carry_B1MC[..., -1] * gamma[..., -1].exp())[..., None]  # S0's share of the chunk's end state, every row alike
    if beta is None:  # no rule: U = V, nothing recalled from S0
        W_v, W_k = v_BNMCV, None
    else:
        beta_BNMC = chunks(beta)
        A_BNMCC = beta_BNMC[..., None] * kk_BNMCC * (pairs_B1MCC & strict_CC)
        unit_lower = A_BNMCC + torch.eye(C, device=q.device)
        kbeta_BNMCK = k_BNMCK * beta_BNMC[..., None]
        # U = W_v - W_k S0: the parts of the solve that do not need the state, for every chunk at once
        W_v = torch.linalg.solve_triangular(unit_lower, v_BNMCV * beta_BNMC[..., None], upper=False, unitriangular=True)
        W_k = torch.linalg.solve_triangular(unit_lower, kbeta_BNMCK * reach, upper=False, unitriangular=True)
    q_in_BNMCK = q_BNMCK * reach  # the queries' reach into S0
    k_out_BNMCK = k_BNMCK * to_end
    R = B * N  # rows of the recurrence: batch rows x heads
    w_v, w_k, k_out = (None if t is None else t.reshape(R, M, C, -1) for t in (W_v, W_k, k_out_BNMCK))
    states = _states(w_v, w_k, k_out, keep_BNMK.expand(B, N, M, Dk).reshape(R, M, Dk), state_BNKV.reshape(R, Dk, Dv), impl)
    before = states[:, :-1]  # the state each chunk starts from
    u_RMCV = w_v if beta is None else w_v - w_k @ before
    o_RMCV = q_in_BNMCK.reshape(R, M, C, Dk) @ before + scores_BNMCC.reshape(R, M, C, C) @ u_RMCV
    o = o_RMCV.reshape(B, N, M * C, Dv)[:, :, :T].transpose(1, 2).to(v.dtype, memory_format=torch.contiguous_format).contiguous()  # one copy: o.view works
    state_BNKV = states[:, -1].reshape(B, N, Dk, Dv).contiguous()
    return (o, state_BNKV) if final_state else o
