"""Routing: which k experts each token goes to, and with what gate weight (SPEC.md section 1).

    route(logits[T,E], k) -> Routes(weights[T,k] float32, experts[T,k] int64)
    sparsemixer_route(logits[T,E], eps=) -> Routes(weights[T,2], experts[T,2])
    hash_route(logits[T,E], token_ids[T], table[V,k]) -> Routes(weights[T,k], experts[T,k] = table[token_ids])

Selection score s and gate weights w, computed in float32 whatever the logits dtype:

    score="softmax", pre_softmax=False   s = logits          w = softmax over the k chosen logits
    score="softmax", pre_softmax=True    s = softmax(logits) w = s of the chosen, not renormalised
    score="sigmoid"                      s = sigmoid(logits) + expert_bias
                                         w = sigmoid of the chosen / (their sum + 1e-20) if k > 1
    score="sigmoid", bias_on_logits      s = logits + expert_bias (Kolibri-1), w as above
    score="sqrtsoftplus"                 s = sqrt(softplus(logits)) + expert_bias (DeepSeek-V4)
                                         w = sqrt(softplus) of the chosen / (their sum + 1e-20),
                                         for every k (normalize=False: not renormalised)

sqrt(softplus(x)) is taken as sqrt(max(softplus(x), 2^-126)): the same number wherever
softplus(x) is a normal float32 (x > -87.3), and a zero gradient below, where the square
root's would be infinite (softplus of logits [0, 2, -1, 1]: 0.6931, 2.1269, 0.3133, 1.3133;
their square roots 0.8326, 1.4584, 0.5597, 1.1460; top-2 experts (1, 3), weights 0.5600, 0.4400).

With an expert_bias and softmax scoring, s = softmax(logits) + expert_bias (the bias shifts
probabilities, as it shifts sigmoids: ERNIE 4.5's aux-loss-free routing) and the weights
are the same functions of the chosen experts as without one; the softmax over the k chosen
logits is the chosen probabilities renormalised.

Group-limited routing (n_groups=G, topk_groups=g): the score of a group of E/G contiguous
experts is the sum of its top k//g selection scores; only experts of the g best groups can be
chosen. `scale` multiplies the final weights. Slots are ordered by descending selection
score; ties go to the lower expert (and group) index, in the kernels and in the reference.

sparsemixer_route(logits[T,E], eps) is Phi-3.5-MoE's SparseMixer top-2, its deterministic form
(transformers' eval path), round r = 1, 2 over the scores s_r (s_1 = logits, s_2 = logits with
the first choice at -inf):

    e_r = argmax s_r,  m_r = s_r[e_r]
    kept_r = { j : (m_r - logits_j) / max(|logits_j|, m_r) <= 2 eps }
    w_r = softmax of s_r over kept_r, at e_r  (= 1 / sum_{j in kept_r} exp(s_r,j - m_r))

not renormalised; the gradient is the softmax's, the kept sets held fixed. logits [1, 3, 2, 0]
with eps 0.5 keep every expert: experts (1, 2), weights (0.6439, 0.6652); with eps 0.01 only
the chosen ones: weights (1, 1).

drop_by_capacity keeps at most ceil(T*k/E * capacity_factor) slots per expert; a dropped slot
keeps its place with weight 0 and expert -1. split_zero_experts(routes, E) takes the slots
routed past the E computing experts (zero-computation experts, LongCat-Flash's identity
experts) out of the routes: their tokens pass through, times the slot's weight.
random_logits replaces the logits by N(0,1) noise with a straight-through gradient (for
benchmarks).

Legend: T tokens, E experts, K = k slots per token, G groups, GS = E/G experts per group.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fmoe.ops.backend import next_pow2, use_triton
from fmoe.ops.checks import check_bools, check_device, check_expert_ids, check_experts, check_float, check_index, check_no_nan, check_positive_int, checking
from fmoe.ops.dispatch import slot_ranks
from fmoe.ops.topk import NO_ID, NO_KEY, key_score, rows_per_program, sort_desc, sort_key

# scoring modes as ints: one tl.constexpr selects the kernel's branch and one int argument
# of the custom-op schema carries it
SOFTMAX_POST, SOFTMAX_PRE, SIGMOID, SIGMOID_RAW, SQRT_SOFTPLUS, SQRT_SOFTPLUS_RAW = 0, 1, 2, 3, 4, 5  # *_RAW: weights not renormalised
_SIGMOID_EPS = 1e-20
ROUTE_SCORES = ("softmax", "sigmoid", "sqrtsoftplus")  # route's score
SOFTPLUS_FLOOR = 2.0 ** -126  # sqrt(softplus(x)) reads softplus(x) at least this (float32's smallest normal)


def sqrt_softplus(x: torch.Tensor) -> torch.Tensor:
    """sqrt(max(softplus(x), 2^-126)) in x's dtype (DeepSeek-V4's router scores): softplus's
    own value wherever it is a normal float32, and a zero gradient where it is not (the square
    root's would be infinite at 0)."""
    return F.softplus(x).clamp_min(SOFTPLUS_FLOOR).sqrt()


class Routes(NamedTuple):
    """weights[T,k] float32 gate weights; experts[T,k] int64 expert ids (-1: dropped slot)."""

    weights: torch.Tensor
    experts: torch.Tensor


# ----------------------------------------------------------------------------------------
# 1. Reference (the definition of correctness)
# ----------------------------------------------------------------------------------------


def _scores_ref(logits_TE, score_code, expert_bias_E, bias_on_logits=False):
    """(selection score, weight source) in float32."""
    x_TE = logits_TE.float()
    if bias_on_logits:  # sigmoid scoring, the bias added before the (monotone) sigmoid
        return x_TE + expert_bias_E, torch.sigmoid(x_TE)
    if score_code == SOFTMAX_POST and expert_bias_E is None:
        return x_TE, x_TE
    if score_code in (SOFTMAX_POST, SOFTMAX_PRE):
        probs_TE = torch.softmax(x_TE, dim=-1)
        src_TE = x_TE if score_code == SOFTMAX_POST else probs_TE
    elif score_code in (SQRT_SOFTPLUS, SQRT_SOFTPLUS_RAW):
        probs_TE = src_TE = sqrt_softplus(x_TE)
    else:
        probs_TE = src_TE = torch.sigmoid(x_TE)
    return (probs_TE + expert_bias_E if expert_bias_E is not None else probs_TE), src_TE


def _topk_experts_ref(sel_TE, k, n_groups, topk_groups, per_group):
    """Top-k experts of each row [T,k], best first, optionally group-limited (a group's
    score: the sum of its per_group best selection scores)."""
    T, E = sel_TE.shape
    order_TE = sort_desc(sel_TE)
    if n_groups > 1:
        top_TGm = torch.topk(sel_TE.view(T, n_groups, E // n_groups), per_group, dim=-1).values
        group_score_TG = top_TGm[..., 0]
        for i in range(1, per_group):  # summed in descending order, as the kernel does
            group_score_TG = group_score_TG + top_TGm[..., i]
        kept_groups_Tg = sort_desc(group_score_TG)[:, :topk_groups]
        # out of place: vmap batches the result (its in-place form into an unbatched zeros raises)
        kept_TG = torch.zeros(T, n_groups, dtype=torch.int8, device=sel_TE.device).scatter(1, kept_groups_Tg, 1)
        kept_TE = kept_TG.repeat_interleave(E // n_groups, dim=1)
        # experts of kept groups first, each part still in descending-score order
        order_TE = order_TE.gather(1, sort_desc(kept_TE.gather(1, order_TE)))
    return order_TE[:, :k]


def route_ref(logits_TE, k, score_code, n_groups, topk_groups, expert_bias_E, scale, per_group=None, bias_on_logits=False):
    """Plain-torch routing; differentiable w.r.t. the logits through torch autograd.
    per_group: experts summed per group score (None: k // topk_groups); bias_on_logits:
    sigmoid scoring chooses on logits + expert_bias. A row holding a NaN (unchecked) routes
    as if its NaNs were -inf, and its weights are NaN, as in the kernels."""
    nan_TE = logits_TE.isnan()
    nan_T = nan_TE.any(1, keepdim=True)
    logits_TE = torch.where(nan_TE, float("-inf"), logits_TE)
    sel_TE, src_TE = _scores_ref(logits_TE, score_code, expert_bias_E, bias_on_logits)
    per_group = k // topk_groups if per_group is None else per_group
    experts_TK = _topk_experts_ref(sel_TE.detach(), k, n_groups, topk_groups, per_group)
    weights_TK = _chosen_weights(src_TE.gather(1, experts_TK), score_code, scale)
    return Routes(torch.where(nan_T, float("nan"), weights_TK), experts_TK)


def _chosen_weights(chosen_TK, score_code, scale):
    """The gate weights [T, k] from the chosen experts' weight sources (_scores_ref's)."""
    k = chosen_TK.shape[1]
    if score_code == SOFTMAX_POST:
        weights_TK = torch.softmax(chosen_TK, dim=-1)
    elif score_code in (SOFTMAX_PRE, SIGMOID_RAW, SQRT_SOFTPLUS_RAW) or (k == 1 and score_code == SIGMOID):
        weights_TK = chosen_TK
    else:
        weights_TK = chosen_TK / (chosen_TK.sum(dim=-1, keepdim=True) + _SIGMOID_EPS)
    return weights_TK * scale


# ----------------------------------------------------------------------------------------
# 2. Triton kernels
# ----------------------------------------------------------------------------------------


@triton.jit
def sqrt_softplus_tl(x):
    """(sqrt(max(softplus(x), 2^-126)), its derivative) in float32: softplus as max(x, 0) +
    log1p(exp(-|x|)), log1p(u) = log(1 + u) u / ((1 + u) - 1) (exact to rounding where 1 + u
    rounds away u's digits), the derivative sigmoid(x) / (2 s), 0 below the floor."""
    u = tl.exp(-tl.abs(x))
    w = 1.0 + u
    rounded = w == 1.0
    sp = tl.maximum(x, 0.0) + tl.where(rounded, u, tl.log(w) * (u / tl.where(rounded, 1.0, w - 1.0)))
    s = tl.sqrt(tl.maximum(sp, 1.1754943508222875e-38))
    sig = tl.where(x >= 0, 1.0 / w, u / w)  # sigmoid(x) from the same exp(-|x|), never overflowing
    return s, tl.where(sp >= 1.1754943508222875e-38, sig / (2.0 * s), 0.0)


@triton.jit
def _route_fwd_kernel(
    logits_ptr, bias_ptr, weights_ptr, experts_ptr, T, scale,
    E: tl.constexpr, K: tl.constexpr, G: tl.constexpr, GS: tl.constexpr,
    TOPK_GROUPS: tl.constexpr, PER_GROUP: tl.constexpr,
    SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_ON_LOGITS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One pass over BLOCK_T rows of logits: scores, group selection, top-k, weights.

    A row is one flat [BLOCK_E] axis; expert e is in group e // GS, and each group's score is
    taken over the row masked to that group (G static iterations). Every tile is 2-D: a 3-D
    [group, expert] tile reshaped to a row for the top-k computed wrong experts when
    compiled for the H100 (triton 3.6), though right in the interpreter. The group scores
    on a second, 3-D [row, group, expert] tile loaded beside the row (every group in one
    reduction) chose the same experts but took 4.9x longer at DeepSeek-V3's T = 65536 on
    an H200 (770.9 us against 157.3 us; benchmarks/RESULTS.md, 2026-11-28).
    """
    pid = tl.program_id(0)
    rows_T = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    eid_E = tl.arange(0, BLOCK_E)
    row_ok_T = rows_T < T
    live = row_ok_T[:, None] & (eid_E[None, :] < E)
    row_off_T = rows_T.to(tl.int64) * E

    x = tl.load(logits_ptr + row_off_T[:, None] + eid_E[None, :], mask=live, other=0.0).to(tl.float32)
    nan = x != x
    row_nan_T = tl.max(nan.to(tl.int32), axis=1) > 0
    x = tl.where(nan, float("-inf"), x)  # route NaN rows somewhere valid; weights become NaN

    if SCORE == 0 and not HAS_BIAS:  # softmax after top-k: select on raw logits
        sel = x
    elif SCORE <= 1:  # softmax before top-k, or after it with a bias: select on probabilities
        xm = tl.where(live, x, float("-inf"))
        row_max_T = tl.max(xm, axis=1)
        p = tl.exp(xm - row_max_T[:, None])
        p = tl.where(live, p, 0.0)
        row_sum_T = tl.sum(p, axis=1)
        sel = p / row_sum_T[:, None]
    elif BIAS_ON_LOGITS:  # sigmoid, the bias added to the logits: choose on them (the sigmoid is monotone)
        sel = x
    elif SCORE >= 4:  # sqrt(softplus)
        sel, _ = sqrt_softplus_tl(x)
    else:  # sigmoid
        sel = tl.sigmoid(x)
    if HAS_BIAS:  # for selection only
        sel += tl.load(bias_ptr + eid_E, mask=eid_E < E, other=0.0).to(tl.float32)[None, :]
    key = tl.where(live, sort_key(sel), NO_KEY)
    if TOPK_GROUPS < G:
        # group score = sum of the group's top PER_GROUP selection scores, best first
        group_E = eid_E // GS
        g_G = tl.arange(0, BLOCK_G)
        group_key = tl.full([BLOCK_T, BLOCK_G], NO_KEY, tl.int32)
        for g in tl.static_range(G):
            left = tl.where(group_E[None, :] == g, key, NO_KEY)
            group_score_T = tl.zeros([BLOCK_T], dtype=tl.float32)
            for _ in tl.static_range(PER_GROUP):
                best = tl.max(left, axis=1)
                first = tl.min(tl.where(left == best[:, None], eid_E[None, :], NO_ID), axis=1)
                left = tl.where(eid_E[None, :] == first[:, None], NO_KEY, left)
                group_score_T += key_score(best)
            group_key = tl.where(g_G[None, :] == g, sort_key(group_score_T)[:, None], group_key)
        # keep the TOPK_GROUPS best groups (lower group index on ties)
        kept = eid_E[None, :] < 0
        for _ in tl.static_range(TOPK_GROUPS):
            best = tl.max(group_key, axis=1)
            first = tl.min(tl.where(group_key == best[:, None], g_G[None, :], NO_ID), axis=1)
            group_key = tl.where(g_G[None, :] == first[:, None], NO_KEY, group_key)
            kept = kept | (group_E[None, :] == first[:, None])
        key = tl.where(kept, key, NO_KEY)

    # top-k, best first: the max score, then the lowest id holding it
    k_K = tl.arange(0, BLOCK_K)
    w_TK = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    id_TK = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for i in tl.static_range(K):
        best = tl.max(key, axis=1)
        first = tl.min(tl.where(key == best[:, None], eid_E[None, :], NO_ID), axis=1)
        key = tl.where(eid_E[None, :] == first[:, None], NO_KEY, key)
        w_TK = tl.where(k_K[None, :] == i, key_score(best)[:, None], w_TK)
        id_TK = tl.where(k_K[None, :] == i, first[:, None], id_TK)
    w_TK = tl.where(row_ok_T[:, None], w_TK, 0.0)  # a padding row's keys read back as NaN: none in the reductions below

    slot_ok = k_K[None, :] < K
    out_mask = row_ok_T[:, None] & slot_ok
    if HAS_BIAS:  # the weights come from the unbiased scores: read the k chosen logits back
        xk = tl.load(logits_ptr + row_off_T[:, None] + id_TK, mask=out_mask, other=0.0).to(tl.float32)
        if SCORE == 0:
            w_TK = xk
        elif SCORE == 1:  # the probabilities as computed above, at the chosen experts
            w_TK = tl.exp(xk - row_max_T[:, None]) / row_sum_T[:, None]
        elif SCORE >= 4:
            w_TK, _ = sqrt_softplus_tl(xk)
            w_TK = tl.where(slot_ok, w_TK, 0.0)
        else:
            w_TK = tl.where(slot_ok, tl.sigmoid(xk), 0.0)
    if SCORE == 0:
        w_TK = tl.where(slot_ok, w_TK, float("-inf"))
        e = tl.exp(w_TK - tl.max(w_TK, axis=1)[:, None])
        e = tl.where(slot_ok, e, 0.0)
        w_TK = e / tl.sum(e, axis=1)[:, None]
    elif (K > 1 and SCORE == 2) or SCORE == 4:  # sigmoids renormalised when k > 1, sqrt(softplus) always
        w_TK = tl.where(slot_ok, w_TK, 0.0)
        w_TK = w_TK / (tl.sum(w_TK, axis=1)[:, None] + 1e-20)
    w_TK = w_TK * scale
    w_TK = tl.where(row_nan_T[:, None], float("nan"), w_TK)

    out_off = rows_T[:, None].to(tl.int64) * K + k_K[None, :]
    tl.store(weights_ptr + out_off, w_TK, mask=out_mask)
    tl.store(experts_ptr + out_off, id_TK.to(tl.int64), mask=out_mask)


@triton.jit
def _route_bwd_kernel(
    logits_ptr, experts_ptr, grad_w_ptr, grad_logits_ptr, T, scale,
    E: tl.constexpr, K: tl.constexpr, SCORE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """d logits [T,E] from d weights [T,K]: one pass, recomputing the forward's scores."""
    pid = tl.program_id(0)
    rows_T = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok_T = rows_T < T
    k_K = tl.arange(0, BLOCK_K)
    cols_E = tl.arange(0, BLOCK_E)
    kmask = row_ok_T[:, None] & (k_K[None, :] < K)
    koff = rows_T[:, None].to(tl.int64) * K + k_K[None, :]
    id_TK = tl.load(experts_ptr + koff, mask=kmask, other=0).to(tl.int32)
    gw_TK = tl.load(grad_w_ptr + koff, mask=kmask, other=0.0).to(tl.float32) * scale
    row_off = rows_T[:, None].to(tl.int64) * E
    emask = row_ok_T[:, None] & (cols_E[None, :] < E)

    if SCORE == 1:  # weights are softmax(logits) at the chosen experts
        x = tl.load(logits_ptr + row_off + cols_E[None, :], mask=emask, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        p = tl.where(emask, p, 0.0)
        p = p / tl.sum(p, axis=1)[:, None]
        dp = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for i in tl.static_range(K):
            id_i = tl.sum(tl.where(k_K[None, :] == i, id_TK, 0), axis=1)
            g_i = tl.sum(tl.where(k_K[None, :] == i, gw_TK, 0.0), axis=1)
            dp = tl.where(cols_E[None, :] == id_i[:, None], g_i[:, None], dp)
        dl = p * (dp - tl.sum(p * dp, axis=1)[:, None])
    else:
        xk = tl.load(logits_ptr + row_off + id_TK, mask=kmask, other=0.0).to(tl.float32)
        if SCORE == 0:  # softmax over the chosen logits
            xk = tl.where(kmask, xk, float("-inf"))
            e = tl.exp(xk - tl.max(xk, axis=1)[:, None])
            e = tl.where(kmask, e, 0.0)
            w0 = e / tl.sum(e, axis=1)[:, None]
            dk = w0 * (gw_TK - tl.sum(w0 * gw_TK, axis=1)[:, None])
        else:  # sigmoid (2, 3) or sqrt(softplus) (4, 5), normalised over the chosen (2 when K > 1, 4) or raw
            if SCORE >= 4:
                s, dsdx = sqrt_softplus_tl(xk)
                s = tl.where(kmask, s, 0.0)
            else:
                s = tl.where(kmask, tl.sigmoid(xk), 0.0)
                dsdx = s * (1.0 - s)
            ds = gw_TK
            if (K > 1 and SCORE == 2) or SCORE == 4:
                denom = tl.sum(s, axis=1) + 1e-20
                w0 = s / denom[:, None]
                ds = (gw_TK - tl.sum(gw_TK * w0, axis=1)[:, None]) / denom[:, None]
            dk = ds * dsdx
        dl = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for i in tl.static_range(K):
            id_i = tl.sum(tl.where(k_K[None, :] == i, id_TK, 0), axis=1)
            d_i = tl.sum(tl.where(k_K[None, :] == i, dk, 0.0), axis=1)
            dl = tl.where(cols_E[None, :] == id_i[:, None], d_i[:, None], dl)

    tl.store(grad_logits_ptr + row_off + cols_E[None, :], dl.to(grad_logits_ptr.dtype.element_ty), mask=emask)


def _fwd_blocks(E: int, n_groups: int, k: int) -> dict:
    return dict(BLOCK_T=rows_per_program(next_pow2(E)), BLOCK_E=next_pow2(E), BLOCK_G=next_pow2(n_groups), BLOCK_K=next_pow2(k), num_warps=1)


def _bwd_blocks(E: int, k: int) -> dict:
    return dict(BLOCK_T=rows_per_program(next_pow2(E)), BLOCK_E=next_pow2(E), BLOCK_K=next_pow2(k), num_warps=1)


# ----------------------------------------------------------------------------------------
# 3. torch.library registration: opaque to torch.compile, with fake and autograd
# ----------------------------------------------------------------------------------------


@torch.library.custom_op("fmoe::route_fwd", mutates_args=())
def _route_fwd(
    logits: torch.Tensor, k: int, score_code: int, n_groups: int, topk_groups: int,
    expert_bias: Optional[torch.Tensor], scale: float, per_group: int, bias_on_logits: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    T, E = logits.shape
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    experts = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, experts
    meta = _fwd_blocks(E, n_groups, k)
    _route_fwd_kernel[(triton.cdiv(T, meta["BLOCK_T"]),)](
        logits.contiguous(), expert_bias.contiguous() if expert_bias is not None else logits, weights, experts, T, scale,
        E=E, K=k, G=n_groups, GS=E // n_groups, TOPK_GROUPS=topk_groups, PER_GROUP=per_group,
        SCORE=score_code, HAS_BIAS=expert_bias is not None, BIAS_ON_LOGITS=bias_on_logits, **meta,
    )
    return weights, experts


@_route_fwd.register_fake
def _(logits, k, score_code, n_groups, topk_groups, expert_bias, scale, per_group, bias_on_logits):
    T = logits.shape[0]
    return (logits.new_empty(T, k, dtype=torch.float32), logits.new_empty(T, k, dtype=torch.int64))


@torch.library.custom_op("fmoe::route_bwd", mutates_args=())
def _route_bwd(
    grad_weights: torch.Tensor, logits: torch.Tensor, experts: torch.Tensor, score_code: int, scale: float
) -> torch.Tensor:
    T, E = logits.shape
    k = experts.shape[1]
    grad_logits = logits.new_empty(T, E)  # row-major, as the kernel writes it (empty_like would keep a transpose's strides)
    if T == 0:
        return grad_logits
    meta = _bwd_blocks(E, k)
    _route_bwd_kernel[(triton.cdiv(T, meta["BLOCK_T"]),)](
        logits.contiguous(), experts.contiguous(), grad_weights.contiguous(), grad_logits, T, scale,
        E=E, K=k, SCORE=score_code, **meta,
    )
    return grad_logits


@_route_bwd.register_fake
def _(grad_weights, logits, experts, score_code, scale):
    return logits.new_empty(logits.shape)


def _route_setup_context(ctx, inputs, output):
    logits, _k, score_code, *_rest, scale, _per_group, _bias_on_logits = inputs
    ctx.save_for_backward(logits, output[1])
    ctx.score_code, ctx.scale = score_code, scale


def _route_backward(ctx, grad_weights, _grad_experts):
    logits, experts = ctx.saved_tensors
    grad_logits = _route_bwd(grad_weights, logits, experts, ctx.score_code, ctx.scale)
    return grad_logits, None, None, None, None, None, None, None, None


_route_fwd.register_autograd(_route_backward, setup_context=_route_setup_context)


# ----------------------------------------------------------------------------------------
# 4. Public functions
# ----------------------------------------------------------------------------------------


def _check_groups(E, k, n_groups, topk_groups, group_score_topk):
    if n_groups is None and topk_groups is None:
        if group_score_topk is not None:
            raise ValueError("group_score_topk: applies to group-limited routing only (give n_groups and topk_groups)")
        return 1, 1, 1
    if n_groups is None or topk_groups is None:
        raise ValueError("n_groups and topk_groups: give both (group-limited routing) or neither")
    check_positive_int("n_groups", n_groups)
    if E % n_groups != 0:
        raise ValueError(f"n_groups: the {E} experts must split evenly into groups, but {E} % {n_groups} != 0")
    check_positive_int("topk_groups", topk_groups, 1, n_groups)
    if k < topk_groups:
        raise ValueError(f"k: group-limited routing takes at least one expert per kept group, needs k >= topk_groups = {topk_groups}, got k = {k}")
    if topk_groups * (E // n_groups) < k:
        raise ValueError(
            f"k: the {topk_groups} kept groups of {E // n_groups} experts hold "
            f"{topk_groups * (E // n_groups)} experts, fewer than k = {k}"
        )
    if group_score_topk is None:
        return n_groups, topk_groups, k // topk_groups
    check_positive_int("group_score_topk", group_score_topk, 1, E // n_groups)
    return n_groups, topk_groups, group_score_topk


def _score_code(score, pre_softmax: bool, normalize: bool, raw_softmax: str = " (softmax: use pre_softmax=True for unnormalised weights)") -> int:
    """The kernels' scoring mode of route's score, pre_softmax and normalize (checked);
    raw_softmax: what the error of softmax with normalize=False suggests."""
    if score not in ROUTE_SCORES:
        raise ValueError(f"score: expected one of {ROUTE_SCORES}, got {score!r}")
    check_bools(pre_softmax=pre_softmax, normalize=normalize)
    if score != "softmax" and pre_softmax:
        raise ValueError("pre_softmax: applies to score='softmax' only")
    if score == "softmax" and not normalize:
        raise ValueError(f"normalize: applies to score='sigmoid' or 'sqrtsoftplus' only{raw_softmax}")
    if score == "sigmoid":
        return SIGMOID if normalize else SIGMOID_RAW
    if score == "sqrtsoftplus":
        return SQRT_SOFTPLUS if normalize else SQRT_SOFTPLUS_RAW
    return SOFTMAX_PRE if pre_softmax else SOFTMAX_POST


def _check_scale(scale) -> float:
    if scale is None:
        return 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < scale < math.inf):
        raise ValueError(f"scale: expected a positive finite number, got {scale!r}")
    return float(scale)


def route(
    logits: torch.Tensor,
    k: int,
    *,
    score: str = "softmax",
    pre_softmax: bool = False,
    n_groups: Optional[int] = None,
    topk_groups: Optional[int] = None,
    expert_bias: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    check: bool = True,
    impl: str = "auto",
    group_score_topk: Optional[int] = None,
    normalize: bool = True,
    bias_on_logits: bool = False,
) -> Routes:
    """Choose k experts per token and their gate weights (SPEC.md section 1).

    Args:
        logits: [T, E] router logits, float32 / bfloat16 / float16.
        k: experts per token, 1..E.
        score: "softmax", "sigmoid" or "sqrtsoftplus" (DeepSeek-V4's sqrt(softplus(logits)),
            module docstring).
        pre_softmax: softmax scoring only: softmax over all E before the top-k (weights not
            renormalised); the default takes the softmax over the k chosen logits (with
            k = 1 that is weight 1 and no gradient to the router, as Switch-style top-1
            checkpoints define it).
        n_groups, topk_groups: group-limited routing: E/n_groups contiguous experts per
            group, only the topk_groups best groups can be chosen.
        group_score_topk: how many of a group's best selection scores are summed into its
            score: None is k // topk_groups (Megatron Core); DeepSeek-V3's released code and
            Hugging Face sum 2 (the two agree for DeepSeek-V3's k = 8, topk_groups = 4).
        expert_bias: [E] float32: added to the scores to choose the experts, never to the
            weights (aux-loss-free balancing); with softmax scoring to the probabilities
            softmax(logits) (module docstring), whichever pre_softmax.
        scale: multiplies the weights (DeepSeek-V3: 2.5).
        normalize: sigmoid and sqrtsoftplus scoring only: divide the k chosen scores by their
            sum (the default, DeepSeek-V3, DeepSeek-V4; a sigmoid's only when k > 1,
            sqrtsoftplus's at every k: at k = 1 a weight of 1.0, where Megatron keeps
            sqrt(softplus(x)), as normalize=False does); False keeps the raw scores (HF
            norm_topk_prob=False).
        bias_on_logits: sigmoid scoring with an expert_bias only: choose on logits +
            expert_bias instead of sigmoid(logits) + expert_bias (Kolibri-1); the weights are
            the chosen sigmoids all the same.
        check: raise a ValueError on NaN logits or a NaN in expert_bias, and on infinite
            logits whose weights are not finite (+inf under softmax scoring; a device->host
            sync each; skipped under torch.compile). Unchecked NaN rows get NaN weights, never
            finite ones.
        impl: "auto" (Triton on CUDA, torch otherwise), "triton" or "torch".

    Returns:
        Routes(weights [T, k] float32, experts [T, k] int64), slots by descending score.
        Differentiable with respect to logits through the weights.

    Example:
        >>> w, e = route(torch.tensor([[1.0, 3.0, 2.0, 0.0]]), 2)
        >>> e.tolist(), [round(v, 4) for v in w[0].tolist()]
        ([[1, 2]], [0.7311, 0.2689])
    """
    check_float("logits", logits, 2, "[T, E]")
    check_experts("logits", logits)
    E = logits.shape[1]
    check_positive_int("k", k, 1, E)
    code = _score_code(score, pre_softmax, normalize)
    check_bools(bias_on_logits=bias_on_logits)
    if bias_on_logits and (score != "sigmoid" or expert_bias is None):
        raise ValueError(f"bias_on_logits: applies to score='sigmoid' with an expert_bias only (got score={score!r}, "
                         f"expert_bias {'given' if expert_bias is not None else 'None'})")
    groups, kept_groups, per_group = _check_groups(E, k, n_groups, topk_groups, group_score_topk)
    if expert_bias is not None:
        if not isinstance(expert_bias, torch.Tensor) or expert_bias.shape != (E,) or expert_bias.dtype != torch.float32:
            got = f"{tuple(expert_bias.shape)} {expert_bias.dtype}" if isinstance(expert_bias, torch.Tensor) else type(expert_bias).__name__
            raise ValueError(f"expert_bias: expected a float32 tensor of shape ({E},), got {got}")
        check_device("expert_bias", expert_bias, logits.device)
    scale = _check_scale(scale)
    if check:
        check_no_nan("logits", logits)
        if expert_bias is not None and checking(True, expert_bias) and expert_bias.isnan().any():
            raise ValueError(f"expert_bias: contains NaN at experts {expert_bias.isnan().nonzero().flatten().tolist()}; a NaN bias "
                             "cannot rank the experts")

    if use_triton(impl, logits):
        routes = Routes(*_route_fwd(logits, k, code, groups, kept_groups, expert_bias, scale, per_group, bias_on_logits))
    else:
        routes = route_ref(logits, k, code, groups, kept_groups, expert_bias, scale, per_group, bias_on_logits)
    if checking(check, logits):
        _refuse_nonfinite_weights(routes.weights, f"score={score!r}")
    return routes


def _refuse_nonfinite_weights(weights_TK: torch.Tensor, what: str) -> None:
    """ValueError naming the rows where infinite logits gave NaN (or inf) weights (a softmax
    over +inf, or over nothing but -inf): route's, hash_route's and sparsemixer_route's
    check (one device->host sync)."""
    bad = ~torch.isfinite(weights_TK).all(dim=1)
    if bad.any():
        rows = bad.nonzero().flatten()
        raise ValueError(f"logits: infinite logits give non-finite weights under {what} in {rows.numel()} row(s), first at row "
                         f"{int(rows[0])}; clamp the logits (pass check=False to skip this check)")


def hash_route(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    table: torch.Tensor,
    *,
    score: str = "softmax",
    normalize: bool = True,
    scale: Optional[float] = None,
    check: bool = True,
) -> Routes:
    """Hash routing: each token goes to the experts a fixed table names for its token id, the
    router's logits only weighing them (Hash Layers; DeepSeek-V4's first MoE layers, its
    tid2eid).

        experts[t] = table[token_ids[t]]
        weights[t] = route's weights of those experts: score="softmax": the softmax over the
                     k chosen logits; "sigmoid" / "sqrtsoftplus": the chosen scores, divided
                     by their sum (+ 1e-20) with normalize (a sigmoid's only when k > 1); times scale

    route's weights had it chosen the same experts, so a table row of the top-k of some logits
    gives route's Routes exactly. No expert bias (the choice is the table's).

    Args:
        logits: [T, E] router logits, float32 / bfloat16 / float16.
        token_ids: [T] int32 / int64 token ids, each in 0..V-1.
        table: [V, k] int32 / int64: row v the k distinct experts (each in 0..E-1) of token id v.
        score, normalize, scale: as route's.
        check: read token_ids and the rows of the table they pick (one device->host sync;
            skipped under torch.compile) and raise a ValueError on an id out of range, an
            expert out of range or named twice in a row, NaN logits, or infinite logits that
            give non-finite weights (a softmax over +inf, or over the table's experts all -inf).
    Returns:
        Routes(weights [T, k] float32, experts [T, k] int64), the table's order. Differentiable
        with respect to logits through the weights; no gradient to the table.

    Example:
        >>> table = torch.tensor([[0, 1], [3, 2]])
        >>> w, e = hash_route(torch.tensor([[1.0, 3.0, 2.0, 0.0]]), torch.tensor([1]), table)
        >>> e.tolist(), [round(v, 4) for v in w[0].tolist()]
        ([[3, 2]], [0.1192, 0.8808])
    """
    check_float("logits", logits, 2, "[T, E]")
    check_experts("logits", logits)
    T, E = logits.shape
    check_index("token_ids", token_ids, 1, "[T]")
    if token_ids.shape[0] != T:
        raise ValueError(f"token_ids: expected one id per row of logits, [{T}], got {list(token_ids.shape)}")
    check_index("table", table, 2, "[V, k]")
    V, k = table.shape
    if V < 1:
        raise ValueError("table: expected at least one row (a token id's experts), got 0")
    if not 1 <= k <= E:
        raise ValueError(f"table: expected [V, k] with k in 1..{E} (experts per token), got k = {k}")
    for name, t in (("token_ids", token_ids), ("table", table)):
        check_device(name, t, logits.device)
    code = _score_code(score, False, normalize, raw_softmax=" (a softmax over the k chosen logits sums to 1)")
    scale = _check_scale(scale)
    if checking(check, logits, token_ids, table):
        check_no_nan("logits", logits)
        ids = token_ids.detach().cpu()
        if T and (ids.min() < 0 or ids.max() >= V):
            bad = int(ids[(ids < 0) | (ids >= V)][0])
            raise ValueError(f"token_ids: expected ids in 0..{V - 1} (the table's rows), got {bad}")
        rows = table.detach().cpu()[ids.unique().long()] if T else table[:0].cpu()
        if ((rows < 0) | (rows >= E)).any():
            raise ValueError(f"table: expected experts in 0..{E - 1}, got {int(rows[(rows < 0) | (rows >= E)][0])}")
        if k > 1 and (rows.sort(dim=1).values.diff(dim=1) == 0).any():
            raise ValueError("table: expected k distinct experts in each row, got a row naming an expert twice")
    experts_TK = table.index_select(0, token_ids.long()).long()
    src_TK = _scores_ref(logits.gather(1, experts_TK), code, None)[1]  # elementwise scores, or the logits (softmax)
    routes = Routes(_chosen_weights(src_TK, code, scale), experts_TK)
    if checking(check, logits):
        _refuse_nonfinite_weights(routes.weights, f"score={score!r}")
    return routes


def check_sparsemixer_eps(eps) -> float:
    """ValueError unless eps is a finite number >= 0 (SparseMixer's relative gap, halved)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        raise ValueError(f"eps: expected a finite number >= 0, got {eps!r}")
    return float(eps)


def sparsemixer_route(logits: torch.Tensor, *, eps: float, check: bool = True) -> Routes:
    """Phi-3.5-MoE's SparseMixer top-2 routing, deterministic (module docstring): the best
    expert, weighted by the softmax over the experts within a relative gap 2 eps of it; then
    the best of the others, weighted likewise among the others.

    Args:
        logits: [T, E] router logits, E >= 2, float32 / bfloat16 / float16.
        eps: the relative gap's half, >= 0 (config.json's router_jitter_noise: 0.01).
        check: raise a ValueError on NaN logits, or on infinite ones that give non-finite
            weights (+inf, or one finite logit: no second expert to weigh); one device->host
            sync each.
    Returns:
        Routes(weights [T, 2] float32, experts [T, 2] int64), the first choice first.
        Differentiable with respect to logits through the weights (the softmax's gradient
        with the kept sets fixed). Plain torch on every device: a few [T, E] passes, no kernel.
        Training runs this form too: the sampled choice of Phi-3.5-MoE's training (Gumbel
        noise, Heun's third-order gradient) is not built.

    Example:
        >>> w, e = sparsemixer_route(torch.tensor([[1.0, 3.0, 2.0, 0.0]]), eps=0.5)
        >>> e.tolist(), [round(v, 4) for v in w[0].tolist()]
        ([[1, 2]], [0.6439, 0.6652])
    """
    check_float("logits", logits, 2, "[T, E]")
    if logits.shape[1] < 2:
        raise ValueError(f"logits: sparsemixer routing chooses 2 experts, expected E >= 2 columns, got {logits.shape[1]}")
    eps = check_sparsemixer_eps(eps)
    if check:
        check_no_nan("logits", logits)
    logits_TE = logits.float()
    scores_TE, weights, experts = logits_TE, [], []
    for _ in range(2):
        with torch.no_grad():
            best_T1, expert_T1 = scores_TE.max(dim=-1, keepdim=True)
            dropped_TE = (best_T1 - logits_TE) / logits_TE.abs().clamp(min=best_T1) > 2 * eps
        gates_TE = torch.softmax(scores_TE.masked_fill(dropped_TE, -math.inf), dim=-1)
        weights.append(gates_TE.gather(1, expert_T1))
        experts.append(expert_T1)
        scores_TE = logits_TE.scatter(1, expert_T1, -math.inf)  # the second round: the first choice out
    routes = Routes(torch.cat(weights, dim=1), torch.cat(experts, dim=1))
    if checking(check, logits):
        _refuse_nonfinite_weights(routes.weights, "sparsemixer routing")
    return routes


def expert_capacity(n_tokens: int, k: int, n_experts: int, capacity_factor: float) -> int:
    """C = ceil(T k / E * capacity_factor): the slots of one expert that T tokens keep under
    drop_by_capacity (Megatron's get_capacity, SPEC.md section 1); what a capacity-padded
    buffer is sized by."""
    return math.ceil(n_tokens * k / n_experts * capacity_factor)


def _check_routes(routes) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float, experts [T, k] int) of routes, or a ValueError naming what is wrong."""
    if not (isinstance(routes, tuple) and len(routes) == 2):
        raise ValueError("routes: expected Routes(weights, experts)")
    weights_TK, experts_TK = routes
    check_float("routes.weights", weights_TK, 2, "[T, k]")
    check_index("routes.experts", experts_TK, 2, "[T, k]")
    if experts_TK.shape != weights_TK.shape:
        raise ValueError(f"routes: weights {tuple(weights_TK.shape)} and experts {tuple(experts_TK.shape)} differ in shape")
    check_device("routes.experts", experts_TK, weights_TK.device, "routes.weights")
    return weights_TK, experts_TK


def keep_slots(routes: Routes, keep: torch.Tensor) -> Routes:
    """routes with the slots where `keep` ([T, k], or [T, 1] for whole tokens; bool) is
    False dropped: weight 0, expert -1 (what drop_by_capacity drops, and the padding that
    fmoe.layers.moe does not route). Gradients reach the kept weights."""
    weights_TK, experts_TK = routes
    return Routes(torch.where(keep, weights_TK, torch.zeros_like(weights_TK)), torch.where(keep, experts_TK, torch.full_like(experts_TK, -1)))


def split_zero_experts(routes: Routes, n_experts: int) -> tuple[Routes, torch.Tensor]:
    """Take the zero-computation experts' slots out of routes chosen over E computing experts
    and the zero experts after them (ids E, E+1, ...: LongCat-Flash's identity experts, MoE++'s
    copy experts). A zero expert costs no FLOPs: its token passes through unchanged, times
    the slot's weight, so a block's output is experts(x, kept) + identity[:, None] * x.

    Args:
        routes: Routes(weights [T, k] float, experts [T, k] int32/int64), ids -1 (dropped)
            or >= 0 (route's over E + Z logits).
        n_experts: E, the computing experts (ids 0..E-1).
    Returns:
        (kept, identity): kept, Routes of the same shapes and dtypes with every slot of an
        id >= E dropped (weight 0, expert -1, as keep_slots drops; a dropped slot stays
        dropped, its weight 0 too), and identity [T] in the weights' dtype, the sum of
        each token's zero-expert weights (0 where it chose none). Gradients reach every
        weight, through kept or through identity. No device->host sync.

    Example: weights [[0.5, 0.3, 0.2]], experts [[1, 4, 5]], E = 4: kept weights
    [[0.5, 0, 0]], experts [[1, -1, -1]]; identity [0.5].
    """
    weights_TK, experts_TK = _check_routes(routes)
    check_positive_int("n_experts", n_experts)
    zero_TK = experts_TK >= n_experts
    identity_T = torch.where(zero_TK, weights_TK, torch.zeros_like(weights_TK)).sum(dim=-1)
    return keep_slots(routes, (experts_TK >= 0) & ~zero_TK), identity_T


def drop_by_capacity(
    routes: Routes, n_experts: int, capacity_factor: float, *, policy: str = "probs", check: bool = True
) -> Routes:
    """Keep at most ceil(T * k / E * capacity_factor) slots per expert (SPEC.md section 1).

    policy "probs" keeps the slots with the largest weights (ties: earlier token first);
    "position" keeps the earliest tokens. A dropped slot keeps its place in the [T, k]
    tensors with weight 0 and expert -1; slots already at -1 stay dropped. Nothing is
    rerouted. Gradients reach the kept weights. No device->host sync beyond validation.

    Args:
        routes: Routes(weights [T, k] float, experts [T, k] int32/int64).
        n_experts: E.
        capacity_factor: > 0.
        check: raise a ValueError unless the expert ids lie in -1..E-1 (one device->host
            sync; skipped under torch.compile). Unchecked, ids outside it are dropped.
    Returns:
        Routes of the same shapes and dtypes.
    """
    weights_TK, experts_TK = _check_routes(routes)
    check_positive_int("n_experts", n_experts)
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or not (0 < capacity_factor < math.inf):
        raise ValueError(f"capacity_factor: expected a positive finite number, got {capacity_factor!r}")
    if policy not in ("probs", "position"):
        raise ValueError(f"policy: expected 'probs' or 'position', got {policy!r}")
    if checking(check, experts_TK):
        check_expert_ids("routes.experts", experts_TK, n_experts)

    T, k = weights_TK.shape
    # a factor of E or more keeps every slot (at most T k per expert): no huge capacity to overflow the compare
    capacity = T * k if capacity_factor >= n_experts else expert_capacity(T, k, n_experts, capacity_factor)
    # policy "probs": the largest weights first (ties: earlier slot); "position": by token
    order = sort_desc(weights_TK.detach().reshape(-1)) if policy == "probs" else None
    key, rank, _ = slot_ranks(experts_TK, n_experts, order)
    return keep_slots(routes, ((key < n_experts) & (rank < capacity)).view(T, k))


class _RandomLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, generator):
        return torch.randn(logits.shape, dtype=logits.dtype, device=logits.device, generator=generator)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def random_logits(logits: torch.Tensor, *, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Fresh N(0, 1) logits of logits' shape and dtype; the gradient passes through unchanged.

    For benchmarking a model under balanced random routing while keeping the router in the
    autograd graph (SPEC.md section 1).
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise ValueError(f"logits: expected a floating-point tensor, got {getattr(logits, 'dtype', type(logits).__name__)}")
    return _RandomLogits.apply(logits, generator)
