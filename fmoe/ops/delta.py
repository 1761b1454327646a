"""The gated delta rule: the linear attention of Gated DeltaNet (arXiv 2412.06464; Qwen3-Next,
Qwen3.5), over packed documents.

    gated_delta_rule(q[B,T,N,Dk], k[B,T,N,Dk], v[B,T,N,Dv], g[B,T,N], beta[B,T,N],
                     cu_seqlens=None, *, scale=None, initial_state=None,
                     final_state=False, chunk_size=64) -> o[B,T,N,Dv]  (, state[B,N,Dk,Dv])

Each head keeps a state S [Dk, Dv] (float32) over the tokens of a document, t = 1, 2, ...:

    S'_t = exp(g_t) S_{t-1}                 g_t: the log of the decay (Mamba-2's gate; <= 0)
    u_t  = beta_t (v_t - S'_t^T k_t)        the delta rule: replace what S' recalls for k_t
    S_t  = S'_t + k_t u_t^T                  by v_t, with strength beta_t in [0, 1]
    o_t  = S_t^T (scale q_t)                scale: 1/sqrt(Dk) unless given

S_0 = 0 at each document's first token: documents are the rows of the batch, and with
cu_seqlens (B = 1) the packed documents of the one row, so a document's outputs do not
depend on what it is packed with. initial_state[b] is S_0 of row b's first document instead
(a continued sequence: decoding); the final state (final_state=True) is S after row b's
last token. Everything is computed in float32; o is returned in v's dtype.

`gated_delta_rule_loop` is that recurrence token by token: the definition of correctness.
`gated_delta_rule` computes the same in chunks of C = chunk_size tokens (the WY form of
DeltaNet, Yang et al. 2024), in plain torch on every device (torch.compile fuses it; no
Triton kernel yet): inside a chunk, with gamma_i = g_1 + ... + g_i (the chunk's tokens
i = 1..C), Gamma_i = exp(gamma_i), and the state S0 the chunk starts from,

    (I + A) U = beta V - carry beta Gamma K S0,   A_ij = beta_i exp(gamma_i - gamma_j) k_i.k_j  (j < i)
    O = carry Gamma (scale Q) S0 + ((scale Q K^T) * exp(gamma_i - gamma_j))_{j<=i} U
    S_end = carry_C Gamma_C S0 + sum_j exp(gamma_C - gamma_j) k_j u_j^T

with the pairs (i, j) restricted to one document, carry_i = 1 where token i continues the
document S0 belongs to, and the sums in S_end over the chunk's last document. The
triangular solve and every matrix product run for all chunks at once; only the last three
lines, which need S0, run chunk after chunk (T / C small steps). No value is read on the
host: documents come from cu_seqlens on the device, T is padded to a multiple of C with
tokens that neither write nor decay.

Legend: B batch rows, T tokens, N heads, Dk key (and query) dim, Dv value dim, C chunk
tokens, M = T / C chunks.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from fmoe.ops.checks import check_float, check_index, check_positive_int
from fmoe.ops.packed import sequence_ids


def _documents(cu_seqlens: Optional[torch.Tensor], B: int, T: int, device) -> torch.Tensor:
    """[B, T] int64 document ids: cu_seqlens' sequence of each token, or 0 (one per row)."""
    if cu_seqlens is None:
        return torch.zeros(B, T, dtype=torch.int64, device=device)
    return sequence_ids(cu_seqlens.to(device), T)[None].expand(B, T)


def _check(q, k, v, g, beta, cu_seqlens, scale, initial_state) -> float:
    """Shapes, dtypes and devices (no value is read); returns the scale."""
    check_float("q", q, 4, "[B, T, N, Dk]")
    check_float("v", v, 4, "[B, T, N, Dv]")
    B, T, N, Dk = q.shape
    for name, x, shape in (("k", k, (B, T, N, Dk)), ("v", v, (B, T, N, v.shape[-1])), ("g", g, (B, T, N)), ("beta", beta, (B, T, N))):
        check_float(name, x, len(shape), "[B, T, N" + (", Dk]" if name == "k" else ", Dv]" if name == "v" else "]"))
        if tuple(x.shape) != shape:
            raise ValueError(f"{name}: expected shape {list(shape)} (q's B, T, N{', Dk' if name == 'k' else ''}), got {list(x.shape)}")
        if x.device != q.device:
            raise ValueError(f"{name}: expected q's device {q.device}, got {x.device}")
    if cu_seqlens is not None:
        check_index("cu_seqlens", cu_seqlens, 1, "[n_docs + 1]")
        if B != 1:
            raise ValueError(f"cu_seqlens: packed documents need one batch row (B = 1), got B = {B}")
    if initial_state is not None:
        shape = (B, N, Dk, v.shape[-1])
        check_float("initial_state", initial_state, 4, f"[B, N, Dk, Dv] = {list(shape)}")
        if tuple(initial_state.shape) != shape or initial_state.device != q.device:
            raise ValueError(f"initial_state: expected {list(shape)} on {q.device}, got {list(initial_state.shape)} on {initial_state.device}")
    if scale is None:
        return Dk ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        raise ValueError(f"scale: expected a positive number or None (1/sqrt(Dk)), got {scale!r}")
    return float(scale)


def gated_delta_rule_loop(q, k, v, g, beta, cu_seqlens=None, *, scale=None, initial_state=None, final_state: bool = False):
    """The gated delta rule token by token (module docstring): the definition the chunked
    form is tested against, and the cheapest form for a token or two (decoding). Same
    arguments and results as gated_delta_rule."""
    scale = _check(q, k, v, g, beta, cu_seqlens, scale, initial_state)
    B, T, N, Dk = q.shape
    Dv = v.shape[-1]
    q32, k32, v32, g32, beta32 = (x.float() for x in (q, k, v, g, beta))
    doc_BT = _documents(cu_seqlens, B, T, q.device)
    S = torch.zeros(B, N, Dk, Dv, device=q.device) if initial_state is None else initial_state.float()
    outs = []
    for t in range(T):
        if t > 0:  # a new document starts from S = 0 (a product, not a branch on a value)
            S = S * (doc_BT[:, t] == doc_BT[:, t - 1]).float()[:, None, None, None]
        S = S * g32[:, t].exp()[..., None, None]
        recalled = torch.einsum("bnkv,bnk->bnv", S, k32[:, t])
        u = beta32[:, t, :, None] * (v32[:, t] - recalled)
        S = S + k32[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bnkv,bnk->bnv", S, scale * q32[:, t]))
    o = (torch.stack(outs, 1) if outs else v32.new_zeros(B, 0, N, Dv)).to(v.dtype)
    return (o, S) if final_state else o


def gated_delta_rule(q, k, v, g, beta, cu_seqlens=None, *, scale=None, initial_state=None, final_state: bool = False,
                     chunk_size: int = 64):
    """The gated delta rule over packed documents, in chunks (module docstring).

    Args:
        q, k: [B, T, N, Dk] queries and keys (Gated DeltaNet L2-normalises both first).
        v: [B, T, N, Dv] values.
        g: [B, T, N] the log of each token's decay of the state (<= 0).
        beta: [B, T, N] each token's write strength (in [0, 1]: a sigmoid).
        cu_seqlens: None (each batch row one document), or [n + 1] int document bounds
            0 ... T of the packed documents of the one row (B = 1); values not read.
        scale: the queries' scale (None: 1/sqrt(Dk)).
        initial_state: None (zeros), or [B, N, Dk, Dv]: the state before row b's first token.
        final_state: also return the state after each row's last token, [B, N, Dk, Dv] float32.
        chunk_size: C, the tokens per chunk (at most T are used): the work of the parallel
            part grows with C, the T / C sequential steps shrink with it; the result is the
            same up to float32 rounding.
    Returns:
        o [B, T, N, Dv] in v's dtype, and with final_state the state [B, N, Dk, Dv] float32.

    Example: o = gated_delta_rule(q, k, v, -F.softplus(a), torch.sigmoid(b), cu_seqlens)
    """
    scale = _check(q, k, v, g, beta, cu_seqlens, scale, initial_state)
    check_positive_int("chunk_size", chunk_size)
    B, T, N, Dk = q.shape
    Dv = v.shape[-1]
    state_BNKV = torch.zeros(B, N, Dk, Dv, device=q.device) if initial_state is None else initial_state.float()
    if T == 0:
        o = v.new_zeros(B, 0, N, Dv)
        return (o, state_BNKV) if final_state else o
    C = min(chunk_size, T)
    M = -(-T // C)
    pad = M * C - T
    doc_BT = _documents(cu_seqlens, B, T, q.device)
    # padding: the last document's tokens that write nothing (beta 0, k 0) and keep the state (g 0)
    doc_BT = torch.cat([doc_BT, doc_BT[:, -1:].expand(B, pad)], 1)

    def chunks(x, scale_=1.0):  # [B, T, N, ...] float32 -> [B, N, M, C, ...], padded with zeros
        x = x.float() * scale_ if scale_ != 1.0 else x.float()
        x = F.pad(x, (0, 0) * (x.ndim - 2) + (0, pad))
        return x.reshape(B, M, C, *x.shape[2:]).movedim(3, 1)

    q_BNMCK, k_BNMCK, v_BNMCV = chunks(q, scale), chunks(k), chunks(v)
    g_BNMC, beta_BNMC = chunks(g), chunks(beta)
    doc_BMC = doc_BT.reshape(B, M, C)
    prev_BM = torch.cat([doc_BMC[:, :1, 0], doc_BMC[:, :-1, -1]], 1)  # the document each chunk's S0 belongs to
    carry_B1MC = (doc_BMC == prev_BM[..., None]).float()[:, None]  # tokens continuing it
    gamma_BNMC = g_BNMC.cumsum(-1)
    causal_CC = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    pairs_B1MCC = ((doc_BMC[..., :, None] == doc_BMC[..., None, :]) & causal_CC)[:, None]  # j <= i, one document
    # exp(gamma_i - gamma_j) on the pairs, 0 elsewhere (the exponent is masked first: j > i would overflow)
    decay_BNMCC = (gamma_BNMC[..., :, None] - gamma_BNMC[..., None, :]).masked_fill(~pairs_B1MCC, float("-inf")).exp()
    strict_CC = ~torch.eye(C, dtype=torch.bool, device=q.device)
    A_BNMCC = (beta_BNMC[..., None] * (k_BNMCK @ k_BNMCK.transpose(-1, -2)) * decay_BNMCC) * strict_CC
    unit_lower = A_BNMCC + torch.eye(C, device=q.device)
    kbeta_BNMCK = k_BNMCK * beta_BNMC[..., None]
    # U = W_v - W_k S0: the parts of the solve that do not need the state, for every chunk at once
    W_v = torch.linalg.solve_triangular(unit_lower, v_BNMCV * beta_BNMC[..., None], upper=False, unitriangular=True)
    W_k = torch.linalg.solve_triangular(unit_lower, kbeta_BNMCK * (carry_B1MC * gamma_BNMC.exp())[..., None], upper=False, unitriangular=True)
    scores_BNMCC = (q_BNMCK @ k_BNMCK.transpose(-1, -2)) * decay_BNMCC
    q_in_BNMCK = q_BNMCK * (carry_B1MC * gamma_BNMC.exp())[..., None]  # the queries' reach into S0
    last_B1M = (doc_BMC == doc_BMC[..., -1:]).float()[:, None]  # tokens of each chunk's last document
    k_out_BNMCK = k_BNMCK * ((gamma_BNMC[..., -1:] - gamma_BNMC).exp() * last_B1M)[..., None]
    keep_BNM = carry_B1MC[..., -1] * gamma_BNMC[..., -1].exp()  # S0's share of the chunk's end state
    outs = []
    for m in range(M):
        u_BNCV = W_v[:, :, m] - W_k[:, :, m] @ state_BNKV
        outs.append(q_in_BNMCK[:, :, m] @ state_BNKV + scores_BNMCC[:, :, m] @ u_BNCV)
        state_BNKV = keep_BNM[:, :, m, None, None] * state_BNKV + k_out_BNMCK[:, :, m].transpose(-1, -2) @ u_BNCV
    o_BNTV = torch.stack(outs, 2).reshape(B, N, M * C, Dv)[:, :, :T]
    o = o_BNTV.transpose(1, 2).to(v.dtype)
    return (o, state_BNKV) if final_state else o
