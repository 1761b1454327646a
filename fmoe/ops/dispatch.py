"""Dispatch: token rows to expert-grouped rows and back (SPEC.md section 3).

    permute(x[T,H], experts[T,K], E, align) -> x_perm[R,H], PermutePlan
    unpermute(y_perm[R,H], plan, weights[T,K] | None) -> y[T,H]

permute gives every kept slot (t, j) (experts[t,j] >= 0; -1 is a dropped slot) one row of
x_perm, x_perm[row_of_slot[t,j]] = x[t]. Rows are grouped by expert in ascending expert
order and, inside an expert, by ascending token index (Megatron's order; two slots of one
token to the same expert by ascending j). With align > 1 each group is padded with zero
rows up to a multiple of align (fp8 grouped GEMMs want 16 or 32):

    counts[e]  = kept slots of expert e
    padded[e]  = ceil(counts[e] / align) * align
    offsets[e] = padded[0] + ... + padded[e]       (group ends: torch._grouped_mm's offs)
    row_of_slot[t,j] = offsets[e] - padded[e] + #{kept slots (t',j') of e before (t,j)}

R, the number of rows, is fixed by the shapes alone, so that nothing waits on the device
for the counts: R = T*K when align == 1 (then R == offsets[-1] unless slots are dropped)
and R = T*K + E*(align - 1) when align > 1 (the most padding E groups can need). Rows past
offsets[-1] are zero rows, like the padding.

    unpermute: y[t] = sum_{j kept} weights[t,j] * y_perm[row_of_slot[t,j]]

in float32, returned in y_perm's dtype (weights None: weight 1). Every output row gathers
its own K rows, so the sums are deterministic (no atomics). Gradients, also gathers:

    d x[t]             = sum_{j kept} d x_perm[row_of_slot[t,j]]      (unpermute, unweighted)
    d y_perm[r]        = weights[t,j] * d y[t]   for the slot (t,j) = slot_of_row[r], else 0
    d weights[t,j]     = <d y[t], y_perm[row_of_slot[t,j]]>  in float32 (0 if dropped)

Legend: T tokens, H hidden, E experts, K = k slots per token, S = T*K flat slots
(slot t*K + j), R rows of x_perm, C chunks of slots (the plan kernels' blocks).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from fmoe.ops.backend import next_pow2, use_triton
from fmoe.ops.checks import check_device, check_expert_ids, check_float, check_index, check_positive_int, checking


class PermutePlan(NamedTuple):
    """Where each slot's row went; shapes from T tokens, K slots, E experts, R rows.

    counts: [E] int64, kept rows per expert (padding not counted).
    offsets: [E] int32, cumulative group ends including padding (torch._grouped_mm's offs).
    row_of_slot: [T, K] int32, the row of x_perm holding slot (t, j); -1 if dropped.
    slot_of_row: [R] int32, the flat slot t*K + j of each row; -1 for padding and rows past
        offsets[-1].
    """

    counts: torch.Tensor
    offsets: torch.Tensor
    row_of_slot: torch.Tensor
    slot_of_row: torch.Tensor


def n_rows(n_tokens: int, k: int, n_experts: int, align: int) -> int:
    """R, the static row count of x_perm: T*K, plus E*(align-1) rows for padding if align > 1."""
    return n_tokens * k if align == 1 else n_tokens * k + n_experts * (align - 1)


# ----------------------------------------------------------------------------------------
# 1. Reference (the definition of correctness)
# ----------------------------------------------------------------------------------------


def slot_ranks(experts: torch.Tensor, n_experts: int, order: Optional[torch.Tensor] = None):
    """Where each of the S = T K flat slots (t K + j) stands among the slots of its expert.

    Args:
        experts: [T, K] (any shape) int expert ids; ids outside 0..E-1 (-1: dropped) count
            as a virtual expert E after the real ones.
        n_experts: E.
        order: [S] a permutation of the slots giving their priority (e.g. by descending
            weight); None: flat order t K + j, i.e. by token.
    Returns:
        key [S] int64 (the expert, or E), rank [S] int64 (the slot's place among its key's
        slots, in `order`), counts [E + 1] int64 (slots per key). A stable sort and
        scatters: no host sync. permute's plan, drop_by_capacity and the capacity layout of
        expert parallelism all place slots by these ranks.
    """
    ids_S = experts.reshape(-1).long()
    E, n = n_experts, ids_S.numel()
    key_S = torch.where((ids_S >= 0) & (ids_S < E), ids_S, E)
    if order is None:
        order = torch.sort(key_S, stable=True).indices
    else:  # by key, and within a key in the given priority
        order = order[torch.sort(key_S[order], stable=True).indices]
    counts = torch.zeros(E + 1, dtype=torch.int64, device=ids_S.device).scatter_add(0, key_S, torch.ones_like(key_S))
    first = torch.cumsum(counts, 0) - counts  # each key's first place in the order
    rank_sorted = torch.arange(n, device=ids_S.device) - first[key_S[order]]
    return key_S, torch.empty_like(rank_sorted).scatter(0, order, rank_sorted), counts


def permute_plan_ref(experts_TK: torch.Tensor, n_experts: int, align: int) -> PermutePlan:
    T, K = experts_TK.shape
    E = n_experts
    device = experts_TK.device
    # by expert, then by token (the stable sort keeps flat order t*K + j); dropped slots
    # (and unchecked ids out of range, as in the kernels) go to the virtual expert E
    key_S, rank_S, counts_all = slot_ranks(experts_TK, E)
    kept_S = key_S < E

    counts_E = counts_all[:E]
    padded_E = (counts_E + align - 1) // align * align
    ends_E = torch.cumsum(padded_E, 0)
    starts_E = ends_E - padded_E
    row_S = torch.where(kept_S, starts_E[key_S.clamp(max=E - 1)] + rank_S, -1)

    R = n_rows(T, K, E, align)
    # dropped slots all write the spare row R, cut off after: no data-dependent indexing
    # (out of place: vmap batches the result, where its in-place form into an unbatched tensor raises)
    slot_of_row = torch.full((R + 1,), -1, dtype=torch.int64, device=device).scatter(
        0, torch.where(kept_S, row_S, R), torch.arange(T * K, device=device))
    return PermutePlan(
        counts_E, ends_E.to(torch.int32), row_S.view(T, K).to(torch.int32), slot_of_row[:R].to(torch.int32)
    )


def permute_ref(x_TH: torch.Tensor, plan: PermutePlan) -> torch.Tensor:
    T, K = plan.row_of_slot.shape
    slot_R = plan.slot_of_row.long()
    # rows of no slot read an appended zero row T; gathered in float32 (exact) so that the
    # backward sums a token's rows in float32, as the kernels do
    tok_R = torch.where(slot_R >= 0, slot_R // max(K, 1), T)  # K = 0: every row is padding
    padded_x = torch.cat([x_TH.float(), x_TH.new_zeros(1, x_TH.shape[1], dtype=torch.float32)])
    return padded_x[tok_R].to(x_TH.dtype)


def unpermute_ref(y_perm_RH: torch.Tensor, plan: PermutePlan, weights_TK: Optional[torch.Tensor]) -> torch.Tensor:
    row_TK = plan.row_of_slot.long()
    kept_TK = row_TK >= 0
    # a dropped slot reads row 0: its row and weight are zeroed before the product, so a
    # non-finite value there reaches neither the output nor a gradient (as in the kernels)
    y_TKH = torch.where(kept_TK[..., None], y_perm_RH[row_TK.clamp(min=0)].float(), 0.0)
    if weights_TK is not None:
        y_TKH = y_TKH * torch.where(kept_TK, weights_TK.float(), 0.0)[..., None]
    return y_TKH.sum(1).to(y_perm_RH.dtype)


# ----------------------------------------------------------------------------------------
# 2. Triton kernels
# ----------------------------------------------------------------------------------------


@triton.jit
def _plan_count_kernel(experts_ptr, hist_ptr, slot_of_row_ptr, S, R, E: tl.constexpr, BLOCK_S: tl.constexpr,
                       BLOCK_E: tl.constexpr):
    """hist[c, e] = slots of chunk c (BLOCK_S flat slots) routed to expert e; and every row of
    slot_of_row set to -1 (grid-stride over R >= S), for the rank kernel to fill the kept ones."""
    chunk = tl.program_id(0)
    i_S = tl.arange(0, BLOCK_S)
    slots_S = chunk * BLOCK_S + i_S
    ids_S = tl.load(experts_ptr + slots_S, mask=slots_S < S, other=-1).to(tl.int32)
    hist_E = tl.histogram(ids_S, BLOCK_E, mask=(ids_S >= 0) & (ids_S < E))
    e_E = tl.arange(0, BLOCK_E)
    tl.store(hist_ptr + chunk * E + e_E, hist_E.to(tl.int32), mask=e_E < E)
    for r0 in range(chunk * BLOCK_S, R, tl.num_programs(0) * BLOCK_S):
        tl.store(slot_of_row_ptr + r0 + i_S, tl.full([BLOCK_S], -1, tl.int32), mask=r0 + i_S < R)


@triton.jit
def _plan_scan_kernel(hist_ptr, counts_ptr, n_chunks, E: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr):
    """In place over hist [C, E]: before[c, e] = slots of e in chunks before c (an exclusive
    scan down each column), and counts[e] (int64) = the column's total. A program per BLOCK_E
    experts, BLOCK_C chunks per step."""
    e_E = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    c_C = tl.arange(0, BLOCK_C)
    carry_E = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, n_chunks, BLOCK_C):
        live = ((c0 + c_C)[:, None] < n_chunks) & (e_E[None, :] < E)
        at = hist_ptr + (c0 + c_C)[:, None] * E + e_E[None, :]
        h_CE = tl.load(at, mask=live, other=0)
        tl.store(at, carry_E[None, :] + tl.cumsum(h_CE, axis=0) - h_CE, mask=live)
        carry_E += tl.sum(h_CE, axis=0)
    tl.store(counts_ptr + e_E, carry_E.to(tl.int64), mask=e_E < E)


@triton.jit
def _padded(counts_ptr, e_E, align, E: tl.constexpr):
    """Expert e's group size in rows: its count rounded up to a multiple of align (0 past E)."""
    n_E = tl.load(counts_ptr + e_E, mask=e_E < E, other=0).to(tl.int32)
    return (n_E + align - 1) // align * align


@triton.jit
def _plan_rank_kernel(
    experts_ptr, before_ptr, counts_ptr, offsets_ptr, row_of_slot_ptr, slot_of_row_ptr, S, align,
    E: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """row of each slot of chunk c = its expert's group start (the padded counts of the
    experts before it) + the expert's slots in earlier chunks (before[c, e]) + its earlier
    slots inside the chunk. Program 0 also writes offsets (the group ends). Integer counts
    only, so the plan does not depend on scheduling."""
    chunk = tl.program_id(0)
    i_S = tl.arange(0, BLOCK_S)
    slots_S = chunk * BLOCK_S + i_S
    live_S = slots_S < S
    ids_S = tl.load(experts_ptr + slots_S, mask=live_S, other=-1).to(tl.int32)
    # unchecked ids >= E (check=False, or under torch.compile) count as dropped: no stray write
    kept_S = (ids_S >= 0) & (ids_S < E)
    # pairwise: slot i counts the slots i' < i of the chunk with its expert
    same_SS = (ids_S[:, None] == ids_S[None, :]) & (i_S[None, :] < i_S[:, None])
    rank_S = tl.sum(same_SS.to(tl.int32), axis=1)
    # the group start of each slot's expert, in BLOCK_E steps over the experts
    start_S = tl.zeros([BLOCK_S], tl.int32)
    e_E = tl.arange(0, BLOCK_E)
    for e0 in range(0, E, BLOCK_E):
        padded_E = _padded(counts_ptr, e0 + e_E, align, E)
        start_S += tl.sum(tl.where((e0 + e_E)[None, :] < ids_S[:, None], padded_E[None, :], 0), axis=1)
    before_S = tl.load(before_ptr + chunk * E + ids_S, mask=kept_S, other=0)
    row_S = tl.where(kept_S, start_S + before_S + rank_S, -1)
    tl.store(row_of_slot_ptr + slots_S, row_S.to(tl.int32), mask=live_S)
    tl.store(slot_of_row_ptr + row_S, slots_S.to(tl.int32), mask=kept_S)
    if chunk == 0:
        end = 0
        for e0 in range(0, E, BLOCK_E):
            padded_E = _padded(counts_ptr, e0 + e_E, align, E)
            tl.store(offsets_ptr + e0 + e_E, end + tl.cumsum(padded_E, axis=0), mask=e0 + e_E < E)
            end += tl.sum(padded_E, axis=0)


@triton.jit
def _permute_rows_kernel(
    src_ptr, slot_of_row_ptr, weights_ptr, y_perm_ptr, dst_ptr, grad_w_ptr, R, H,
    K: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """dst[r] = src[t] for the slot (t, j) of row r, zeros for rows of no slot.

    permute's forward (src = x). WEIGHTED: unpermute's backward (src = d y): the row is
    scaled by weights[t,j], and d weights[t,j] = <d y[t], y_perm[r]> comes from the same
    pass, each slot written by its one row."""
    pid = tl.program_id(0)
    rows_R = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok_R = rows_R < R
    slot_R = tl.load(slot_of_row_ptr + rows_R, mask=row_ok_R, other=-1)
    used_R = slot_R >= 0
    src_off_R = (tl.where(used_R, slot_R, 0) // K).to(tl.int64) * H
    dst_off_R = rows_R.to(tl.int64) * H
    if WEIGHTED:
        w_R = tl.load(weights_ptr + slot_R, mask=used_R, other=0.0).to(tl.float32)
        dot_R = tl.zeros([BLOCK_R], dtype=tl.float32)
    h_H = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        cols_H = h0 + h_H
        col_ok_H = cols_H < H
        src_mask = used_R[:, None] & col_ok_H[None, :]
        v = tl.load(src_ptr + src_off_R[:, None] + cols_H[None, :], mask=src_mask, other=0.0)
        if WEIGHTED:
            g = v.to(tl.float32)
            y = tl.load(y_perm_ptr + dst_off_R[:, None] + cols_H[None, :], mask=src_mask, other=0.0).to(tl.float32)
            dot_R += tl.sum(g * y, axis=1)
            v = g * w_R[:, None]
        tl.store(
            dst_ptr + dst_off_R[:, None] + cols_H[None, :], v.to(dst_ptr.dtype.element_ty),
            mask=row_ok_R[:, None] & col_ok_H[None, :],
        )
    if WEIGHTED:
        tl.store(grad_w_ptr + slot_R, dot_R.to(grad_w_ptr.dtype.element_ty), mask=used_R)


@triton.jit
def _scatter_rows_kernel(
    src_ptr, row_of_slot_ptr, weights_ptr, y_perm_ptr, dst_ptr, grad_w_ptr, T, H,
    K: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """_permute_rows_kernel by token: src[t] is read once and written to the row of each
    of its kept slots (the gather reads it once per slot). Rows of no slot are left to
    _zero_empty_rows_kernel. WEIGHTED as there: the row scaled by weights[t,j], and
    d weights[t,j] = <d y[t], y_perm[row]> (0 for a dropped slot)."""
    pid = tl.program_id(0)
    toks_T = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok_T = toks_T < T
    k_K = tl.arange(0, BLOCK_K)
    if WEIGHTED:
        dot_TK = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    h_H = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        cols_H = h0 + h_H
        col_ok_H = cols_H < H
        v = tl.load(src_ptr + toks_T.to(tl.int64)[:, None] * H + cols_H[None, :], mask=tok_ok_T[:, None] & col_ok_H[None, :], other=0.0)
        for j in tl.static_range(K):
            # the K rows are reloaded per H block (L1 hits) rather than held in registers
            row_T = tl.load(row_of_slot_ptr + toks_T * K + j, mask=tok_ok_T, other=-1)
            kept = (row_T >= 0)[:, None] & col_ok_H[None, :]
            dst_off = row_T.to(tl.int64)[:, None] * H + cols_H[None, :]
            out = v
            if WEIGHTED:
                g = v.to(tl.float32)
                y = tl.load(y_perm_ptr + dst_off, mask=kept, other=0.0).to(tl.float32)
                dot_TK = tl.where(k_K[None, :] == j, dot_TK + tl.sum(g * y, axis=1)[:, None], dot_TK)
                out = g * tl.load(weights_ptr + toks_T * K + j, mask=row_T >= 0, other=0.0).to(tl.float32)[:, None]
            tl.store(dst_ptr + dst_off, out.to(dst_ptr.dtype.element_ty), mask=kept)
    if WEIGHTED:
        tl.store(grad_w_ptr + toks_T[:, None] * K + k_K[None, :], dot_TK.to(grad_w_ptr.dtype.element_ty),
                 mask=tok_ok_T[:, None] & (k_K[None, :] < K))


@triton.jit
def _zero_empty_rows_kernel(slot_of_row_ptr, dst_ptr, R, H, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """dst[r] = 0 for the rows of no slot (padding, dropped slots), the others untouched."""
    rows_R = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    empty_R = tl.load(slot_of_row_ptr + rows_R, mask=rows_R < R, other=0) < 0
    if tl.max(empty_R.to(tl.int32), axis=0) > 0:
        h_H = tl.arange(0, BLOCK_H)
        zeros = tl.zeros([BLOCK_R, BLOCK_H], dtype=dst_ptr.dtype.element_ty)
        for h0 in range(0, H, BLOCK_H):
            cols_H = h0 + h_H
            tl.store(dst_ptr + rows_R.to(tl.int64)[:, None] * H + cols_H[None, :], zeros, mask=empty_R[:, None] & (cols_H < H)[None, :])


@triton.jit
def _unpermute_rows_kernel(
    y_perm_ptr, row_of_slot_ptr, weights_ptr, y_ptr, T, H,
    K: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """y[t] = sum_j weights[t,j] * y_perm[row_of_slot[t,j]] in float32, j in order.

    unpermute's forward; unweighted, permute's backward."""
    pid = tl.program_id(0)
    toks_T = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok_T = toks_T < T
    h_H = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        cols_H = h0 + h_H
        col_ok_H = cols_H < H
        acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):
            # the K indices are reloaded per H block (L1 hits) rather than held in registers
            row_T = tl.load(row_of_slot_ptr + toks_T * K + j, mask=tok_ok_T, other=-1)
            kept_T = row_T >= 0
            y = tl.load(
                y_perm_ptr + row_T.to(tl.int64)[:, None] * H + cols_H[None, :],
                mask=kept_T[:, None] & col_ok_H[None, :], other=0.0,
            ).to(tl.float32)
            if WEIGHTED:
                y = y * tl.load(weights_ptr + toks_T * K + j, mask=kept_T, other=0.0).to(tl.float32)[:, None]
            acc += y
        tl.store(
            y_ptr + toks_T.to(tl.int64)[:, None] * H + cols_H[None, :], acc.to(y_ptr.dtype.element_ty),
            mask=tok_ok_T[:, None] & col_ok_H[None, :],
        )


def _plan_blocks(E: int) -> dict:
    """BLOCK_S slots per chunk. The rank kernel's pairwise tile is BLOCK_S^2: 64 slots on
    4 warps take 47 registers (benchmarks/kernel_stats.py), 128 slots 142; the [S/BLOCK_S, E]
    table of per-chunk counts stays small (1 MB at S = 131072, E = 128). The scan walks it in
    [SCAN_C, SCAN_E] tiles (a program per SCAN_E experts); the rank kernel sums the group
    sizes of the experts before each slot's in [BLOCK_S, RANK_E] tiles."""
    scan_e = min(next_pow2(E), 16)
    return dict(BLOCK_S=64, BLOCK_E=next_pow2(E), SCAN_C=2048 // scan_e, SCAN_E=scan_e, RANK_E=min(next_pow2(E), 32), num_warps=4)


def _row_blocks(H: int) -> dict:
    """A [rows, BLOCK_H] tile of 2048 elements (16 per thread of 4 warps: two 16-byte
    accesses in bf16) and a loop over H; small H packs more rows per program."""
    block_h = min(next_pow2(H), 1024)
    return dict(BLOCK_ROWS=max(1, 2048 // block_h), BLOCK_H=block_h, num_warps=4)


# ----------------------------------------------------------------------------------------
# 3. torch.library registration
# ----------------------------------------------------------------------------------------


@torch.library.custom_op("fmoe::permute_plan", mutates_args=())
def _permute_plan(
    experts: torch.Tensor, n_experts: int, align: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    T, K = experts.shape
    E, S = n_experts, T * K
    device = experts.device
    R = n_rows(T, K, E, align)
    if S == 0:  # no slot: empty groups, every row padding
        zeros = torch.zeros(E, dtype=torch.int64, device=device)
        return zeros, zeros.int(), torch.empty(T, K, dtype=torch.int32, device=device), torch.full((R,), -1, dtype=torch.int32, device=device)
    meta = _plan_blocks(E)
    n_chunks = triton.cdiv(S, meta["BLOCK_S"])
    experts = experts.contiguous()
    # three launches, nothing between them: per-chunk counts (and slot_of_row set to -1), an
    # exclusive scan of them down the chunks in place (and the totals), then each slot's row
    hist_CE = torch.empty(n_chunks, E, dtype=torch.int32, device=device)
    counts_E = torch.empty(E, dtype=torch.int64, device=device)
    offsets_E = torch.empty(E, dtype=torch.int32, device=device)
    row_of_slot = torch.empty(T, K, dtype=torch.int32, device=device)
    slot_of_row = torch.empty(R, dtype=torch.int32, device=device)
    warps = meta["num_warps"]
    _plan_count_kernel[(n_chunks,)](
        experts, hist_CE, slot_of_row, S, R, E=E, BLOCK_S=meta["BLOCK_S"], BLOCK_E=meta["BLOCK_E"], num_warps=warps
    )
    _plan_scan_kernel[(triton.cdiv(E, meta["SCAN_E"]),)](
        hist_CE, counts_E, n_chunks, E=E, BLOCK_C=meta["SCAN_C"], BLOCK_E=meta["SCAN_E"], num_warps=warps
    )
    _plan_rank_kernel[(n_chunks,)](
        experts, hist_CE, counts_E, offsets_E, row_of_slot, slot_of_row, S, align,
        E=E, BLOCK_S=meta["BLOCK_S"], BLOCK_E=meta["RANK_E"], num_warps=warps,
    )
    return counts_E, offsets_E, row_of_slot, slot_of_row


@_permute_plan.register_fake
def _(experts, n_experts, align):
    T, K = experts.shape
    return (
        experts.new_empty(n_experts, dtype=torch.int64),
        experts.new_empty(n_experts, dtype=torch.int32),
        experts.new_empty(T, K, dtype=torch.int32),
        experts.new_empty(n_rows(T, K, n_experts, align), dtype=torch.int32),
    )


# How the rows of x_perm are filled: "scatter" (_scatter_rows_kernel: a program per block of
# tokens, x read once, then _zero_empty_rows_kernel) or "gather" (_permute_rows_kernel: a
# program per block of rows, each reading its token's row: x is read K times). Both give the
# same bits. On an H100 the scatter filled the rows at 87% of the copy bandwidth, the gather
# at 59%, and the MoE layer's forward and backward took 2% less (bench_moe_layer,
# benchmarks/RESULTS.md, three runs): the default.
PERMUTE_BY = "scatter"


def _launch_permute_rows(src, slot_of_row, K, weights=None, y_perm=None, row_of_slot=None):
    """dst [R, H] in src's dtype (weighted: in y_perm's, and d weights [T, K]) from src [T, H]."""
    R, H = slot_of_row.shape[0], src.shape[1]
    weighted = weights is not None
    dst = src.new_empty(R, H, dtype=y_perm.dtype if weighted else src.dtype)
    # dropped slots have no row to write their d weights: they stay 0
    grad_w = torch.zeros(weights.shape, dtype=weights.dtype, device=weights.device) if weighted else None
    if PERMUTE_BY not in ("gather", "scatter"):
        raise ValueError(f"fmoe.ops.dispatch.PERMUTE_BY: expected 'gather' or 'scatter', got {PERMUTE_BY!r}")
    if not (R and H):
        return dst, grad_w
    meta = _row_blocks(H)
    rows = meta.pop("BLOCK_ROWS")
    # unweighted, the weights, y_perm and d weights pointers are unused: any tensor will do
    extra = (weights.contiguous(), y_perm.contiguous(), grad_w) if weighted else (src, src, dst)
    if PERMUTE_BY == "scatter":
        T = src.shape[0]
        _scatter_rows_kernel[(triton.cdiv(T, rows),)](
            src.contiguous(), row_of_slot.contiguous(), extra[0], extra[1], dst, extra[2], T, H,
            K=K, WEIGHTED=weighted, BLOCK_T=rows, BLOCK_K=next_pow2(K), **meta,
        )
        zero_rows = 64
        _zero_empty_rows_kernel[(triton.cdiv(R, zero_rows),)](slot_of_row.contiguous(), dst, R, H, BLOCK_R=zero_rows, BLOCK_H=min(next_pow2(H), 64))
    else:
        _permute_rows_kernel[(triton.cdiv(R, rows),)](
            src.contiguous(), slot_of_row.contiguous(), extra[0], extra[1], dst, extra[2], R, H,
            K=K, WEIGHTED=weighted, BLOCK_R=rows, **meta,
        )
    return dst, grad_w


def _launch_unpermute_rows(y_perm, row_of_slot, weights):
    T, K = row_of_slot.shape
    H = y_perm.shape[1]
    y = torch.empty(T, H, dtype=y_perm.dtype, device=y_perm.device)
    if T and H:
        meta = _row_blocks(H)
        rows = meta.pop("BLOCK_ROWS")
        _unpermute_rows_kernel[(triton.cdiv(T, rows),)](
            y_perm.contiguous(), row_of_slot.contiguous(), weights.contiguous() if weights is not None else y_perm, y, T, H,
            K=K, WEIGHTED=weights is not None, BLOCK_T=rows, **meta,
        )
    return y


@torch.library.custom_op("fmoe::permute_fwd", mutates_args=())
def _permute_fwd(x: torch.Tensor, row_of_slot: torch.Tensor, slot_of_row: torch.Tensor) -> torch.Tensor:
    return _launch_permute_rows(x, slot_of_row, row_of_slot.shape[1], row_of_slot=row_of_slot)[0]


@_permute_fwd.register_fake
def _(x, row_of_slot, slot_of_row):
    return x.new_empty(slot_of_row.shape[0], x.shape[1])


@torch.library.custom_op("fmoe::unpermute_fwd", mutates_args=())
def _unpermute_fwd(
    y_perm: torch.Tensor, row_of_slot: torch.Tensor, slot_of_row: torch.Tensor, weights: Optional[torch.Tensor]
) -> torch.Tensor:
    return _launch_unpermute_rows(y_perm, row_of_slot, weights)


@_unpermute_fwd.register_fake
def _(y_perm, row_of_slot, slot_of_row, weights):
    return y_perm.new_empty(row_of_slot.shape[0], y_perm.shape[1])


@torch.library.custom_op("fmoe::unpermute_bwd", mutates_args=())
def _unpermute_bwd(
    grad_y: torch.Tensor, y_perm: torch.Tensor, weights: torch.Tensor, row_of_slot: torch.Tensor, slot_of_row: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_permute_rows(grad_y, slot_of_row, row_of_slot.shape[1], weights, y_perm, row_of_slot)


@_unpermute_bwd.register_fake
def _(grad_y, y_perm, weights, row_of_slot, slot_of_row):
    return y_perm.new_empty(y_perm.shape), weights.new_empty(weights.shape)


def _permute_setup_context(ctx, inputs, output):
    _x, row_of_slot, slot_of_row = inputs
    ctx.save_for_backward(row_of_slot, slot_of_row)


def _permute_backward(ctx, grad_x_perm):
    row_of_slot, slot_of_row = ctx.saved_tensors
    return _unpermute_fwd(grad_x_perm, row_of_slot, slot_of_row, None), None, None


_permute_fwd.register_autograd(_permute_backward, setup_context=_permute_setup_context)


def _unpermute_setup_context(ctx, inputs, output):
    y_perm, row_of_slot, slot_of_row, weights = inputs
    # y_perm is needed only for d weights: unweighted, it need not outlive the forward
    ctx.save_for_backward(y_perm if weights is not None else None, row_of_slot, slot_of_row, weights)


def _unpermute_backward(ctx, grad_y):
    y_perm, row_of_slot, slot_of_row, weights = ctx.saved_tensors
    if weights is None:
        return _permute_fwd(grad_y, row_of_slot, slot_of_row), None, None, None
    grad_y_perm, grad_weights = _unpermute_bwd(grad_y, y_perm, weights, row_of_slot, slot_of_row)
    return grad_y_perm, None, None, grad_weights


_unpermute_fwd.register_autograd(_unpermute_backward, setup_context=_unpermute_setup_context)


# ----------------------------------------------------------------------------------------
# 4. Public functions
# ----------------------------------------------------------------------------------------


def permute(
    x: torch.Tensor, experts: torch.Tensor, n_experts: int, *, align: int = 1, check: bool = True, impl: str = "auto"
) -> tuple[torch.Tensor, PermutePlan]:
    """Gather token rows into expert-grouped rows (SPEC.md section 3).

    Args:
        x: [T, H] float32 / bfloat16 / float16.
        experts: [T, K] int32 / int64 expert ids in -1..E-1; -1 marks a dropped slot, which
            gets no row.
        n_experts: E.
        align: pad each expert's group with zero rows to a multiple of align (16 or 32 for
            fp8 grouped GEMMs).
        check: raise a ValueError unless the ids lie in -1..E-1 (one device->host sync;
            skipped under torch.compile). Unchecked, ids outside it are dropped slots.
        impl: "auto" (Triton on CUDA, torch otherwise), "triton" or "torch".

    Returns:
        x_perm: [R, H] in x's dtype, R = T*K if align == 1 else T*K + E*(align - 1): a
            static count, so nothing waits on the device. Kept slots by expert, then token;
            padding and the rows past plan.offsets[-1] are zeros. With align == 1 and no
            dropped slot, R == offsets[-1] == T*K.
        plan: PermutePlan(counts [E] int64, offsets [E] int32, row_of_slot [T, K] int32,
            slot_of_row [R] int32), for unpermute and the grouped GEMM (offsets).
        Differentiable w.r.t. x: d x[t] = sum of d x_perm over t's rows.

    Example:
        >>> x_perm, plan = permute(torch.tensor([[1.0], [2.0]]), torch.tensor([[1], [0]]), 2)
        >>> x_perm.flatten().tolist(), plan.offsets.tolist(), plan.row_of_slot.flatten().tolist()
        ([2.0, 1.0], [1, 2], [1, 0])
    """
    check_float("x", x, 2, "[T, H]")
    check_index("experts", experts, 2, "[T, k]")
    if experts.shape[0] != x.shape[0]:
        raise ValueError(f"experts: expected {x.shape[0]} rows, one per token of x, got shape {tuple(experts.shape)}")
    check_device("experts", experts, x.device)
    check_positive_int("n_experts", n_experts)
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ValueError(f"align: expected a positive integer (rows per expert group are padded to a multiple of it), got {align!r}")
    R = n_rows(experts.shape[0], experts.shape[1], n_experts, align)
    if R > torch.iinfo(torch.int32).max:  # the plan's row ids and offsets are int32
        raise ValueError(f"experts: {list(experts.shape)} slots make {R} rows of x_perm (align {align}), past the plan's int32 row ids (2**31 - 1)")
    if checking(check, experts):
        check_expert_ids("experts", experts, n_experts)
    if use_triton(impl, x, experts):
        plan = PermutePlan(*_permute_plan(experts, n_experts, align))
        return _permute_fwd(x, plan.row_of_slot, plan.slot_of_row), plan
    plan = permute_plan_ref(experts, n_experts, align)
    return permute_ref(x, plan), plan


def unpermute(
    y_perm: torch.Tensor, plan: PermutePlan, weights: Optional[torch.Tensor] = None, *, impl: str = "auto"
) -> torch.Tensor:
    """Sum each token's expert rows back, weighted (SPEC.md section 3).

    y[t] = sum_j weights[t,j] * y_perm[plan.row_of_slot[t,j]] over kept slots, accumulated
    in float32; deterministic (each token gathers its K rows).

    Args:
        y_perm: [R, H] float32 / bfloat16 / float16, rows as permute made them.
        plan: the PermutePlan from permute.
        weights: [T, K] float gate weights, or None for weight 1.
        impl: "auto" (Triton on CUDA, torch otherwise), "triton" or "torch".

    Returns:
        y: [T, H] in y_perm's dtype. Differentiable w.r.t. y_perm (rows of no slot get zero
        gradient) and weights (float32 dot products, returned in weights' dtype).
    """
    if not isinstance(plan, PermutePlan):
        raise ValueError(f"plan: expected the PermutePlan returned by permute, got {type(plan).__name__}")
    R = plan.slot_of_row.shape[0]
    T, K = plan.row_of_slot.shape
    check_float("y_perm", y_perm, 2, "[R, H]")  # no size in the text: formatting one specialises it under compile
    if y_perm.shape[0] != R:
        raise ValueError(f"y_perm: expected the plan's {R} rows, got shape {tuple(y_perm.shape)}")
    check_device("y_perm", y_perm, plan.row_of_slot.device)
    tensors = [y_perm, plan.row_of_slot, plan.slot_of_row]
    if weights is not None:
        check_float("weights", weights, 2, "[T, k]")
        if weights.shape != (T, K):
            raise ValueError(f"weights: expected the plan's shape ({T}, {K}), got {tuple(weights.shape)}")
        check_device("weights", weights, y_perm.device)
        tensors.append(weights)
    if use_triton(impl, *tensors):
        return _unpermute_fwd(y_perm, plan.row_of_slot, plan.slot_of_row, weights)
    return unpermute_ref(y_perm, plan, weights)
