"""Expert parallelism for fmoe.layers.moe: all-to-all dispatch and combine with autograd.

    ep = ExpertParallel(meshes.axis("ep"), etp_mesh=meshes.axis("etp"), tp_mesh=meshes.tp_mesh)
    y, counts = ep(x, routes, params, cfg)   # params["w_*"]: this rank's experts only
    y, stats = moe(x, params, cfg, experts=lambda x, routes: ep(x, routes, params, cfg))

(fmoe.model.GroupedExperts does the latter when fmoe.parallel sets its `dispatcher`.)

The rank with ep index j and etp index q owns the local experts l = 0..L-1, global ids
j L + l (L = E / ep), and the F-shard q of their FFN (F/etp columns of w_gate / w_up, rows of
w_down). An ExpertParallel call on one rank, step by step (the explicit functions below):

  1. split_tokens (a tp_mesh of tp > 1 ranks): the tp ranks hold the same T tokens; each
     keeps its contiguous T/tp slice of x and of the gate weights. Forward: a slice;
     backward: an all-gather, so d x and d weights are whole and identical on every tp rank.
     (fmoe.parallel.parallelize gives no tp_mesh: under its sequence parallelism the MoE
     block already holds only this rank's tokens, and token_shards sizes the capacity.)
  2. permute by global expert id (fmoe.ops.permute, align = 1) -> x_perm [R, H], counts [E]
     (with cfg.weights_on_input each row times its gate weight here: fmoe.layers.weigh_rows).
  3. dispatch, over ep: an all-to-all of the counts, then one host sync for the split sizes,
     then an all-to-all of the rows. Over etp (etp > 1): every etp rank sends the rows it
     received to every etp rank, since they hold different tokens but the same experts.
     Then an index gather puts the rows in local-expert-major order -> x_local [N, H], meta.
  4. grouped_mlp on x_local with this rank's weights [L, H, F/etp], [L, F/etp, H].
  5. combine: the reverse of 3. Over etp each rank gets back the partial outputs of its own
     rows from every F-shard and sums them (a reduce-scatter); over ep an all-to-all returns
     the rows to their tokens' ranks -> y_perm [R, H].
  6. unpermute with the gate weights (unweighted with weights_on_input); gather_tokens (tp_mesh) all-gathers the T/tp slices
     (backward: a slice of the upstream gradient, which TP makes identical on the tp ranks).

With ep = etp = 1 (a tp_mesh alone) steps 2-5 are fmoe.layers.local_experts on the rank's
token slice: no exchange, no host read. With a capacity factor (cfg.capacity_factor set),
steps 2, 3 and 5 are permute_padded,
dispatch_padded and combine_padded: the same exchange in the fixed-size capacity layout
below, with no count exchange and no host read.

Math. With F split into shards F_0 .. F_{Q-1} over the etp ranks,

    y[t] = sum_j w[t,j] sum_q (silu(x[t] Wg[e][:, F_q]) * (x[t] Wu[e][:, F_q])) Wd[e][F_q, :],
    e = experts[t,j],

exactly moe()'s expert output: SwiGLU acts on each F column alone, so only the last
product's sum over F is split (into Q partial sums, added in float32).

Row orders. x_perm: global expert, then token (permute). After the ep all-to-all: source ep
rank s, then local expert l, then the source's order. After the etp gather: etp rank q, s,
l. x_local: l, then s, then q, then the source's order, so that within an expert the rows
come in global token order when the ranks of an ep x etp block (rank s etp + q) hold
consecutive token ranges; meta.offsets are then the cumulative ends of each l.

Capacity layout. moe() applies drop_by_capacity before it calls the dispatcher, on the T
tokens x holds on entry (before the tp split; with token_shards = n, on the n T tokens of
the micro-batch x is a shard of, and T below reads n T), so no rank holds more than
C = min(ceil(T k / E * capacity_factor), T) slots of an expert (a token names an expert at
most once), and every buffer is sized by C:

    x_ECH     [E, C, H]        permute_padded: row (e, c) holds expert e's c-th slot in token
                               order, zero rows past its slots (global expert e = s L + l)
    [S, L, C, H]               all-to-all over ep: L C rows to and from every ep rank
    [Q, S, L, C, H]            etp > 1: every etp rank's rows (an all-to-all of Q copies)
    x_local   [L S Q C, H]     a static permute to (l, s, q, c); offsets C S Q (l + 1)
    y_local   [L S Q C, H]     grouped_mlp. Padding rows are zeros and SwiGLU(0) = 0: their
                               outputs are zeros and they add nothing to the weights' gradient
    [S, L, C, H]               to (q, s, l, c), all-to-all over etp, the Q partial sums added
                               in float32
    y_ECH     [E, C, H]        all-to-all back over ep (combine_padded); unpermute with the
                               gate weights reads the slots' rows and skips the padding

Every rank of an ep x etp group must use the same C, since each receives L C rows from every
other and none knows another's T: true when they all pass the same T (fixed-shape
micro-batches); otherwise ExpertParallel(max_tokens=) takes the largest T of the group and C
follows from it (a rank's own dropping leaves it at most C slots per expert). The layout
relies on drop_by_capacity having run: permute_padded gives a slot past C no row (it would
compute nothing) instead of checking on the host.

Host sync. With a capacity factor: none. Every split size and shape follows from T, k, E,
the capacity factor and the mesh sizes, so the expert-parallel moe() call traces as one graph
under torch.compile(fullgraph=True) (impl "auto" or "triton"; impl="torch" runs grouped_mlp's
reference, which reads its offsets on the host). Without one, dispatch reads the [E] sent
and [etp, ep, L] received counts once with .tolist() for the split sizes of the row
all-to-alls: the one device->host sync per MoE layer (the count exchange, when ep or
etp > 1), and data-dependent shapes, which fullgraph compilation refuses. Every rank
takes part in every collective, with zero rows or experts that receive nothing too (a
skipped collective is a hang); ExpertParallel checks the caller's inputs before the first
collective, so a mistake every rank makes (a shape, a dtype, a knob) raises on every rank
alike. A T above max_tokens on some ranks only raises on those: the others wait in the
all-to-all (knowing another rank's T would take a collective per call).

Nothing is kept between calls: ExpertParallel holds its meshes and max_tokens, and dispatch
returns what combine needs as a frozen DispatchMeta (dispatch_padded: a PaddedDispatchMeta).

Legend: T tokens, H hidden, E experts, K = k slots, F expert FFN size, R rows of x_perm
(T K), S = ep ranks, Q = etp ranks, L = E / S local experts, N rows this rank computes,
C capacity (slots of one expert one rank may send).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fmoe.layers import PLAIN_ACTS, check_expert_weights, expert_biases, local_experts, weigh_rows
from fmoe.ops.checks import check_float, check_index, check_positive_int
from fmoe.ops.dispatch import PermutePlan, permute, slot_ranks, unpermute
from fmoe.ops.experts import grouped_mlp
from fmoe.ops.routing import Routes, expert_capacity

__all__ = [
    "DispatchMeta", "ExpertParallel", "PaddedDispatchMeta", "combine", "combine_padded", "dispatch",
    "dispatch_padded", "gather_tokens", "permute_padded", "split_tokens",
]


def _check_mesh(name: str, mesh) -> None:
    if mesh is not None and (not isinstance(mesh, DeviceMesh) or mesh.ndim != 1):
        got = f"a {mesh.ndim}-D DeviceMesh" if isinstance(mesh, DeviceMesh) else type(mesh).__name__
        raise ValueError(f"{name}: expected a 1-D DeviceMesh (e.g. meshes.axis(...)) or None, got {got}")


def _size(mesh: Optional[DeviceMesh]) -> int:
    return 1 if mesh is None else mesh.size()


def _group(mesh: Optional[DeviceMesh]) -> Optional[dist.ProcessGroup]:
    """The mesh's process group, or None where it has one rank (no collective needed)."""
    return mesh.get_group() if _size(mesh) > 1 else None


def _group_rank(group: Optional[dist.ProcessGroup]) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows in_splits[r] of x to rank r; out_splits[r] rows from rank r, rank-major.
    Differentiable: the backward is the all-to-all with the splits swapped."""
    y = funcol.all_to_all_single_autograd(x.contiguous(), list(out_splits), list(in_splits), group)
    return funcol.wait_tensor(y)


# ----------------------------------------------------------------------------------------
# dense TP: token split and gather
# ----------------------------------------------------------------------------------------


def copy_to_tp(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; backward sums the gradient over the ranks of `mesh` (Megatron's f).

    Used on the weights that stay replicated but get a partial gradient on each rank: over
    tp, those that see only this rank's tokens (fmoe.parallel.SequenceShard.weight); over
    etp, the experts' b_down (ExpertParallel)."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def split_tokens(t: torch.Tensor, tp_mesh: Optional[DeviceMesh]) -> torch.Tensor:
    """This tp rank's contiguous slice [T/tp, ...] of t [T, ...], which the tp ranks hold alike.

    Backward all-gathers the slices' gradients, so t's gradient is whole on every tp rank.
    tp_mesh None or of size 1: t itself. For float tensors (it goes through DTensor); integer
    ids need no gradient and are sliced plainly (ExpertParallel does so).
    """
    _check_mesh("tp_mesh", tp_mesh)
    tp = _size(tp_mesh)
    if tp == 1:
        return t
    if t.shape[0] % tp:
        raise ValueError(f"t: expected a number of rows divisible by tp = {tp}, got shape {tuple(t.shape)}")
    return DTensor.from_local(t, tp_mesh, [Replicate()]).redistribute(tp_mesh, [Shard(0)]).to_local()


def gather_tokens(y: torch.Tensor, tp_mesh: Optional[DeviceMesh]) -> torch.Tensor:
    """The tp ranks' slices y [T/tp, ...] concatenated in tp rank order -> [T, ...].

    Backward keeps this rank's slice of the upstream gradient: under TP the code after
    the MoE block runs alike on the tp ranks, so that gradient is the same on all of them.
    """
    _check_mesh("tp_mesh", tp_mesh)
    if _size(tp_mesh) == 1:
        return y
    return DTensor.from_local(y, tp_mesh, [Shard(0)]).redistribute(tp_mesh, [Replicate()]).to_local()


# ----------------------------------------------------------------------------------------
# expert parallel: dispatch and combine
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DispatchMeta:
    """What combine needs to undo one dispatch (made per call, never kept).

    n_rows: R, the rows of x_perm (combine returns as many, zeros past the sent ones).
    send_splits: [S] rows this rank sent to each ep rank (x_perm's first sum() rows).
    recv_splits: [S] rows this rank received from each ep rank.
    etp_splits: [Q] rows each etp rank received over ep, i.e. gave to the etp gather.
    recv_counts: [Q, S, L] int64: rows of local expert l that ep rank s sent to etp rank q
        (this rank is q = its etp rank; etp = 1: Q = 1).
    sort_index: [N] int64, x_local = x_gathered[sort_index] (local-expert-major).
    unsort_index: [N] int64, its inverse: y_gathered = y_local[unsort_index].
    offsets: [L] int32 cumulative ends of each local expert's rows (grouped_mlp's offsets).
    ep_group, etp_group: the process groups, None for an axis of one rank.
    """

    n_rows: int
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    etp_splits: tuple[int, ...]
    recv_counts: torch.Tensor
    sort_index: torch.Tensor
    unsort_index: torch.Tensor
    offsets: torch.Tensor
    ep_group: Optional[dist.ProcessGroup]
    etp_group: Optional[dist.ProcessGroup]


def _expert_major(counts_QSL: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sort_index, unsort_index) [n] between rows in blocks ordered (q, s, l) and the same
    blocks ordered (l, s, q), each block's rows kept in order. Computed on the device from
    the counts: gathers, deterministic, no sync (output_size is known)."""
    Q, S, L = counts_QSL.shape
    device = counts_QSL.device
    counts_B = counts_QSL.reshape(-1)  # blocks as they arrive
    counts_LSQ = counts_QSL.permute(2, 1, 0).reshape(-1)
    dest_start_LSQ = torch.cumsum(counts_LSQ, 0) - counts_LSQ
    dest_start_B = dest_start_LSQ.view(L, S, Q).permute(2, 1, 0).reshape(-1)
    src_start_B = torch.cumsum(counts_B, 0) - counts_B
    block_N = torch.repeat_interleave(torch.arange(Q * S * L, device=device), counts_B, output_size=n)
    unsort_index = dest_start_B[block_N] + torch.arange(n, device=device) - src_start_B[block_N]
    sort_index = torch.empty_like(unsort_index).scatter_(0, unsort_index, torch.arange(n, device=device))
    return sort_index, unsort_index


def dispatch(
    x_perm: torch.Tensor,
    counts_E: torch.Tensor,
    *,
    ep_mesh: Optional[DeviceMesh] = None,
    etp_mesh: Optional[DeviceMesh] = None,
) -> tuple[torch.Tensor, DispatchMeta]:
    """Send expert-grouped rows to the ranks owning their experts (step 3 of the module doc).

    Args:
        x_perm: [R, H] rows grouped by global expert (fmoe.ops.permute with align = 1):
            the first counts_E.sum() rows are sent, the rest (dropped slots) are not.
        counts_E: [E] int64 rows of each global expert (plan.counts), >= 0, adding up to at
            most R. Counts refused on one rank are a ValueError on every rank of the exchange.
        ep_mesh, etp_mesh: 1-D meshes of the ep and etp axes (None or size 1: off).
    Returns:
        x_local: [N, H] the rows of this rank's L = E/ep experts from every rank of its
            ep group (and, with etp > 1, of every etp rank), local-expert-major.
        meta: DispatchMeta; meta.offsets are x_local's grouped_mlp offsets.
        Differentiable w.r.t. x_perm. One device->host sync (the split sizes).
    """
    check_float("x_perm", x_perm, 2, "[R, H]")
    if not isinstance(counts_E, torch.Tensor) or counts_E.ndim != 1 or counts_E.dtype != torch.int64:
        got = f"{counts_E.dtype} {tuple(counts_E.shape)}" if isinstance(counts_E, torch.Tensor) else type(counts_E).__name__
        raise ValueError(f"counts_E: expected an int64 [E] tensor (plan.counts), got {got}")
    _check_mesh("ep_mesh", ep_mesh)
    _check_mesh("etp_mesh", etp_mesh)
    ep_group, etp_group = _group(ep_mesh), _group(etp_mesh)
    S, Q, E = _size(ep_mesh), _size(etp_mesh), counts_E.shape[0]
    if E == 0 or E % S:
        raise ValueError(f"counts_E: expected E = {E} experts divisible by ep = {S}")
    L, R, H = E // S, x_perm.shape[0], x_perm.shape[1]

    # recv[s, l]: rows of our local expert l that ep rank s sends us; beside them (column L) whether rank s's own
    # counts_E are refused (negative, or more rows than its x_perm), so that every rank of the exchange raises together
    # at the host read below instead of its peers waiting in the next all-to-all for a rank that raised alone
    refused = ((counts_E < 0).any() | (counts_E.sum() > R)).to(torch.int64)
    counts_SL = torch.cat([counts_E.view(S, L), refused.expand(S, 1)], 1)
    recv_SL = counts_SL
    if ep_group is not None:
        recv_SL = torch.empty_like(counts_SL)
        dist.all_to_all_single(recv_SL, counts_SL.contiguous(), group=ep_group)
    recv_QSL = recv_SL[None]
    if etp_group is not None:
        parts = [torch.empty_like(recv_SL) for _ in range(Q)]
        dist.all_gather(parts, recv_SL.contiguous(), group=etp_group)  # (torch 2.11 has no funcol.all_gather_single)
        recv_QSL = torch.stack(parts)
    recv_QSL, refused_QS = recv_QSL[..., :L].contiguous(), recv_QSL[..., L]

    # the one host sync: the all-to-alls take their split sizes as Python ints
    host = torch.cat([counts_E, recv_QSL.reshape(-1), refused_QS.reshape(-1)]).tolist()
    sent_E, recv_QS = host[:E], [sum(host[E + i * L : E + (i + 1) * L]) for i in range(Q * S)]
    if min(sent_E) < 0:
        raise ValueError(f"counts_E: expected row counts >= 0, got {sent_E}")
    if sum(sent_E) > R:
        raise ValueError(f"counts_E: they add up to {sum(sent_E)} rows, more than x_perm's {R}")
    if any(host[E + Q * S * L:]):
        raise ValueError("counts_E: another rank's were refused (negative, or more rows than its x_perm): every rank of "
                         "the exchange stops with it")
    send_splits = tuple(sum(sent_E[s * L : (s + 1) * L]) for s in range(S))
    q = _group_rank(etp_group)
    recv_splits = tuple(recv_QS[q * S : (q + 1) * S])
    etp_splits = tuple(sum(recv_QS[i * S : (i + 1) * S]) for i in range(Q))
    n_sent, n_recv, n = sum(send_splits), sum(recv_splits), sum(etp_splits)

    x_recv = x_perm[:n_sent]
    if ep_group is not None:
        x_recv = _all_to_all(x_recv, recv_splits, send_splits, ep_group)
    x_gathered = x_recv
    if etp_group is not None:
        # every etp rank computes every etp rank's rows with its own F-shard
        x_gathered = _all_to_all(x_recv.repeat(Q, 1), etp_splits, [n_recv] * Q, etp_group)
    assert x_gathered.shape == (n, H), (tuple(x_gathered.shape), n)

    sort_index, unsort_index = _expert_major(recv_QSL, n)
    offsets = torch.cumsum(recv_QSL.sum((0, 1)), 0).to(torch.int32)
    meta = DispatchMeta(
        n_rows=R, send_splits=send_splits, recv_splits=recv_splits, etp_splits=etp_splits, recv_counts=recv_QSL,
        sort_index=sort_index, unsort_index=unsort_index, offsets=offsets, ep_group=ep_group, etp_group=etp_group,
    )
    return x_gathered[sort_index], meta


def combine(y_local: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
    """The reverse of dispatch: y_local [N, H] (x_local's rows) -> y_perm [R, H] in x_perm's
    row order, zeros for rows that were not sent. With etp > 1 the etp ranks' partial sums
    over their F-shards are added (in float32). Differentiable w.r.t. y_local."""
    if not isinstance(meta, DispatchMeta):
        raise ValueError(f"meta: expected the DispatchMeta returned by dispatch, got {type(meta).__name__}")
    n = meta.sort_index.shape[0]
    check_float("y_local", y_local, 2, "[N, H]")  # no size in the text: formatting one specialises it under compile
    if y_local.shape[0] != n:
        raise ValueError(f"y_local: expected dispatch's {n} rows, got shape {tuple(y_local.shape)}")
    H = y_local.shape[1]
    Q, n_recv, n_sent = len(meta.etp_splits), sum(meta.recv_splits), sum(meta.send_splits)

    y_recv = y_local[meta.unsort_index]
    if meta.etp_group is not None:
        parts = _all_to_all(y_recv, [n_recv] * Q, meta.etp_splits, meta.etp_group)
        y_recv = parts.view(Q, n_recv, H).sum(0, dtype=torch.float32).to(y_local.dtype)
    if meta.ep_group is not None:
        y_recv = _all_to_all(y_recv, meta.send_splits, meta.recv_splits, meta.ep_group)
    assert y_recv.shape == (n_sent, H), (tuple(y_recv.shape), n_sent)
    return torch.cat([y_recv, y_recv.new_zeros(meta.n_rows - n_sent, H)])


# ----------------------------------------------------------------------------------------
# expert parallel with a capacity bound: fixed-size buffers, no host sync
# ----------------------------------------------------------------------------------------


def permute_padded(
    x: torch.Tensor, experts: torch.Tensor, n_experts: int, capacity: int
) -> tuple[torch.Tensor, PermutePlan]:
    """Token rows into the capacity layout (module doc): x_ECH [E, C, H], a fixed shape.

    Row (e, c) holds x[t] of expert e's c-th slot (t, j), slots in token order as permute
    orders them; the rows past an expert's slots are zeros. A slot with id -1 gets no row,
    and so would a slot past the capacity: none is left after drop_by_capacity, and the
    layout relies on that rather than check it (a host read). Sync-free: sorts and gathers.

    Args:
        x: [T, H] float; experts: [T, K] int ids in -1..E-1; n_experts: E; capacity: C >= 0.
    Returns:
        x_ECH [E, C, H] in x's dtype, differentiable w.r.t. x (d x[t] adds its slots' rows
        in float32), and plan: a PermutePlan of the E C rows for fmoe.ops.unpermute,
        counts [E] the slots placed, offsets C (e + 1).

    Example:
        >>> x_ECH, plan = permute_padded(torch.tensor([[1.0], [2.0]]), torch.tensor([[1], [1]]), 2, 2)
        >>> x_ECH.flatten().tolist(), plan.row_of_slot.flatten().tolist()
        ([0.0, 0.0, 1.0, 2.0], [2, 3])
    """
    check_float("x", x, 2, "[T, H]")
    check_index("experts", experts, 2, "[T, k]")
    if experts.shape[0] != x.shape[0]:
        raise ValueError(f"experts: expected {x.shape[0]} rows, one per token of x, got shape {tuple(experts.shape)}")
    check_positive_int("n_experts", n_experts)
    check_positive_int("capacity", capacity, low=0)
    (T, K), E, C, H = experts.shape, n_experts, capacity, x.shape[1]
    device = x.device
    # the T K flat slots by expert, then token (dropped ones, and ids past E, to a virtual E)
    key, rank, counts_all = slot_ranks(experts, E)  # rank: c, the slot's place in its expert
    placed = (key < E) & (rank < C)
    row_of_slot = torch.where(placed, key * C + rank, -1)
    # unplaced slots all write the spare row E C, cut off after
    slot_of_row = torch.full((E * C + 1,), -1, dtype=torch.int64, device=device)
    slot_of_row.scatter_(0, torch.where(placed, row_of_slot, E * C), torch.arange(T * K, device=device))
    slot_of_row = slot_of_row[: E * C]
    plan = PermutePlan(
        counts=counts_all[:E].clamp(max=C),
        offsets=torch.arange(1, E + 1, dtype=torch.int32, device=device) * C,
        row_of_slot=row_of_slot.view(T, K).to(torch.int32),
        slot_of_row=slot_of_row.to(torch.int32),
    )
    # rows of no slot read an appended zero row T; gathered in float32 (exact) so that the
    # backward adds a token's K rows in float32, as fmoe.ops.permute does
    token_R = torch.where(slot_of_row >= 0, slot_of_row // K, T)
    x_pad = torch.cat([x.float(), x.new_zeros(1, H, dtype=torch.float32)])
    return x_pad[token_R].to(x.dtype).view(E, C, H), plan


@dataclasses.dataclass(frozen=True)
class PaddedDispatchMeta:
    """What combine_padded needs to undo one dispatch_padded (made per call, never kept).

    n_experts: E. capacity: C. n_ep, n_etp: S, Q.
    offsets: [L] int32, C S Q (l + 1): x_local's grouped_mlp offsets (fixed).
    ep_group, etp_group: the process groups, None for an axis of one rank.
    """

    n_experts: int
    capacity: int
    n_ep: int
    n_etp: int
    offsets: torch.Tensor
    ep_group: Optional[dist.ProcessGroup]
    etp_group: Optional[dist.ProcessGroup]


def dispatch_padded(
    x_ECH: torch.Tensor,
    *,
    ep_mesh: Optional[DeviceMesh] = None,
    etp_mesh: Optional[DeviceMesh] = None,
) -> tuple[torch.Tensor, PaddedDispatchMeta]:
    """dispatch in the capacity layout (module doc): equal splits, fixed shapes, no host read.

    Args:
        x_ECH: [E, C, H] this rank's rows of every global expert, C per expert, padded with
            zero rows (permute_padded). Every rank of the ep x etp group passes the same C.
        ep_mesh, etp_mesh: 1-D meshes of the ep and etp axes (None or size 1: off).
    Returns:
        x_local: [L S Q C, H], the C rows of each of this rank's L = E/ep experts from every
            ep and etp rank, ordered (l, s, q, c); expert l owns rows C S Q l .. C S Q (l + 1).
        meta: PaddedDispatchMeta; meta.offsets are x_local's grouped_mlp offsets.
        Differentiable w.r.t. x_ECH.
    """
    check_float("x_ECH", x_ECH, 3, "[E, C, H]")
    _check_mesh("ep_mesh", ep_mesh)
    _check_mesh("etp_mesh", etp_mesh)
    ep_group, etp_group = _group(ep_mesh), _group(etp_mesh)
    (E, C, H), S, Q = x_ECH.shape, _size(ep_mesh), _size(etp_mesh)
    if E == 0 or E % S:
        raise ValueError(f"x_ECH: expected E = {E} experts (dim 0) divisible by ep = {S}")
    L = E // S

    # rows already rank-major: ep rank s owns the global experts s L .. s L + L - 1
    x_recv = x_ECH.reshape(E * C, H)
    if ep_group is not None:
        x_recv = _all_to_all(x_recv, [L * C] * S, [L * C] * S, ep_group)
    if etp_group is not None:
        # every etp rank computes every etp rank's rows with its own F-shard
        x_recv = _all_to_all(x_recv.repeat(Q, 1), [S * L * C] * Q, [S * L * C] * Q, etp_group)
    x_local = x_recv.view(Q, S, L, C, H).permute(2, 1, 0, 3, 4).reshape(L * S * Q * C, H)
    offsets = torch.arange(1, L + 1, dtype=torch.int32, device=x_ECH.device) * (S * Q * C)
    meta = PaddedDispatchMeta(
        n_experts=E, capacity=C, n_ep=S, n_etp=Q, offsets=offsets, ep_group=ep_group, etp_group=etp_group
    )
    return x_local, meta


def combine_padded(y_local: torch.Tensor, meta: PaddedDispatchMeta) -> torch.Tensor:
    """The reverse of dispatch_padded: y_local [L S Q C, H] (x_local's rows) -> y_ECH
    [E, C, H] in x_ECH's layout. With etp > 1 the etp ranks' partial sums over their
    F-shards are added (in float32). Differentiable w.r.t. y_local; no host read."""
    if not isinstance(meta, PaddedDispatchMeta):
        raise ValueError(f"meta: expected the PaddedDispatchMeta returned by dispatch_padded, got {type(meta).__name__}")
    E, C, S, Q = meta.n_experts, meta.capacity, meta.n_ep, meta.n_etp
    L = E // S
    check_float("y_local", y_local, 2, "[L S Q C, H]")
    if y_local.shape[0] != L * S * Q * C:
        raise ValueError(f"y_local: expected dispatch_padded's {L * S * Q * C} rows, got shape {tuple(y_local.shape)}")
    H = y_local.shape[1]

    y_recv = y_local.view(L, S, Q, C, H).permute(2, 1, 0, 3, 4).reshape(Q * S * L * C, H)
    if meta.etp_group is not None:
        parts = _all_to_all(y_recv, [S * L * C] * Q, [S * L * C] * Q, meta.etp_group)
        y_recv = parts.view(Q, S * L * C, H).sum(0, dtype=torch.float32).to(y_local.dtype)
    if meta.ep_group is not None:
        y_recv = _all_to_all(y_recv, [L * C] * S, [L * C] * S, meta.ep_group)
    return y_recv.view(E, C, H)


# ----------------------------------------------------------------------------------------
# the dispatcher for moe()
# ----------------------------------------------------------------------------------------


class ExpertParallel:
    """moe()'s dispatcher over expert-parallel (ep), expert-TP (etp) and dense TP (tp) ranks.

        y, counts = ExpertParallel(ep_mesh, etp_mesh=..., tp_mesh=...)(x, routes, params, cfg)

    x [T, H] and routes (weights, experts [T, k]) are this rank's tokens (with a tp_mesh:
    the same on its ranks, which split them; fmoe.parallel.parallelize instead splits the
    tokens before the MoE block, sequence parallel, and passes token_shards); params["w_gate"], ["w_up"] [E/ep, H, F/etp] and ["w_down"]
    [E/ep, F/etp, H] this rank's experts (ep rank j: experts j E/ep .. (j+1) E/ep - 1) and
    F-shard. Returns y [T, H] (whole on every tp rank) and counts [E] int64 of the slots this
    rank dispatched (its T/tp slice under tp: the sum over all ranks is the true total).
    Meshes are 1-D (meshes.axis("ep"), meshes.axis("etp"), meshes.tp_mesh); None or size 1
    turns that axis off. Holds the meshes and max_tokens: nothing is kept between calls.

    cfg.capacity_factor set: the capacity layout (module doc), with no host read and fixed
    shapes; C = min(ceil(T k / E * capacity_factor), T) from T = max_tokens if given, else
    this call's T (T caps it: each token names an expert at most once, as route's top-k and
    hash routing's tables do). max_tokens: the largest T any rank of this rank's ep x etp group passes, for
    ranks whose token counts differ (a rank with none, a short last batch); every rank of
    the group must pass the same max_tokens. Ranks of different T without it size their
    buffers differently: gloo aborts the process ("Received data size doesn't match"), nccl may
    hang or read a wrong buffer. Not used without a capacity factor: then the
    count exchange sizes the all-to-alls (the one host sync per call). cfg.align is not
    used: the exchanged rows carry no alignment padding. The routes must be capacity-dropped
    already (fmoe.ops.drop_by_capacity, as moe() runs it before the dispatcher): each expert's
    slots past C are not exchanged, so routes that were not dropped lose them silently (their
    rows of y zero), where local_experts would compute them.

    token_shards: x is one of token_shards equal slices of a micro-batch of token_shards T
    tokens whose capacity drop ran over all of them (sequence parallelism, where
    fmoe.parallel.parallelize passes tp and no tp_mesh: the tokens are split before the MoE
    block, fmoe.parallel.tensor): one rank may hold all C = ceil(token_shards T k / E *
    capacity_factor) slots an expert keeps, so the capacity layout is sized by that C.
    """

    def __init__(
        self,
        ep_mesh: Optional[DeviceMesh] = None,
        *,
        etp_mesh: Optional[DeviceMesh] = None,
        tp_mesh: Optional[DeviceMesh] = None,
        max_tokens: Optional[int] = None,
        token_shards: int = 1,
    ):
        for name, mesh in (("ep_mesh", ep_mesh), ("etp_mesh", etp_mesh), ("tp_mesh", tp_mesh)):
            _check_mesh(name, mesh)
        if max_tokens is not None:
            check_positive_int("max_tokens", max_tokens)
        check_positive_int("token_shards", token_shards)
        if token_shards > 1 and _size(tp_mesh) > 1:
            raise ValueError(f"token_shards: {token_shards} says x is already a token shard; it excludes splitting the tokens over tp_mesh (size {_size(tp_mesh)})")
        self.ep_mesh, self.etp_mesh, self.tp_mesh = ep_mesh, etp_mesh, tp_mesh
        self.max_tokens, self.token_shards = max_tokens, token_shards

    def __repr__(self) -> str:
        sizes = f"ep={_size(self.ep_mesh)}, etp={_size(self.etp_mesh)}, tp={_size(self.tp_mesh)}"
        extra = ("" if self.max_tokens is None else f", max_tokens={self.max_tokens}") + ("" if self.token_shards == 1 else f", token_shards={self.token_shards}")
        return f"ExpertParallel({sizes}{extra})"

    def _check(self, x_TH, routes, params, cfg) -> None:
        T, H = x_TH.shape
        E, ep, tp = cfg.n_experts, _size(self.ep_mesh), _size(self.tp_mesh)
        if E % ep:
            raise ValueError(f"cfg.n_experts: {E} experts do not split evenly over ep = {ep} ranks")
        if T % tp:
            raise ValueError(f"x: expected a number of tokens divisible by tp = {tp} (each tp rank takes T/tp), got T = {T}")
        if cfg.capacity_factor is not None and self.max_tokens is not None and T > self.max_tokens:
            raise ValueError(f"x: T = {T} tokens, more than ExpertParallel's max_tokens = {self.max_tokens}")
        if routes.weights.shape[0] != T or routes.experts.shape[0] != T:
            shapes = f"{tuple(routes.weights.shape)}, {tuple(routes.experts.shape)}"
            raise ValueError(f"routes: expected weights and experts with x's {T} rows, got {shapes}")
        check_expert_weights(x_TH, params, E // ep, experts=f"this rank's E/ep = {E}/{ep} experts, FFN split over etp",
                             gated=cfg.glu_act not in PLAIN_ACTS)

    def __call__(self, x_TH: torch.Tensor, routes, params, cfg, *, rows=None) -> tuple[torch.Tensor, torch.Tensor]:
        """fmoe.layers.local_experts' call; rows (its rows=) runs on the output rows back on this
        rank, before their weights (a parameter of it is this rank's, as the router's)."""
        self._check(x_TH, routes, params, cfg)
        (T, H), E, k = x_TH.shape, cfg.n_experts, routes.experts.shape[1]
        x_slice_TH = split_tokens(x_TH, self.tp_mesh)
        weights = split_tokens(routes.weights, self.tp_mesh)
        experts = routes.experts
        if _size(self.tp_mesh) > 1:
            t = x_slice_TH.shape[0]
            start = self.tp_mesh.get_local_rank() * t
            experts = experts[start : start + t]  # ids: no gradient, a plain slice
        routes = Routes(weights, experts)
        w_gate, w_up, w_down = params.get("w_gate"), params["w_up"], params["w_down"]  # no w_gate: experts without a gate
        biases = expert_biases(params)  # padding rows' outputs are never read: bias there is harmless
        if "b_down" in biases and _size(self.etp_mesh) > 1:
            # the etp ranks' partial sums are added in combine: each adds b_down / etp, and
            # the gradient (each rank's over the same rows, / etp) is summed over etp
            biases["b_down"] = copy_to_tp(biases["b_down"], self.etp_mesh) / _size(self.etp_mesh)

        if _size(self.ep_mesh) == 1 and _size(self.etp_mesh) == 1:
            # dense TP only: this rank's token slice through every expert here, no exchange
            # and so no host sync (fmoe.layers.local_experts)
            y_TH, counts = local_experts(x_slice_TH, routes, params, cfg, rows=rows)
            return gather_tokens(y_TH, self.tp_mesh), counts
        if cfg.capacity_factor is None:
            # align = 1: the exchanged rows carry no padding; ids from route need no value
            # check; dispatch makes the one host sync (the count exchange)
            x_perm, plan = permute(x_slice_TH, routes.experts, E, align=1, check=False, impl=cfg.impl)
            x_perm, weights = weigh_rows(x_perm, plan, routes.weights, cfg)  # cfg.weights_on_input: on the way in
            x_local, meta = dispatch(x_perm, plan.counts, ep_mesh=self.ep_mesh, etp_mesh=self.etp_mesh)
            # offsets come from dispatch's own counts: skip grouped_mlp's value check (a host sync)
            y_local = grouped_mlp(x_local, w_gate, w_up, w_down, meta.offsets, check=False, impl=cfg.impl, fp8=cfg.fp8,
                                  **biases, **cfg.glu)
            y_perm = combine(y_local, meta)
        else:
            # moe() dropped every slot past C of the T tokens on entry (before the tp split), or
            # of the token_shards T tokens of the micro-batch x is a shard of
            T_max = T if self.max_tokens is None else self.max_tokens
            # a token names an expert at most once (route's top-k, a hash table's distinct rows), so this rank holds at most
            # T_max slots of an expert: a factor that keeps every slot (E or more) sizes no larger buffers than that
            C = min(expert_capacity(T_max * self.token_shards, k, E, cfg.capacity_factor), T_max)
            x_ECH, plan = permute_padded(x_slice_TH, routes.experts, E, C)
            x_ECH, weights = weigh_rows(x_ECH.view(E * C, H), plan, routes.weights, cfg)
            x_local, meta = dispatch_padded(x_ECH.view(E, C, H), ep_mesh=self.ep_mesh, etp_mesh=self.etp_mesh)
            # the offsets C S Q (l + 1) are right by construction: no value check (a host sync)
            y_local = grouped_mlp(x_local, w_gate, w_up, w_down, meta.offsets, check=False, impl=cfg.impl, fp8=cfg.fp8,
                                  **biases, **cfg.glu)
            y_perm = combine_padded(y_local, meta).view(E * C, H)
        y_TH = unpermute(y_perm if rows is None else rows(y_perm), plan, weights, impl=cfg.impl)
        return gather_tokens(y_TH, self.tp_mesh), plan.counts
