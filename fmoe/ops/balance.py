"""Load balancing: aux-loss scores, counts, switch / sequence losses, z-loss, expert bias
(SPEC.md section 2).

    aux_scores(logits[T,E], k)          -> scores[T,E] float32, experts[T,k] (unconstrained top-k)
    tokens_per_expert(experts[T,k], E)  -> counts[E] int64 (ids -1 skipped)
    load_balancing_loss(scores, counts, k=, n_tokens=)
        = E / (k * n_tokens^2) * sum_e (sum_t scores[t,e]) * counts[e]      (1 when balanced)
    seq_load_balancing_loss(scores, experts, cu_seqlens, k=)
        = mean_b  E / (k * S_b) * sum_e c[b,e] * mean_{t in b} scores[t,e]
    z_loss(logits) = mean_t logsumexp_e(logits[t,e])^2
    mask_tokens(scores, experts, mask) -> the aux inputs without the tokens where mask is False
    update_expert_bias(bias, counts, rate) = bias + rate * sign(mean(counts) - counts)
    load_stats(counts[E] or [L,E], n_slots) -> {max_over_mean, cv, dropped_fraction}, 0-D or [L]

aux_scores are softmax over all E (score="softmax"), sigmoid / sum of sigmoids
(score="sigmoid") or sqrt(softplus) / its sum (score="sqrtsoftplus", fmoe.ops.routing's
sqrt_softplus); their top-k ignores bias, groups and capacity, as in DeepSeek-V3's f.
The losses are ordinary differentiable scalars; the caller multiplies by its coefficient.
Padding (a token_mask [T] bool, False on tokens that are not routed: fmoe.layers.moe's
token_mask) is left out of every loss: mask_tokens zeroes its scores and drops its slots
(the switch loss then takes n_tokens = the tokens that count), and seq_load_balancing_loss
and z_loss take mask= (each sequence's length and the mean count only the tokens in it).
load_stats are the load metrics a train loop logs, kept as device tensors (no host sync).

Legend: T tokens, E experts, K = k slots per token, B sequences, L layers.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from fmoe.ops.backend import next_pow2, use_triton
from fmoe.ops.checks import check_bools, check_cu_seqlens, check_device, check_experts, check_expert_ids, check_float, check_index, check_positive_int, check_token_mask, checking
from fmoe.ops.packed import sequence_ids
from fmoe.ops.routing import Routes, keep_slots, sqrt_softplus, sqrt_softplus_tl
from fmoe.ops.topk import NO_ID, NO_KEY, rows_per_program, sort_desc, sort_key

AUX_SCORES = ("softmax", "sigmoid", "sqrtsoftplus")  # aux_scores' score, its index the kernels' code

# ----------------------------------------------------------------------------------------
# 1. Reference
# ----------------------------------------------------------------------------------------


def aux_scores_ref(logits_TE, k, score_code):
    """score_code: AUX_SCORES's index of the score (0 softmax, 1 sigmoid, 2 sqrtsoftplus)."""
    x_TE = logits_TE.float()
    if score_code:
        sig_TE = torch.sigmoid(x_TE) if score_code == 1 else sqrt_softplus(x_TE)
        total_T1 = sig_TE.sum(dim=-1, keepdim=True)
        scores_TE = sig_TE / torch.where(total_T1 == 0, 1.0, total_T1)  # all underflowed (logits < -103): zeros, not NaN
    else:
        scores_TE = torch.softmax(x_TE, dim=-1)
    experts_TK = sort_desc(scores_TE.detach())[:, :k]
    return scores_TE, experts_TK


def tokens_per_expert(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """counts[E] int64: slots routed to each expert; ids -1 (dropped) are skipped, and so are
    ids outside 0..E-1, as permute's unchecked ids are dropped slots.

    experts: [T, k] (any shape) int32/int64. No device->host sync.
    """
    if not isinstance(experts, torch.Tensor) or experts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"experts: expected an int32/int64 tensor [T, k], got {getattr(experts, 'dtype', type(experts).__name__)}")
    check_positive_int("n_experts", n_experts)
    flat, kept = _kept_ids(experts, n_experts)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=experts.device)
    return counts.scatter_add(0, flat, kept)  # out of place: vmap batches the result (its in-place form into an unbatched zeros raises)


def _kept_ids(experts: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T k] int64 with those outside 0..E-1 set to 0, kept [T k] int64: 1 where the id
    was inside): what the counts scatter, skipped slots adding 0."""
    flat = experts.reshape(-1).long()
    kept = (flat >= 0) & (flat < n_experts)
    return torch.where(kept, flat, 0), kept.long()


def z_loss_ref(logits_TE):
    return torch.logsumexp(logits_TE.float(), dim=-1).square().mean()


# ----------------------------------------------------------------------------------------
# 2. Triton kernels
# ----------------------------------------------------------------------------------------


@triton.jit
def _aux_fwd_kernel(
    logits_ptr, scores_ptr, experts_ptr, counts_ptr, T,
    E: tl.constexpr, K: tl.constexpr, SCORE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Scores, their top-k and the per-expert counts of that top-k, in one pass (SCORE:
    aux_scores_ref's score_code)."""
    pid = tl.program_id(0)
    rows_T = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols_E = tl.arange(0, BLOCK_E)
    row_ok = rows_T < T
    live = row_ok[:, None] & (cols_E[None, :] < E)
    off = rows_T[:, None].to(tl.int64) * E + cols_E[None, :]
    x = tl.load(logits_ptr + off, mask=live, other=float("-inf")).to(tl.float32)
    if SCORE == 1:
        s = tl.where(live, tl.sigmoid(x), 0.0)
    elif SCORE == 2:
        s, _ = sqrt_softplus_tl(x)
        s = tl.where(live, s, 0.0)
    else:
        s = tl.where(live, tl.exp(x - tl.max(x, axis=1)[:, None]), 0.0)
    total = tl.sum(s, axis=1)
    s = s / tl.where(total == 0, 1.0, total)[:, None]  # every sigmoid underflowed: zeros, not 0 / 0 (a NaN stays)
    tl.store(scores_ptr + off, s, mask=live)

    # top-k by repeated max of the scores' int32 images, lowest id on ties (routing._order)
    key = tl.where(live, sort_key(s), NO_KEY)
    for i in tl.static_range(K):
        best = tl.max(key, axis=1)
        first = tl.min(tl.where(key == best[:, None], cols_E[None, :], NO_ID), axis=1)
        key = tl.where(cols_E[None, :] == first[:, None], NO_KEY, key)
        tl.store(experts_ptr + rows_T.to(tl.int64) * K + i, first.to(tl.int64), mask=row_ok)
    # the chosen lanes are the live ones now NO_KEY; one count reduction over the rows, then
    # one atomic per expert per program: integer adds, so the result is deterministic
    chosen = live & (key == NO_KEY)
    tl.atomic_add(counts_ptr + cols_E, tl.sum(chosen.to(tl.int32), axis=0), mask=cols_E < E)


@triton.jit
def _aux_bwd_kernel(
    logits_ptr, grad_scores_ptr, grad_logits_ptr, T,
    E: tl.constexpr, SCORE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    rows_T = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols_E = tl.arange(0, BLOCK_E)
    live = (rows_T[:, None] < T) & (cols_E[None, :] < E)
    off = rows_T[:, None].to(tl.int64) * E + cols_E[None, :]
    x = tl.load(logits_ptr + off, mask=live, other=float("-inf")).to(tl.float32)
    g = tl.load(grad_scores_ptr + off, mask=live, other=0.0).to(tl.float32)
    if SCORE >= 1:  # q = s / S: ds = (g - sum(g q)) / S, dx = ds s'(x) (the sigmoid's s (1 - s))
        if SCORE == 1:
            sig = tl.where(live, tl.sigmoid(x), 0.0)
            dsdx = sig * (1.0 - sig)
        else:
            sig, dsdx = sqrt_softplus_tl(x)
            sig = tl.where(live, sig, 0.0)
        denom = tl.sum(sig, axis=1)
        denom = tl.where(denom == 0, 1.0, denom)
        q = sig / denom[:, None]
        dx = (g - tl.sum(g * q, axis=1)[:, None]) / denom[:, None] * dsdx
    else:  # p = softmax(x): dx = p (g - sum(g p))
        p = tl.where(live, tl.exp(x - tl.max(x, axis=1)[:, None]), 0.0)
        p = p / tl.sum(p, axis=1)[:, None]
        dx = p * (g - tl.sum(g * p, axis=1)[:, None])
    tl.store(grad_logits_ptr + off, dx.to(grad_logits_ptr.dtype.element_ty), mask=live)


@triton.jit
def _lse_fwd_kernel(logits_ptr, lse_ptr, T, E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    rows_T = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols_E = tl.arange(0, BLOCK_E)
    live = (rows_T[:, None] < T) & (cols_E[None, :] < E)
    x = tl.load(logits_ptr + rows_T[:, None].to(tl.int64) * E + cols_E[None, :], mask=live, other=float("-inf")).to(tl.float32)
    row_max = tl.max(x, axis=1)
    row_max = tl.where((rows_T < T) & (row_max > float("-inf")), row_max, 0.0)  # a row of -inf: lse -inf, as torch's
    lse = row_max + tl.log(tl.sum(tl.exp(x - row_max[:, None]), axis=1))
    lse = tl.where(row_max == float("inf"), row_max, lse)  # a +inf logit: lse +inf, as torch's (not inf - inf)
    tl.store(lse_ptr + rows_T, lse, mask=rows_T < T)


@triton.jit
def _lse_bwd_kernel(
    logits_ptr, lse_ptr, grad_lse_ptr, grad_logits_ptr, T,
    E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    rows_T = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols_E = tl.arange(0, BLOCK_E)
    row_ok = rows_T < T
    live = row_ok[:, None] & (cols_E[None, :] < E)
    off = rows_T[:, None].to(tl.int64) * E + cols_E[None, :]
    x = tl.load(logits_ptr + off, mask=live, other=float("-inf")).to(tl.float32)
    lse = tl.load(lse_ptr + rows_T, mask=row_ok, other=0.0)
    g = tl.load(grad_lse_ptr + rows_T, mask=row_ok, other=0.0).to(tl.float32)
    dx = g[:, None] * tl.exp(x - lse[:, None])
    tl.store(grad_logits_ptr + off, dx.to(grad_logits_ptr.dtype.element_ty), mask=live)


def _row_blocks(E):
    return dict(BLOCK_T=rows_per_program(next_pow2(E)), BLOCK_E=next_pow2(E), num_warps=1)


def _grid_rows(T, E):
    meta = _row_blocks(E)
    return (triton.cdiv(T, meta["BLOCK_T"]),), dict(E=E, **meta)


# ----------------------------------------------------------------------------------------
# 3. torch.library registration
# ----------------------------------------------------------------------------------------


@torch.library.custom_op("fmoe::aux_scores_fwd", mutates_args=())
def _aux_scores_fwd(logits: torch.Tensor, k: int, score_code: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T, E = logits.shape
    scores = torch.empty(T, E, dtype=torch.float32, device=logits.device)
    experts = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    counts = torch.zeros(E, dtype=torch.int32, device=logits.device)
    if T > 0:
        grid, meta = _grid_rows(T, E)
        _aux_fwd_kernel[grid](logits.contiguous(), scores, experts, counts, T, K=k, SCORE=score_code, **meta)
    return scores, experts, counts.long()


@_aux_scores_fwd.register_fake
def _(logits, k, score_code):
    T, E = logits.shape
    return (
        logits.new_empty(T, E, dtype=torch.float32),
        logits.new_empty(T, k, dtype=torch.int64),
        logits.new_empty(E, dtype=torch.int64),
    )


@torch.library.custom_op("fmoe::aux_scores_bwd", mutates_args=())
def _aux_scores_bwd(grad_scores: torch.Tensor, logits: torch.Tensor, score_code: int) -> torch.Tensor:
    grad_logits = logits.new_empty(logits.shape)  # row-major, as the kernel writes it
    T, E = logits.shape
    if T > 0:
        grid, meta = _grid_rows(T, E)
        _aux_bwd_kernel[grid](logits.contiguous(), grad_scores.contiguous(), grad_logits, T, SCORE=score_code, **meta)
    return grad_logits


@_aux_scores_bwd.register_fake
def _(grad_scores, logits, score_code):
    return logits.new_empty(logits.shape)


def _aux_setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.score_code = inputs[2]


def _aux_backward(ctx, grad_scores, _grad_experts, _grad_counts):
    (logits,) = ctx.saved_tensors
    return _aux_scores_bwd(grad_scores, logits, ctx.score_code), None, None


_aux_scores_fwd.register_autograd(_aux_backward, setup_context=_aux_setup_context)


@torch.library.custom_op("fmoe::logsumexp_fwd", mutates_args=())
def _lse_fwd(logits: torch.Tensor) -> torch.Tensor:
    T, E = logits.shape
    lse = torch.empty(T, dtype=torch.float32, device=logits.device)
    if T > 0:
        grid, meta = _grid_rows(T, E)
        _lse_fwd_kernel[grid](logits.contiguous(), lse, T, **meta)
    return lse


@_lse_fwd.register_fake
def _(logits):
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


@torch.library.custom_op("fmoe::logsumexp_bwd", mutates_args=())
def _lse_bwd(grad_lse: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    grad_logits = logits.new_empty(logits.shape)  # row-major, as the kernel writes it
    T, E = logits.shape
    if T > 0:
        grid, meta = _grid_rows(T, E)
        _lse_bwd_kernel[grid](logits.contiguous(), lse, grad_lse.contiguous(), grad_logits, T, **meta)
    return grad_logits


@_lse_bwd.register_fake
def _(grad_lse, logits, lse):
    return logits.new_empty(logits.shape)


def _lse_setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output)


def _lse_backward(ctx, grad_lse):
    logits, lse = ctx.saved_tensors
    return _lse_bwd(grad_lse, logits, lse)


_lse_fwd.register_autograd(_lse_backward, setup_context=_lse_setup_context)


# ----------------------------------------------------------------------------------------
# 4. Public functions
# ----------------------------------------------------------------------------------------


def aux_scores(logits: torch.Tensor, k: int, *, score: str = "softmax", return_counts: bool = False, impl: str = "auto"):
    """Scores and unconstrained top-k experts for the load-balancing losses (SPEC.md 2).

    Args:
        logits: [T, E] router logits (float32 / bfloat16 / float16).
        k: experts per token, 1..E.
        score: "softmax" (softmax over E), "sigmoid" (sigmoid / sum of sigmoids) or
            "sqrtsoftplus" (sqrt(softplus) / its sum; fmoe.ops.routing.sqrt_softplus); a sigmoid row
            whose every value underflowed to 0 (all float32 logits below about -103) scores zeros.
        return_counts: also return counts[E] int64 of the returned top-k (the fused kernel
            computes them in the same pass).
        impl: "auto" (Triton on CUDA, torch otherwise), "triton" or "torch".
    Returns:
        (scores [T, E] float32, differentiable; experts [T, k] int64) and counts when asked.
    """
    check_float("logits", logits, 2, "[T, E]")
    check_experts("logits", logits)
    E = logits.shape[1]
    check_positive_int("k", k, 1, E)
    check_bools(return_counts=return_counts)
    if score not in AUX_SCORES:
        raise ValueError(f"score: expected one of {AUX_SCORES}, got {score!r}")
    code = AUX_SCORES.index(score)
    if use_triton(impl, logits):
        scores, experts, counts = _aux_scores_fwd(logits, k, code)
    else:
        scores, experts = aux_scores_ref(logits, k, code)
        counts = tokens_per_expert(experts, E) if return_counts else None
    return (scores, experts, counts) if return_counts else (scores, experts)


def _check_count_dtype(counts: torch.Tensor) -> None:
    if counts.dtype == torch.bool or counts.is_complex():
        raise ValueError(f"counts: expected int or float counts, got {counts.dtype}")


def _check_scores_counts(scores, counts):
    check_float("scores", scores, 2, "[T, E]")
    check_experts("scores", scores)
    E = scores.shape[1]
    if not isinstance(counts, torch.Tensor) or counts.shape != (E,):
        raise ValueError(f"counts: expected a tensor of shape ({E},), got {getattr(counts, 'shape', type(counts).__name__)}")
    _check_count_dtype(counts)
    check_device("counts", counts, scores.device, "scores")


def load_balancing_loss(
    scores: torch.Tensor, counts: torch.Tensor, *, k: int, n_tokens: Union[int, torch.Tensor]
) -> torch.Tensor:
    """Switch / GShard loss E / (k n^2) * sum_e (sum_t scores[t,e]) * counts[e] (SPEC.md 2).

    Equals 1 under perfect balance. With tokens split over TP/CP ranks pass the group's
    total counts and n_tokens and the local scores: the per-rank losses add up to the
    whole. The global-batch variant passes counts summed over data-parallel ranks and
    micro-batches (and their token total).

    Args:
        scores: [T, E] from aux_scores (differentiable).
        counts: [E] slots per expert (int or float).
        k: slots per token. n_tokens: token count the counts cover: an int >= 1, or a 0-D
            int or float tensor >= 0, whose 0 (every token masked:
            fmoe.ops.balance.mask_tokens, n_tokens = mask.sum(), read on no host) gives 0
            with a zero gradient, as z_loss's mean over no token does. A tensor's value is
            not checked (that would be a device->host sync): one below 0 is the caller's
            error.
    Returns: 0-D float32 tensor.
    """
    _check_scores_counts(scores, counts)
    check_positive_int("k", k, 1, scores.shape[1])
    if isinstance(n_tokens, torch.Tensor):
        if n_tokens.numel() != 1:
            raise ValueError(f"n_tokens: expected an int or a 1-element tensor, got shape {tuple(n_tokens.shape)}")
        if n_tokens.dtype == torch.bool or n_tokens.is_complex():
            raise ValueError(f"n_tokens: expected an int or float tensor (a token count), got {n_tokens.dtype}")
        n = n_tokens.reshape(()).to(device=scores.device, dtype=torch.float32)
    else:
        n = float(check_positive_int("n_tokens", n_tokens))
    E = scores.shape[1]
    weighted = (scores.float().sum(dim=0) * counts.float()).sum() * (E / k)
    if not isinstance(n, torch.Tensor):
        return weighted / (n * n)
    return torch.where(n > 0, weighted / n.clamp(min=1).square(), 0.0)  # no 0/0 (a NaN), forward or backward


def mask_tokens(scores: torch.Tensor, experts: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The aux-loss inputs without the tokens where mask is False (padding): scores [T, E]
    with those rows 0 (differentiable: no gradient reaches them) and experts [T, k] with
    those rows -1 (skipped by every count): each token's row dropped as
    fmoe.ops.routing.keep_slots drops slots. mask: [T] bool. Masking twice changes nothing."""
    if mask is None:
        raise ValueError("mask: expected a bool tensor [T] (True where a token counts), got None")
    check_token_mask("mask", mask, scores.shape[0])
    scores, experts = keep_slots(Routes(scores, experts), mask[:, None])
    return scores, experts


def seq_load_balancing_loss(
    scores: torch.Tensor, experts: torch.Tensor, cu_seqlens: torch.Tensor, *, k: int, check: bool = True,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Sequence-level loss, one term per packed sequence (DeepSeek-V2/V3; SPEC.md 2).

    L_b = E / (k S_b) * sum_e c[b,e] * mean_{t in b} scores[t,e]; the loss is the mean of
    L_b over the non-empty sequences. A fixed-length batch of B rows of S tokens is
    cu_seqlens = [0, S, 2S, ..., B S].

    Args:
        scores: [T, E] float from aux_scores (differentiable).
        experts: [T, k] int ids in -1..E-1 (from aux_scores; -1 skipped).
        cu_seqlens: [B + 1] int32/int64, 0 = c_0 <= c_1 <= ... <= c_B = T.
        check: raise a ValueError unless cu_seqlens' values are as above and the ids lie in
            -1..E-1 (device->host syncs; skipped under torch.compile). Unchecked, ids outside
            it are skipped as -1 is.
        mask: None, or [T] bool, False on tokens left out (padding): S_b counts only the
            tokens of b in the mask, their scores and slots are dropped (mask_tokens), and
            a sequence with none of them is left out of the mean, so the loss equals the
            unmasked loss of the batch without those tokens. (Megatron's padding mask
            differs: one length shared by every row, the micro-batch's valid tokens / B,
            and every row in the mean; without padding the two agree.)
    Returns: 0-D float32 tensor.
    """
    check_float("scores", scores, 2, "[T, E]")
    check_experts("scores", scores)
    T, E = scores.shape
    check_index("experts", experts, 2, "[T, k]")
    check_positive_int("k", k, 1, E)
    if experts.shape != (T, k):
        raise ValueError(f"experts: expected shape ({T}, {k}) to match scores and k, got {tuple(experts.shape)}")
    check_device("experts", experts, scores.device, "scores")
    check_token_mask("mask", mask, T)
    check_cu_seqlens(cu_seqlens, T, check=check, like=("scores", scores))
    if checking(check, experts):
        check_expert_ids("experts", experts, E)
    cu = cu_seqlens.to(device=scores.device, dtype=torch.int64)
    B = cu.numel() - 1
    seq_T = sequence_ids(cu, T)
    if mask is None:
        lengths_B = (cu[1:] - cu[:-1]).float()
    else:
        mask = mask.to(scores.device)
        scores, experts = mask_tokens(scores, experts, mask)
        lengths_B = torch.zeros(B, dtype=torch.float32, device=scores.device).index_add(0, seq_T, mask.float())
    score_sum_BE, counts_BE = sequence_sums(scores, experts, seq_T, B)
    return sequence_loss_from_sums(score_sum_BE, counts_BE, lengths_B, k=k)


def sequence_sums(scores: torch.Tensor, experts: torch.Tensor, seq_T: torch.Tensor, n_seq: int):
    """The two per-sequence sums of the sequence-level loss: score_sum [B, E] float32 (the
    sum of each sequence's scores, differentiable) and counts [B, E] int64 (slots of each
    sequence routed to each expert, -1 and ids outside 0..E-1 skipped); seq_T [T] is each token's sequence in
    [0, B). A caller holding part of the tokens reduces the integer counts over its group
    (fmoe.parallel.seq_load_balancing_loss_split) and keeps the score sums local."""
    E, k = scores.shape[1], experts.shape[1]
    score_sum_BE = torch.zeros(n_seq, E, dtype=torch.float32, device=scores.device).index_add(0, seq_T, scores.float())
    flat_e, kept = _kept_ids(experts, E)
    counts_BE = torch.zeros(n_seq * E, dtype=torch.int64, device=scores.device).scatter_add(0, seq_T.repeat_interleave(k) * E + flat_e, kept)
    return score_sum_BE, counts_BE.view(n_seq, E)


def sequence_loss_from_sums(score_sum_BE, counts_BE, lengths_B, *, k: int) -> torch.Tensor:
    """mean over non-empty sequences b of E / (k S_b^2) sum_e counts[b,e] score_sum[b,e]."""
    E = score_sum_BE.shape[1]
    per_seq_B = (score_sum_BE * counts_BE.float()).sum(dim=1) * (E / k) / lengths_B.clamp(min=1).square()
    nonempty = (lengths_B > 0).sum().clamp(min=1)
    return per_seq_B.sum() / nonempty


def z_loss(logits: torch.Tensor, *, mask: Optional[torch.Tensor] = None, impl: str = "auto") -> torch.Tensor:
    """Router z-loss mean_t (logsumexp_e logits[t,e])^2 (ST-MoE), float32 0-D tensor.

    logits: [T, E], E >= 1, and T >= 1 without a mask (a mean over no token has no value).
    The fused kernel computes the row logsumexp in one pass and its backward
    softmax * 2 lse / T in another. mask: None, or [T] bool: the mean runs over the tokens
    where it is True only (padding left out; 0 when there is none, T = 0 included, with a
    zero gradient), no host sync.
    """
    check_float("logits", logits, 2, "[T, E]")
    check_experts("logits", logits)
    check_token_mask("mask", mask, logits.shape[0])
    if mask is None and logits.shape[0] == 0:
        raise ValueError("logits: z_loss is a mean over tokens and needs T >= 1 (with a mask, none in it gives 0)")
    if mask is not None:
        mask = mask.to(logits.device)
        # the left-out rows read as zeros: their values (padding's -inf rows) reach no gradient
        logits = torch.where(mask[:, None], logits, 0.0)
        lse_T = _lse_fwd(logits) if use_triton(impl, logits) else torch.logsumexp(logits.float(), dim=-1)
        return torch.where(mask, lse_T.square(), 0.0).sum() / mask.sum().clamp(min=1)
    if use_triton(impl, logits):
        return _lse_fwd(logits).square().mean()
    return z_loss_ref(logits)


@torch.no_grad()
def update_expert_bias(
    bias: torch.Tensor, counts: torch.Tensor, rate: float, *, center: bool = False, proportional: bool = False
) -> torch.Tensor:
    """Aux-loss-free balancing step: bias + rate * sign(mean(counts) - counts), float32.

    Overloaded experts (count above the mean) go down, underloaded go up; counts should be
    the actual routing's, summed over every rank and micro-batch of the optimizer step.
    SPEC 2's actual routing is after the capacity drop (tokens_per_expert of fmoe.layers.moe):
    with a capacity_factor the experts at capacity count alike, so a layer that drops many
    slots can look balanced and its bias move little. Megatron Core counts the same slots
    (TopKRouter.routing: its routing map after apply_router_token_dropping), with equal updates.
    center=True subtracts the mean of the update. proportional=True steps by the relative
    error instead of its sign, rate * (mean - counts) / mean: large steps far from balance,
    small ones near it (a proportional controller, where the sign rule always steps by
    rate). A NaN or infinite count (a broken reduction over ranks) makes every expert's
    update NaN rather than leaving the bias as it was: route(check=True) then names the
    NaN bias. Returns a new tensor.

    Example: counts [10, 2, 6, 6], rate 1e-3 -> update [-1e-3, +1e-3, 0, 0]; proportional:
    [-6.67e-4, +6.67e-4, 0, 0].
    """
    if not isinstance(bias, torch.Tensor) or bias.ndim != 1 or bias.dtype != torch.float32:
        raise ValueError(f"bias: expected a 1-D float32 tensor [E], got {getattr(bias, 'dtype', type(bias).__name__)} {tuple(getattr(bias, 'shape', ()))}")
    if not isinstance(counts, torch.Tensor) or counts.shape != bias.shape:
        raise ValueError(f"counts: expected a tensor of shape {tuple(bias.shape)}, got {getattr(counts, 'shape', type(counts).__name__)}")
    _check_count_dtype(counts)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (0 <= rate < math.inf):
        raise ValueError(f"rate: expected a finite number >= 0, got {rate!r}")
    check_bools(center=center, proportional=proportional)
    # float64: counts of 2^24 and more, distinct as integers, would round to one float32 (no step)
    c = counts.to(device=bias.device, dtype=torch.float64)
    mean = c.mean()
    gap = torch.where(mean.isfinite(), mean - c, torch.nan)  # a NaN or infinite count: NaN for all (torch.sign(NaN) is 0: kept below)
    delta = ((gap / mean.clamp(min=1e-9) if proportional else torch.where(gap.isnan(), gap, torch.sign(gap))) * rate).float()
    if center:
        delta = delta - delta.mean()
    return bias + delta


def load_stats(counts: torch.Tensor, n_slots: Union[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Load metrics of the expert counts of one MoE layer [E], or of L layers [L, E].

    With mean = max(mean_e counts, 1e-9) and n = max(n_slots, 1):

        max_over_mean    = max_e counts / mean          1 when balanced
        cv               = std_e counts / mean          population std; 0 when balanced
        dropped_fraction = (n_slots - sum_e counts) / n  slots dropped by capacity; 0 when
                                                        n_slots is 0 (none asked, none dropped)

    Args:
        counts: [E] or [L, E] slots routed to each expert (tokens_per_expert, summed over
            micro-batches and ranks as wanted), int or float, any device.
        n_slots: the slots requested, T * k over the same tokens: an int >= 0, or a 0-D int
            or float tensor >= 0 whose value is not checked (it stays on the device: one
            below 0 is the caller's error).
    Returns:
        {"max_over_mean", "cv", "dropped_fraction"}: float32 tensors on counts' device, 0-D
        for counts [E], [L] for counts [L, E]. Nothing is read on the host.

    Example (SPEC.md 2's counts, 32 slots asked):
        >>> stats = load_stats(torch.tensor([10, 2, 6, 6]), 32)
        >>> [round(float(v), 4) for v in stats.values()]
        [1.6667, 0.4714, 0.25]
    """
    if not isinstance(counts, torch.Tensor) or counts.ndim not in (1, 2) or counts.shape[-1] == 0:
        got = tuple(counts.shape) if isinstance(counts, torch.Tensor) else type(counts).__name__
        raise ValueError(f"counts: expected a tensor [E] or [L, E] with E >= 1, got {got}")
    _check_count_dtype(counts)
    if isinstance(n_slots, torch.Tensor):
        if n_slots.ndim != 0:
            raise ValueError(f"n_slots: expected an int or a 0-D tensor, got shape {tuple(n_slots.shape)}")
        if n_slots.dtype == torch.bool or n_slots.is_complex():
            raise ValueError(f"n_slots: expected an int or float tensor (a slot count), got {n_slots.dtype}")
        n = n_slots.to(device=counts.device)
    else:
        n = torch.tensor(check_positive_int("n_slots", n_slots, 0), device=counts.device)
    # (n_slots - total) / n in float64: exact for integer counts, and half-precision counts are not
    # summed in their own dtype (fp16 counts [10, 10] of 100000 slots gave inf: n itself overflowed)
    counts_f = counts.float()
    mean = counts_f.mean(dim=-1).clamp(min=1e-9)
    return {
        "max_over_mean": counts_f.amax(dim=-1) / mean,
        "cv": counts_f.std(dim=-1, correction=0) / mean,
        "dropped_fraction": ((n.double() - counts.double().sum(dim=-1)) / n.double().clamp(min=1)).float(),
    }
