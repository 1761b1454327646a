"""Reductions across ranks: balancing-loss counts and logging sums.

Each function takes its process group (or a 1-D DeviceMesh) as an argument; nothing is
global. What is reduced over which group (DESIGN.md "Parallelism", SPEC.md section 2):

    seq_load_balancing_loss_split   counts c[b,e] of the micro-batch's packed documents, summed
                                    over the ranks that split its tokens (TP x CP group)
    seq_load_balancing_losses_split the same for every MoE layer, one [L, B, E] collective
    z_loss_split                    no collective: this rank's share of the z-loss's mean
    all_reduce_counts               tokens_per_expert of every MoE layer: over TP x DP x CP for
                                    the expert-bias update and the global-batch loss
    global_load_balancing_loss      no collective: takes the counts all_reduce_counts summed
    all_reduce_sums                 logging scalars over the data-parallel ranks, kept on device

The one-collective rule: every function issues exactly one collective, the same one on
every rank of its group, whatever the rank holds (no MoE layer, no gradient, no token). Its
shape depends only on arguments every rank agrees on (the layer names, n_experts,
cu_seqlens, the keys of the logged values), never on local data, so a rank with nothing to
contribute sends zeros instead of skipping; a skipped collective hangs the others. Counts
and sums travel without autograd: the losses' gradients flow through the local scores only.

Sequence-level loss split over ranks. The packed micro-batch of T tokens (B documents,
global cu_seqlens, lengths S_b) is split over the R ranks of the group: contiguous ranges
[start_r, start_r + T_r) (TP/SP), or any partition given by each token's index (CP's
load-balanced chunks). With the full counts c[b,e] (an all_reduce of the per-rank counts)
and the local score sums s_r[b,e] = sum_{t in b, t on r} scores[t,e], rank r returns

    L_r = 1 / B' * sum_b E / (k S_b^2) * sum_e c[b,e] * s_r[b,e]       B' = #{b : S_b > 0}

and since sum_r s_r = s, sum_r L_r = fmoe.ops.seq_load_balancing_loss on the whole batch;
each rank's gradient is its rows of the unsplit gradient.

The gradient norm over meshes (the same one-collective rule) is fmoe.optim.grad_norm /
clip_grad_norm, which work on one process too; the process-group helpers are shared with it.

Legend: T tokens (T_local on this rank), E experts, K = k slots per token, B documents
(sequences) of the packed batch, L MoE layers, R ranks of the group.
"""

from __future__ import annotations

import hashlib
import numbers
from typing import Iterable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist

from fmoe.ops import load_balancing_loss, z_loss
from fmoe.ops.balance import mask_tokens, sequence_loss_from_sums, sequence_sums
from fmoe.ops.checks import check_cu_seqlens, check_expert_ids, check_float, check_index, check_positive_int, check_token_mask, checking
from fmoe.ops.packed import sequence_ids
from fmoe.optim.grads import Group, collective_device, process_group


# ----------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------


def _token_count(name: str, value) -> Union[float, torch.Tensor]:
    """A positive int, or a 1-element tensor (kept on device: no host sync)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name}: expected an int or a 1-element tensor, got shape {tuple(value.shape)}")
        return value.reshape(()).float()
    return float(check_positive_int(name, value))


def _check_layers(names, **layers) -> list[str]:
    """names: every MoE layer's name, unique strings (returned as a list); each keyword: a
    mapping whose keys are among names (ValueError naming the argument otherwise)."""
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise ValueError(f"names: expected a sequence of layer-name strings, got {names!r}")
    names = list(names)  # once: a generator would be spent by the check below
    if not all(isinstance(n, str) for n in names):
        raise ValueError(f"names: expected a sequence of layer-name strings, got {names!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"names: expected unique layer names, got {names}")
    for arg, mapping in layers.items():
        if not isinstance(mapping, Mapping):
            raise ValueError(f"{arg}: expected a mapping from layer name to tensor, got {type(mapping).__name__}")
        unknown = [name for name in mapping if name not in set(names)]
        if unknown:
            raise ValueError(f"{arg}: layer names {unknown} are not in names {names}")
    return names


# ----------------------------------------------------------------------------------------
# Balancing losses and counts
# ----------------------------------------------------------------------------------------


def seq_load_balancing_loss_split(
    scores: torch.Tensor,
    experts: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    k: int,
    group: Group,
    start: Optional[int] = None,
    token_index: Optional[torch.Tensor] = None,
    check: bool = True,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """This rank's share of the sequence-level loss when tokens are split over `group`.

    The packed micro-batch (the GLOBAL cu_seqlens, ending at T) is split over the ranks of
    `group` (tensor- or context-parallel ranks); this rank holds the contiguous tokens
    [start, start + T_local), or, for a split that is not contiguous (context parallelism's
    load-balanced chunks), the tokens token_index[0..T_local). The counts c[b,e] are summed
    over the group (one all_reduce of a [B, E] int64 tensor, no autograd), the document
    lengths come from cu_seqlens, the score sums stay local (module docstring):

        L_r = 1/B' * sum_b E / (k S_b^2) * sum_e c[b,e] * sum_{t in b, on this rank} scores[t,e]

    so the values of the group's ranks ADD UP to fmoe.ops.seq_load_balancing_loss over the
    whole batch, and the gradient w.r.t. this rank's scores is its rows of the unsplit
    gradient. Empty documents (S_b = 0) are left out of the mean B', as in the unsplit op;
    a rank may hold no token (T_local = 0) and still takes part. Every rank of the group
    must pass the same cu_seqlens and k, and the ranks' tokens must partition [0, T) (not
    checked: that would cost a collective).

    Args:
        scores: [T_local, E] float from aux_scores (differentiable).
        experts: [T_local, k] int ids (the unconstrained top-k; -1 skipped).
        cu_seqlens: [B + 1] int32/int64 of the whole micro-batch, 0 = c_0 <= ... <= c_B = T.
        k: slots per token.
        group: the ranks splitting the tokens (ProcessGroup or 1-D DeviceMesh).
        start: this rank's first token in the packed batch (contiguous split), or
        token_index: [T_local] int, the packed-batch index of each local token; exactly one.
        check: check cu_seqlens' values and the range against T (a device->host sync;
            skipped under torch.compile). A train step passes False: make_batch checked them.
        mask: None, or [T_local] bool, False on this rank's tokens left out (padding), as
            for fmoe.ops.seq_load_balancing_loss(mask=): the lengths S_b count the tokens in
            the mask over the group (they travel in the same all_reduce). Every rank of the
            group passes a mask, or none does.
    Returns: 0-D float32 tensor.

    Example: cu_seqlens [0, 7, 13] over 2 ranks, start 0 with T_local 4 and start 4 with
    T_local 9; the two values sum to the loss of the 13 tokens in one process. Context
    parallelism over 2 ranks in 4 chunks of a 16-token batch: token_index
    cat(arange(0, 4), arange(12, 16)) on rank 0, arange(4, 12) on rank 1.
    """
    T_local = _check_seq_layer("scores", scores, "experts", experts, k)
    return _seq_split([("", scores, experts)], [""], T_local, scores.shape[1], cu_seqlens, k=k, group=group, start=start,
                      token_index=token_index, check=check, mask=mask)[""]


def seq_load_balancing_losses_split(
    scores: Mapping[str, torch.Tensor],
    experts: Mapping[str, torch.Tensor],
    cu_seqlens: torch.Tensor,
    *,
    k: int,
    group: Group,
    names: Sequence[str],
    n_experts: int,
    start: Optional[int] = None,
    token_index: Optional[torch.Tensor] = None,
    check: bool = True,
    mask: Optional[torch.Tensor] = None,
) -> dict[str, torch.Tensor]:
    """seq_load_balancing_loss_split of every MoE layer with ONE collective: the layers'
    [B, E] counts travel as one [L, B, E] all_reduce in the order of `names` (DESIGN.md:
    one collective for all layers), instead of one per layer.

    Args:
        scores: {name: [T_local, E]} and experts: {name: [T_local, k]} of the layers this
            rank holds (the same names in both, each in `names`); every layer splits the
            same tokens (one T_local). A layer of `names` this rank does not hold sends
            zeros, so every rank of the group takes part in the same collective; a rank
            that holds none (scores = experts = {}) still passes its own start or
            token_index, and mask (its T_local read from token_index or mask), so that its
            tokens count in the lengths S_b as they do on the ranks holding the layers.
        names: every MoE layer's name, in the same order on every rank of the group.
        n_experts: E. cu_seqlens, k, group, start / token_index, check, mask: as
            seq_load_balancing_loss_split (one mask: every layer splits the same tokens).
    Returns: {name: 0-D float32} for the layers given, each equal to
    seq_load_balancing_loss_split(scores[name], experts[name], ...) (the same math; the
    gradients flow through the local scores only).

    Example: names ["layer_1", "layer_2"]: one all_reduce of a [2, B, E] int64 tensor.
    """
    check_positive_int("n_experts", n_experts)
    names = _check_layers(names, scores=scores, experts=experts)
    if set(scores) != set(experts):
        raise ValueError(f"experts: expected the layers of scores {sorted(scores)}, got {sorted(experts)}")
    T_local = None
    for name in scores:
        T = _check_seq_layer(f"scores[{name!r}]", scores[name], f"experts[{name!r}]", experts[name], k)
        if scores[name].shape[1] != n_experts:
            raise ValueError(f"scores[{name!r}]: expected {n_experts} experts (n_experts), got shape {tuple(scores[name].shape)}")
        if T_local is not None and T != T_local:
            raise ValueError(f"scores[{name!r}]: expected the same {T_local} local tokens as the other layers, got {T}")
        T_local = T
    if T_local is None:  # no layer here: the tokens are token_index's or the mask's (checked against each other in _seq_split)
        T_local = next((t.shape[0] for t in (token_index, mask) if isinstance(t, torch.Tensor) and t.dim() == 1), 0)
    layers = [(name, scores[name], experts[name]) for name in names if name in scores]
    return _seq_split(layers, names, T_local, n_experts, cu_seqlens, k=k, group=group, start=start,
                      token_index=token_index, check=check, mask=mask)


def _check_seq_layer(scores_arg: str, scores, experts_arg: str, experts, k: int) -> int:
    """One layer's scores [T_local, E] and experts [T_local, k]; returns T_local."""
    check_float(scores_arg, scores, 2, "[T_local, E]")
    check_index(experts_arg, experts, 2, "[T_local, k]")
    check_positive_int("k", k)
    if experts.shape != (scores.shape[0], k):
        raise ValueError(f"{experts_arg}: expected shape ({scores.shape[0]}, {k}) to match scores and k, got {tuple(experts.shape)}")
    return scores.shape[0]


def _seq_split(layers, names, T_local: int, E: int, cu_seqlens, *, k, group, start, token_index, check, mask) -> dict[str, torch.Tensor]:
    """The split sequence-level losses of `layers` [(name, scores, experts)], their counts
    summed over `group` in one all_reduce of [len(names), B, E] (zeros for the names not in
    layers; with a mask, one more row whose column 0 holds each document's tokens in it);
    cu_seqlens, start / token_index, mask checked here."""
    check_index("cu_seqlens", cu_seqlens, 1, "[B + 1]")
    check_token_mask("mask", mask, T_local)
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected at least 2 entries [0, ..., T], got {cu_seqlens.numel()}")
    if (start is None) == (token_index is None):
        raise ValueError("start / token_index: expected exactly one of them (a contiguous range or each token's index)")
    if start is not None:
        check_positive_int("start", start, 0)
    else:
        check_index("token_index", token_index, 1, "[T_local]")
        if token_index.shape != (T_local,):
            raise ValueError(f"token_index: expected shape ({T_local},) to match scores, got {tuple(token_index.shape)}")
    if checking(check, cu_seqlens, token_index):  # reading T is a host sync: skipped under torch.compile, like check_cu_seqlens
        total = int(cu_seqlens[-1])
        check_cu_seqlens(cu_seqlens, total)
        if start is not None and start + T_local > total:
            raise ValueError(
                f"start: this rank's tokens [start, start + T_local) = [{start}, {start + T_local}) "
                f"reach past the end of cu_seqlens (T = {total})"
            )
        if token_index is not None and T_local and not (0 <= int(token_index.min()) and int(token_index.max()) < total):
            raise ValueError(f"token_index: expected indices in [0, {total}) (T from cu_seqlens), got {int(token_index.min())}..{int(token_index.max())}")
        for name, _, experts in layers:  # as fmoe.ops.seq_load_balancing_loss's check (unchecked, such ids count nowhere)
            check_expert_ids(f"experts[{name!r}]" if name else "experts", experts, E)
    pg = process_group(group)
    if not names:  # the same on every rank (names is global): no collective to wait for
        return {}
    device = collective_device(pg, [scores for _, scores, _ in layers])
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    B = cu.numel() - 1
    if token_index is None:
        token_index = torch.arange(start, start + T_local, device=device)
    # the document b of each local token, cu[b] <= t < cu[b+1]; b indexes the global
    # documents, so the rows of the [B, E] tensors line up on every rank
    seq_T = sequence_ids(cu, T_local, index=token_index)
    counts_LBE = torch.zeros(len(names) + (mask is not None), B, E, dtype=torch.int64, device=device)
    row = {name: i for i, name in enumerate(names)}
    score_sums = {}
    if mask is not None:  # each document's tokens in the mask, summed with the counts
        mask = mask.to(device)
        counts_LBE[-1, :, 0].index_add_(0, seq_T, mask.long())
    for name, scores, experts in layers:
        if mask is not None:
            scores, experts = mask_tokens(scores, experts, mask)
        score_sums[name], counts_LBE[row[name]] = sequence_sums(scores, experts, seq_T, B)
    # f needs whole documents: sum the counts (integers, so exact and equal on every rank);
    # the scores stay local, so each rank's gradient is its own rows of the full one
    dist.all_reduce(counts_LBE, op=dist.ReduceOp.SUM, group=pg)
    # whole documents: cu_seqlens is global (the mask's row: summed over the group)
    lengths_B = (cu[1:] - cu[:-1]).float() if mask is None else counts_LBE[-1, :, 0].float()
    return {name: sequence_loss_from_sums(sums, counts_LBE[row[name]], lengths_B, k=k) for name, sums in score_sums.items()}


def z_loss_split(logits: torch.Tensor, *, n_tokens: Union[int, torch.Tensor], mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's share of the router z-loss when a micro-batch's tokens are split over
    ranks (tensor / sequence or context parallel); no collective.

        value = sum_{t on this rank} (logsumexp_e logits[t,e])^2 / n_tokens

    fmoe.ops.z_loss is a mean over the micro-batch's tokens, so the ranks' values ADD UP to
    it over the whole micro-batch, and each rank's gradient is its rows of the unsplit one.

    Args:
        logits: [T_local, E] float router logits of this rank's tokens (the MoE stats'
            router_logits; T_local may be 0).
        n_tokens: the micro-batch's token count T over all ranks of the split (an int or a
            1-element tensor); with a mask, the tokens in it over all ranks.
        mask: None, or [T_local] bool, False on this rank's tokens left out (padding): the
            sum runs over the others, as fmoe.ops.z_loss(mask=) on the whole micro-batch.
    Returns: 0-D float32 tensor.

    Example: logits of 5 and 7 tokens on two ranks, n_tokens=12: the two values sum to
    fmoe.ops.z_loss of the 12 rows.
    """
    check_float("logits", logits, 2, "[T_local, E]")
    n = _token_count("n_tokens", n_tokens)
    if isinstance(n, torch.Tensor):
        n = n.to(logits.device)
    check_token_mask("mask", mask, logits.shape[0])
    if not isinstance(n, torch.Tensor) and mask is None and n < logits.shape[0]:  # an int: checked free
        raise ValueError(f"n_tokens: expected at least this rank's {logits.shape[0]} tokens (T over all ranks of the split), got {int(n)}")
    if logits.shape[0] == 0:  # no token here: a zero that keeps the graph (and the backward) alike
        return logits.float().sum() * 0.0
    if mask is not None:
        mask = mask.to(logits.device)
        return z_loss(logits, mask=mask) * (mask.sum() / n)
    return z_loss(logits) * (logits.shape[0] / n)


def all_reduce_counts(
    counts: Mapping[str, torch.Tensor],
    group: Group,
    *,
    names: Sequence[str],
    n_experts: int,
) -> dict[str, torch.Tensor]:
    """Per-layer expert counts summed over `group`, all layers in ONE collective.

    counts maps a MoE layer's name to its [E] integer counts (tokens_per_expert, summed over
    this rank's micro-batches). `names` lists every MoE layer of the model, the same names on
    every rank (in any order: rank 0 listing layer_2 first summed its counts into another
    rank's layer_1): the counts are stacked into one [L, E] int64 tensor in sorted order and
    summed with a single all_reduce. A layer this rank does not hold (a pipeline stage
    without it, a rank with no MoE layer: counts = {}) contributes zeros, so every rank takes
    part in the same collective. Integers, so the totals are exact and identical everywhere.
    Names that differ between ranks (other layers, as many of them) make every returned
    count -1 on every rank, a value no count takes (one rank's layer_2 summed into another's
    layer_3 before): all_reduce_sums' fingerprint of the names rides in the same collective,
    compared on the device.

    Use: the expert-bias update (actual routing counts over TP x DP x CP) and the global-
    batch aux loss (aux counts over the data-parallel ranks).

    Args:
        counts: {name: [E] int tensor}; names not in `names` are a ValueError.
        group: ProcessGroup or 1-D DeviceMesh.
        names: all layer names (unique). n_experts: E.
    Returns: {name: [E] int64 total} for every name in `names`, in that order (rows of one
    [L, E] buffer, on the counts' device; on the GPU for an nccl group).

    Example: rank 0 {"a": [1, 2]}, rank 1 {} -> {"a": [1, 2]} on both.
    """
    check_positive_int("n_experts", n_experts)
    names = _check_layers(names, counts=counts)
    for name, c in counts.items():
        if not isinstance(c, torch.Tensor) or c.shape != (n_experts,):
            raise ValueError(f"counts[{name!r}]: expected a tensor of shape ({n_experts},), got {getattr(c, 'shape', type(c).__name__)}")
        if c.is_floating_point() or c.is_complex() or c.dtype == torch.bool:
            raise ValueError(f"counts[{name!r}]: expected an integer tensor (token counts), got {c.dtype}")
    pg = process_group(group)
    if not names:  # same on every rank (names is global), so no rank waits for a collective
        return {}
    device = collective_device(pg, list(counts.values()))
    rows = sorted(names)  # the buffer's rows: the same on every rank whatever order each lists its layers in
    L, E = len(rows), n_experts
    buf = torch.zeros(L * E + len(_MARK_SLOTS), dtype=torch.int64, device=device)  # the counts, then the names' fingerprint
    counts_LE = buf[:L * E].view(L, E)
    for i, name in enumerate(rows):
        if name in counts:
            counts_LE[i] = counts[name].detach()
    marks = _names_fingerprint(rows)
    for j, mark in enumerate(marks):
        buf[L * E + j].fill_(mark)  # a fill on the device, no host-to-device copy
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=pg)
    world = dist.get_world_size(pg)
    same = torch.stack([buf[L * E + j] == mark * world for j, mark in enumerate(marks)]).all()
    counts_LE = torch.where(same, counts_LE, -1)  # on the device: no host sync
    return {name: counts_LE[rows.index(name)] for name in names}


_MARK_SLOTS = range(3)


def _names_fingerprint(names: list[str]) -> list[int]:
    """A 96-bit fingerprint of a sorted list of names, as three 32-bit integers (BLAKE2b of
    its repr: names holding a separator cannot join into another list's string). Summed over
    up to 2**21 ranks each stays below 2**53, exact in float64 and int64: equal names never
    read as different, different ones pass only by chance (about 2**-96)."""
    digest = hashlib.blake2b(repr(names).encode(), digest_size=4 * len(_MARK_SLOTS)).digest()
    return [int.from_bytes(digest[4 * j:4 * j + 4], "little") for j in _MARK_SLOTS]


def global_load_balancing_loss(
    scores: torch.Tensor,
    global_counts: torch.Tensor,
    *,
    k: int,
    n_tokens: Union[int, torch.Tensor],
    n_score_tokens: Union[int, torch.Tensor, None] = None,
) -> torch.Tensor:
    """This rank's share of the global-batch switch loss (arXiv 2501.11873; SPEC.md 2).

    f_e comes from counts summed over every data-parallel rank (and the micro-batches so
    far), P_e from this rank's scores:

        value = E * sum_e f_e * (sum_{t on this rank} scores[t,e]) / n_score_tokens
        f_e   = global_counts[e] / (k * n_tokens)

    n_tokens is the token count global_counts cover; n_score_tokens (default n_tokens) the
    global token count the score sums are shared over. No collective: get global_counts
    from all_reduce_counts and n_tokens from all_reduce_sums over the data-parallel group.

    The identity (tested): if ranks r = 1..R hold disjoint token sets whose union is the N
    tokens the counts C = sum_r counts_r cover, then with n_tokens = n_score_tokens = N

        sum_r global_load_balancing_loss(scores_r, C, k=k, n_tokens=N)
            = load_balancing_loss(concat_r scores_r, C, k=k, n_tokens=N)

    (the single-process switch loss with the global counts), and the gradient w.r.t.
    scores[t,e] is E * C_e / (k N^2) on whichever rank holds token t. So the values are
    SUMMED over ranks, like the LM loss (a sum over tokens / the global token count): the
    gradients do not depend on how tokens are split, the data-parallel gradient reduction
    must sum (as for the LM loss), and the logged value is all_reduce_sums over the data-
    parallel group. With equal shares (T_r = N / R) value_r = (E sum_e f_e P_e^(r)) / R:
    the sum is the mean over ranks of the paper's LBL_global with the local P_e^(r).
    (Megatron's global aux loss has the same values, but its data-parallel gradient
    reduction averages: at one coefficient its gradient is 1/R of this one's. Where the
    micro-batches hold different numbers of valid tokens (padding), Megatron divides the
    running counts by the current micro-batch's tokens, and its loss under perfect balance
    is then no longer 1: 1.5 for a micro-batch of 4 tokens after one of 8; here f sums to 1,
    SPEC.md 2's value.)

    Micro-batches: keep running counts C_m over micro-batches 1..m (all ranks) and their
    token total N_m; at micro-batch m pass global_counts=C_m, n_tokens=N_m and
    n_score_tokens = the step's global token count, so the values add up over ranks and
    micro-batches as the LM loss does: sum_{m,e} E * C_m[e] / (k N_m) * S_m[e] / N_step.

    Args:
        scores: [T_local, E] float from aux_scores (differentiable).
        global_counts: [E] counts over all data-parallel ranks (int or float).
        k: slots per token. n_tokens, n_score_tokens: positive ints or 1-element tensors.
    Returns: 0-D float32 tensor.
    """
    # E / (k n^2) sum_e S_e C_e; the scores' mean then runs over n, rescaled to n_score below
    value = load_balancing_loss(scores, global_counts, k=k, n_tokens=n_tokens)
    if n_score_tokens is None:
        return value
    n = _token_count("n_tokens", n_tokens)
    n_score = _token_count("n_score_tokens", n_score_tokens)
    if isinstance(n, torch.Tensor):
        n = n.to(value.device)
    if isinstance(n_score, torch.Tensor):
        n_score = n_score.to(value.device)
    return value * (n / n_score)


# ----------------------------------------------------------------------------------------
# Logging sums
# ----------------------------------------------------------------------------------------


def all_reduce_sums(values: Mapping[str, Union[float, torch.Tensor]], group: Group) -> dict[str, torch.Tensor]:
    """Sum logging scalars over `group` in one collective (float64), without a host sync.

    Every rank passes the same names (in any order: they are reduced in sorted order).
    Values are Python numbers or 1-element tensors (detached; read on the device, never on
    the host: a number is filled into the buffer on the device). Returns {name: 0-D float64
    tensor} in the order of `values`, on the collective's device (the values' device; the
    GPU for nccl), so a train step keeps its logged values on the device and reads them all
    at once at its end, e.g. dict(zip(sums, torch.stack(list(sums.values())).tolist())).
    An empty mapping issues no collective (the names are the same on every rank, so none
    waits) and returns {}. Names that differ between ranks (as many of them) make every
    returned value NaN on every rank: they summed other ranks' values under the wrong names
    before. A 96-bit fingerprint of the sorted names (three 32-bit BLAKE2b slots, integers
    that float64 sums exactly for up to 2**21 ranks) rides in the same collective and is
    compared on the device (checking it on the host would cost a sync): two different sets
    of names pass it only by chance, about 2**-96.

    Example: rank 0 {"loss": 1.5, "tokens": 10}, rank 1 {"loss": 2.0, "tokens": 12}
    -> {"loss": tensor(3.5, dtype=torch.float64), "tokens": tensor(22., dtype=torch.float64)}
    on both.
    """
    if not isinstance(values, Mapping):
        raise ValueError(f"values: expected a mapping from name to number or 1-element tensor, got {type(values).__name__}")
    for name, v in values.items():
        if isinstance(v, torch.Tensor):
            if v.numel() != 1 or v.is_complex():
                raise ValueError(f"values[{name!r}]: expected a real 1-element tensor, got shape {tuple(v.shape)} {v.dtype}")
        elif isinstance(v, bool) or not isinstance(v, numbers.Real):  # numpy's scalars are numbers.Real too
            raise ValueError(f"values[{name!r}]: expected a number or a 1-element tensor, got {type(v).__name__}")
    if not all(isinstance(name, str) for name in values):  # sorted below, the same order on every rank
        raise ValueError(f"values: expected string names, got {[name for name in values if not isinstance(name, str)][:4]}")
    pg = process_group(group)
    if not values:
        return {}
    names = sorted(values)  # the same order on every rank whatever order each built the mapping in
    device = collective_device(pg, [v for v in values.values() if isinstance(v, torch.Tensor)])

    def on_device(v) -> torch.Tensor:  # 0-D float64; a number is a fill, not a host-to-device copy
        if isinstance(v, torch.Tensor):
            return v.detach().reshape(()).to(device=device, dtype=torch.float64)
        return torch.full((), float(v), dtype=torch.float64, device=device)

    # the names' fingerprint beside the values: summed, each slot is world x this rank's own only where every rank passed these names
    marks = [float(mark) for mark in _names_fingerprint(names)]
    buf = torch.stack([on_device(values[n]) for n in names] + [on_device(m) for m in marks])
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=pg)
    world = dist.get_world_size(pg)
    same = torch.stack([buf[len(names) + i] == m * world for i, m in enumerate(marks)]).all()
    sums = dict(zip(names, torch.where(same, buf[:len(names)], float("nan")).unbind(0)))  # on the device: no host sync
    return {name: sums[name] for name in values}
