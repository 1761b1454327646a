"""fmoe.parallel.reduce and fmoe.optim's grad_norm / clip_grad_norm / param_norm /
zero_grad_count over meshes, in 2 and 4 gloo processes, each result checked against one
process (the single-process checks of the gradient norm are in tests/optim/test_grads.py).

Spawning is the slow part (seconds per world), so one spawn per world size runs every
distributed check (module-scoped fixtures) and the tests assert on its results; argument
validation runs in this process (it comes before any collective).
"""


import math
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist

from fmoe import ops
from fmoe.optim import clip_grad_norm, grad_norm, param_norm, zero_grad_count
from fmoe.parallel.reduce import (
    _names_fingerprint,
    all_reduce_counts,
    all_reduce_sums,
    global_load_balancing_loss,
    seq_load_balancing_loss_split,
    seq_load_balancing_losses_split,
    z_loss_split,
)
from tests.parallel.dist import counting_all_reduce, own_groups, run_distributed

INF = float("inf")





# ---------------------------------------------------------------------------- sequence loss

# (E, k, cu_seqlens of the whole batch, token bounds of the ranks, dropped (token, slot) or None)
SEQ_CASES_2 = {
    "split inside a document": (4, 2, [0, 7, 13], [0, 4, 13], None),
    "split at a document boundary, k=1": (4, 1, [0, 6, 13], [0, 6, 13], None),
    "a whole short document plus parts": (5, 3, [0, 5, 7, 12], [0, 4, 12], None),
    "zero-length documents": (4, 2, [0, 0, 4, 4, 9, 9], [0, 6, 9], None),
    "zero-length documents at the split": (3, 1, [0, 4, 4, 9], [0, 4, 9], None),
    "a rank without tokens, a dropped slot": (3, 2, [0, 3, 8], [0, 8, 8], (2, 1)),
}
SEQ_CASES_4 = {
    "4 ranks, empty rank and documents": (6, 2, [0, 3, 3, 10, 11, 16], [0, 2, 7, 7, 16], None),
    "4 ranks, k=1": (4, 1, [0, 5, 9, 14], [0, 4, 8, 11, 14], None),
    # context parallelism's load balance: 2R chunks, rank r holds chunks r and 2R-1-r
    "4 ranks, CP chunks (token_index)": (4, 2, [0, 5, 11, 16], [[(2 * r, 2 * r + 2), (14 - 2 * r, 16 - 2 * r)] for r in range(4)], None),
}
SEQ_CASES_2["CP chunks (token_index)"] = (4, 2, [0, 5, 11, 16], [[(0, 4), (12, 16)], [(4, 12)]], None)


def _seq_inputs(E, k, cu, dropped, seed):
    gen = torch.Generator().manual_seed(seed)  # the same batch on every rank
    logits = torch.randn(cu[-1], E, generator=gen)
    upstream = torch.randn((), generator=gen)  # a random upstream gradient, not .sum()
    scores, experts = ops.aux_scores(logits, k)
    if dropped is not None:
        experts[dropped] = -1
    return scores.detach(), experts, torch.tensor(cu, dtype=torch.int32), upstream


def _seq_split_results(rank, cases, group, split_rank, seed=0):
    """Per case: this rank's value and score gradient, and the unsplit op's on the whole batch."""
    out = {}
    for name, (E, k, cu, bounds, dropped) in cases.items():
        scores, experts, cu_t, upstream = _seq_inputs(E, k, cu, dropped, seed + len(out))
        full = scores.clone().requires_grad_()
        ref = ops.seq_load_balancing_loss(full, experts, cu_t, k=k)
        (ref * upstream).backward()
        if isinstance(bounds[0], list):  # this rank's token ranges, passed as token_index
            index = torch.cat([torch.arange(lo, hi) for lo, hi in bounds[split_rank]])
            where = dict(token_index=index)
        else:  # contiguous: [start, next rank's start)
            index = torch.arange(bounds[split_rank], bounds[split_rank + 1])
            where = dict(start=bounds[split_rank])
        local = scores[index].clone().requires_grad_()
        with counting_all_reduce() as calls:
            value = seq_load_balancing_loss_split(local, experts[index], cu_t, k=k, group=group, **where)
        (value * upstream).backward()
        out[name] = dict(value=value.detach(), ref=ref.detach(), grad=local.grad, ref_grad=full.grad[index], calls=len(calls))
        # padding: every third token and the last document left out, in the same one collective
        keep = (torch.arange(cu[-1]) % 3 != 1) & (torch.arange(cu[-1]) < cu[-2])
        full = scores.clone().requires_grad_()
        ref = ops.seq_load_balancing_loss(full, experts, cu_t, k=k, mask=keep)
        (ref * upstream).backward()
        local = scores[index].clone().requires_grad_()
        with counting_all_reduce() as calls:
            value = seq_load_balancing_loss_split(local, experts[index], cu_t, k=k, group=group, mask=keep[index], **where)
        (value * upstream).backward()
        out[name + ", padding"] = dict(value=value.detach(), ref=ref.detach(), grad=local.grad, ref_grad=full.grad[index], calls=len(calls),
                                       unmasked_ref=out[name]["ref"])
    return out


def _check_seq_split(results, cases, ranks_of_group):
    for name in [n for case in cases for n in (case, case + ", padding")]:
        per_rank = [results[r][name] for r in ranks_of_group]
        ref = per_rank[0]["ref"]
        total = sum(float(r["value"]) for r in per_rank)
        assert total == pytest.approx(float(ref), rel=1e-5), name
        if "unmasked_ref" in per_rank[0]:  # the padding changed the loss (the masked lengths travel with the counts)
            assert float(ref) != pytest.approx(float(per_rank[0]["unmasked_ref"]), rel=1e-3), name
        for r in per_rank:
            assert r["calls"] == 1, name
            torch.testing.assert_close(r["grad"], r["ref_grad"], rtol=1e-5, atol=1e-7, msg=name)


def _seq_layers_results(rank, world_size, E=4, k=2, cu=(0, 5, 11, 16)):
    """Every layer at once (seq_load_balancing_losses_split): two of the three names held,
    each layer its own scores; and a world where only rank 0 holds tokens and layers."""
    cu_t = torch.tensor(cu, dtype=torch.int32)
    bounds = [0, 9, 16] if world_size == 2 else [0, 3, 9, 9, 16]
    index = torch.arange(bounds[rank], bounds[rank + 1])
    held = [LAYERS[0], LAYERS[2]]
    scores, experts, refs = {}, {}, {}
    for i, name in enumerate(held):
        s, e, _, _ = _seq_inputs(E, k, list(cu), None, seed=50 + i)
        scores[name], experts[name] = s[index].clone().requires_grad_(), e[index]
        refs[name] = float(ops.seq_load_balancing_loss(s, e, cu_t, k=k))
    with counting_all_reduce() as calls:
        values = seq_load_balancing_losses_split(scores, experts, cu_t, k=k, group=dist.group.WORLD, names=LAYERS, n_experts=E, start=bounds[rank])
    keep = torch.arange(cu[-1]) % 4 != 0  # padding: the layers' losses without it, still one collective
    with counting_all_reduce() as masked_calls:
        masked = seq_load_balancing_losses_split({n: t.detach() for n, t in scores.items()}, experts, cu_t, k=k, group=dist.group.WORLD,
                                                 names=LAYERS, n_experts=E, start=bounds[rank], mask=keep[index])
    masked_refs = {}
    for i, name in enumerate(held):
        s, e, _, _ = _seq_inputs(E, k, list(cu), None, seed=50 + i)
        masked_refs[name] = float(ops.seq_load_balancing_loss(s, e, cu_t, k=k, mask=keep))
    one_by_one = {}
    for name in held:  # the one-layer function: the same value and gradient
        local = scores[name].detach().clone().requires_grad_()
        one = seq_load_balancing_loss_split(local, experts[name], cu_t, k=k, group=dist.group.WORLD, start=bounds[rank])
        one.backward()
        values[name].backward()
        one_by_one[name] = dict(value=float(one), grad=local.grad, grads_equal=torch.allclose(scores[name].grad, local.grad, rtol=1e-6, atol=1e-8))
    # only rank 0 holds tokens (all of them) and layers: the others send zeros for every name
    s, e, _, _ = _seq_inputs(E, k, list(cu), None, seed=60)
    lonely_in = ({LAYERS[1]: s}, {LAYERS[1]: e}) if rank == 0 else ({}, {})
    with counting_all_reduce() as lonely_calls:
        lonely = seq_load_balancing_losses_split(*lonely_in, cu_t, k=k, group=dist.group.WORLD, names=LAYERS, n_experts=E,
                                                 start=0 if rank == 0 else 16)
    # no MoE layer in the model (names = []): the same on every rank, so no collective at all
    with counting_all_reduce() as no_layer_calls:
        no_layer = seq_load_balancing_losses_split({}, {}, cu_t, k=k, group=dist.group.WORLD, names=[], n_experts=E, start=bounds[rank])
    return dict(values={n: float(v) for n, v in values.items()}, refs=refs, calls=len(calls), one_by_one=one_by_one,
                no_layer=no_layer, no_layer_calls=len(no_layer_calls),
                masked={n: float(v) for n, v in masked.items()}, masked_refs=masked_refs, masked_calls=len(masked_calls),
                lonely={n: float(v) for n, v in lonely.items()}, lonely_ref=float(ops.seq_load_balancing_loss(s, e, cu_t, k=k)),
                lonely_calls=len(lonely_calls), layerless=_layerless_results(rank, world_size, bounds, E, k, cu))


def _layerless_results(rank, world_size, bounds, E, k, cu):
    """The odd ranks hold no MoE layer (scores = experts = {}) but split the tokens with the
    others, each passing its own token_index, or start, and a mask: they send zeros and their
    mask's tokens, so the even ranks' values add up to the one-process loss with the odd ranks'
    tokens routed nowhere (experts -1, scores 0), the same lengths S_b."""
    cu_t = torch.tensor(cu, dtype=torch.int32)
    T = cu[-1]
    s, e, _, _ = _seq_inputs(E, k, list(cu), None, seed=70)
    keep = torch.arange(T) % 5 != 2
    strided = (torch.arange(rank, T, world_size), torch.arange(T) % world_size)  # (this rank's tokens, each token's rank)
    contiguous = (torch.arange(bounds[rank], bounds[rank + 1]), torch.searchsorted(torch.tensor(bounds[1:]), torch.arange(T), right=True))
    out = {}
    for variant, (index, owner), mask in (("token_index", strided, None), ("start, mask", contiguous, keep),
                                          ("token_index, mask", strided, keep)):
        where = dict(start=bounds[rank]) if variant.startswith("start") else dict(token_index=index)
        gone = (owner % 2 == 1)[:, None]
        ref = ops.seq_load_balancing_loss(s.masked_fill(gone, 0.0), e.masked_fill(gone, -1), cu_t, k=k, mask=mask)
        held = ({LAYERS[1]: s[index]}, {LAYERS[1]: e[index]}) if rank % 2 == 0 else ({}, {})
        with counting_all_reduce() as calls:
            got = seq_load_balancing_losses_split(*held, cu_t, k=k, group=dist.group.WORLD, names=LAYERS, n_experts=E,
                                                  mask=None if mask is None else mask[index], **where)
        out[variant] = dict(values={n: float(v) for n, v in got.items()}, ref=float(ref), calls=len(calls))
    return out


def _check_seq_layers(results):
    for name in (LAYERS[0], LAYERS[2]):
        total = sum(r["values"][name] for r in results)
        assert total == pytest.approx(results[0]["refs"][name], rel=1e-5), name
        for r in results:
            assert r["values"][name] == pytest.approx(r["one_by_one"][name]["value"], rel=1e-6, abs=1e-9)
            assert r["one_by_one"][name]["grads_equal"], name
    assert [r["calls"] for r in results] == [1] * len(results)  # one collective for all layers
    assert all(r["no_layer"] == {} and r["no_layer_calls"] == 0 for r in results)
    for name in (LAYERS[0], LAYERS[2]):
        assert sum(r["masked"][name] for r in results) == pytest.approx(results[0]["masked_refs"][name], rel=1e-5), name
        assert results[0]["masked_refs"][name] != pytest.approx(results[0]["refs"][name], rel=1e-3), name
    assert [r["masked_calls"] for r in results] == [1] * len(results)
    assert results[0]["refs"][LAYERS[0]] != results[0]["refs"][LAYERS[2]]  # the layers differ
    assert results[0]["lonely"] == {LAYERS[1]: pytest.approx(results[0]["lonely_ref"], rel=1e-6)}
    assert all(r["lonely"] == {} for r in results[1:]) and [r["lonely_calls"] for r in results] == [1] * len(results)
    for variant in results[0]["layerless"]:  # ranks without a layer join the one collective, their tokens counted in S_b
        per_rank = [r["layerless"][variant] for r in results]
        assert [r["calls"] for r in per_rank] == [1] * len(results), variant
        assert all(r["values"] == {} for r in per_rank[1::2]), variant
        total = sum(r["values"][LAYERS[1]] for r in per_rank[0::2])
        assert total == pytest.approx(per_rank[0]["ref"], rel=1e-5), variant


# ---------------------------------------------------------------------------- counts, sums

LAYERS = ["layers.1.moe", "layers.3.moe", "layers.5.moe"]
N_EXPERTS = 4


def _layer_counts(rank, world_size):
    """Which layers each rank holds: rank 0 all, the last rank none, the others some."""
    if rank == world_size - 1:
        held = []
    elif rank == 0:
        held = LAYERS
    else:
        held = LAYERS[rank % 2 :: 2]
    # a layer's counts in the order a rank would build them (not `names` order)
    return {name: torch.arange(N_EXPERTS, dtype=torch.int64) * (rank + 1) + 10 * i for i, name in reversed(list(enumerate(LAYERS))) if name in held}


def _counts_results(rank, world_size, group=None):
    group = dist.group.WORLD if group is None else group
    with counting_all_reduce() as calls:
        totals = all_reduce_counts(_layer_counts(rank, world_size), group, names=LAYERS, n_experts=N_EXPERTS)
    with counting_all_reduce() as no_layer_calls:  # no MoE layer in the model: no collective
        no_layer = all_reduce_counts({}, group, names=[], n_experts=N_EXPERTS)
    return dict(totals=totals, calls=len(calls), no_layer=no_layer, no_layer_calls=len(no_layer_calls))


def _check_counts(results, ranks=None, world_size=None):
    """results: the ranks' (default: every rank of the world, in order) over their group."""
    world_size = len(results) if world_size is None else world_size
    ranks = range(world_size) if ranks is None else ranks
    expected = {name: torch.zeros(N_EXPERTS, dtype=torch.int64) for name in LAYERS}
    for r in ranks:
        for name, c in _layer_counts(r, world_size).items():
            expected[name] += c
    assert any(not _layer_counts(r, world_size) for r in range(world_size))  # a rank with no layer
    for result in results:
        assert result["calls"] == 1
        assert result["no_layer"] == {} and result["no_layer_calls"] == 0
        assert list(result["totals"]) == LAYERS
        for name in LAYERS:
            assert result["totals"][name].dtype == torch.int64
            assert torch.equal(result["totals"][name], expected[name]), name


def _sums_results(rank, group):
    items = [("loss", torch.tensor([1.5 + rank])), ("tokens", 10 + 2 * rank), ("z", 0.25), ("big", torch.tensor(2**40 + rank, dtype=torch.int64))]
    values = dict(items if rank % 2 == 0 else reversed(items))  # order differs between ranks
    host_reads = []
    original_tolist, original_item = torch.Tensor.tolist, torch.Tensor.item
    torch.Tensor.tolist = lambda t: host_reads.append("tolist") or original_tolist(t)
    torch.Tensor.item = lambda t: host_reads.append("item") or original_item(t)
    try:
        with counting_all_reduce() as calls:
            sums = all_reduce_sums(values, group)
    finally:
        torch.Tensor.tolist, torch.Tensor.item = original_tolist, original_item
    with counting_all_reduce() as empty_calls:  # nothing to log: {} and no collective
        empty = all_reduce_sums({}, group)
    return dict(sums=sums, calls=len(calls), order=list(values), host_reads=host_reads, empty=empty, empty_calls=len(empty_calls))


def _check_sums(results, ranks):
    expected = {
        "loss": sum(1.5 + r for r in ranks), "tokens": float(sum(10 + 2 * r for r in ranks)), "z": 0.25 * len(ranks),
        "big": float(sum(2**40 + r for r in ranks)),  # exact in float64, not in float32
    }
    for result in results:
        assert result["calls"] == 1 and result["host_reads"] == []
        assert result["empty"] == {} and result["empty_calls"] == 0
        assert list(result["sums"]) == result["order"]
        for name, value in result["sums"].items():  # 0-D float64 tensors, read here only
            assert isinstance(value, torch.Tensor) and value.dtype == torch.float64 and value.dim() == 0, name
            assert value.item() == expected[name], name


# ---------------------------------------------------------------------------- global loss


def _global_loss_results(rank, world_size, bounds, E=5, k=2, H=3):
    """Each rank routes its own tokens through a shared router; its loss uses the global
    counts. Returns the per-rank value and gradients and the single-process ones."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(bounds[-1], H, generator=gen)
    w0 = torch.randn(H, E, generator=gen)
    upstream = torch.randn((), generator=gen)

    w_ref = w0.clone().requires_grad_()
    scores_ref, experts_ref = ops.aux_scores(x @ w_ref, k)
    scores_ref.retain_grad()
    counts_ref = ops.tokens_per_expert(experts_ref, E)
    ref = ops.load_balancing_loss(scores_ref, counts_ref, k=k, n_tokens=bounds[-1])
    (ref * upstream).backward()

    lo, hi = bounds[rank], bounds[rank + 1]
    w = w0.clone().requires_grad_()
    scores, experts = ops.aux_scores(x[lo:hi] @ w, k)
    scores.retain_grad()
    counts = all_reduce_counts({"moe": ops.tokens_per_expert(experts, E)}, dist.group.WORLD, names=["moe"], n_experts=E)["moe"]
    n_tokens = int(all_reduce_sums({"tokens": hi - lo}, dist.group.WORLD)["tokens"])  # the test reads it
    value = global_load_balancing_loss(scores, counts, k=k, n_tokens=n_tokens)
    (value * upstream).backward()
    return dict(
        value=value.detach(), ref=ref.detach(), counts=counts, counts_ref=counts_ref, n_tokens=n_tokens,
        w_grad=w.grad, w_grad_ref=w_ref.grad, scores_grad=scores.grad, scores_grad_ref=scores_ref.grad[lo:hi],
    )


def _check_global_loss(results, n_total):
    ref = results[0]["ref"]
    assert sum(float(r["value"]) for r in results) == pytest.approx(float(ref), rel=1e-5)
    w_grad = sum(r["w_grad"] for r in results)  # what the data-parallel gradient sum gives
    torch.testing.assert_close(w_grad, results[0]["w_grad_ref"], rtol=1e-5, atol=1e-7)
    for r in results:
        assert r["n_tokens"] == n_total
        assert torch.equal(r["counts"], r["counts_ref"])
        torch.testing.assert_close(r["scores_grad"], r["scores_grad_ref"], rtol=1e-5, atol=1e-8)


# ---------------------------------------------------------------------------- grad norm


def _full_grads():
    gen = torch.Generator().manual_seed(3)  # the same full gradients on every rank
    grads = {
        "dense.weight": torch.randn(3, 5, generator=gen),  # uneven shards over 2, empty over 4
        "dense.bias": torch.randn(3, generator=gen),
        "experts": torch.randn(4, 3, 2, generator=gen),
        "tp": torch.randn(2, 6, generator=gen),
        "plain": torch.randn(7, generator=gen),
    }
    grads["experts"][3, 1, 1] = -7.5  # the largest |g|, on the last expert-parallel rank only
    return grads


def _full_values():
    """Parameter values (the same on every rank) and gradients with exact zeros: rows, a
    whole expert, single elements."""
    gen = torch.Generator().manual_seed(4)
    values = {n: torch.randn(g.shape, generator=gen) for n, g in _full_grads().items()}
    grads = _full_grads()
    grads["dense.weight"][1] = 0.0
    grads["experts"][2] = -0.0  # an expert no token reached
    grads["experts"][0, 1, 1] = 0.0
    grads["tp"][:, 5] = 0.0
    grads["plain"][3] = 0.0
    return values, grads


def _toy_params(meshes):
    """Parameters on different meshes: FSDP2 over the dense data mesh, experts Shard(0) over
    ep (and FSDP2 over edp), a TP shard Shard(1) over tp, a plain replicated tensor."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    dense = torch.nn.Linear(5, 3)
    fully_shard(dense, mesh=meshes.dp_mesh)
    experts = torch.nn.Module()
    experts.w = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 3, 2), meshes.expert["ep"], [Shard(0)], src_data_rank=None))
    if meshes.edp > 1:
        fully_shard(experts, mesh=meshes.expert["edp"])
    params = {"dense.weight": dense.weight, "dense.bias": dense.bias, "experts": experts.w, "plain": torch.nn.Parameter(torch.zeros(7))}
    if meshes.tp > 1:
        params["tp"] = torch.nn.Parameter(distribute_tensor(torch.zeros(2, 6), meshes.tp_mesh, [Shard(1)], src_data_rank=None))
    return params


def _like(param, full):
    """`full` laid out as `param` (the same DTensor spec), or a plain copy."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full.clone()


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _norm(tensors, p):
    return float(torch.linalg.vector_norm(torch.cat([t.flatten() for t in tensors]), p))


def _grad_norm_results(rank, world_size, configs):
    out = {}
    for name, cfg in configs.items():
        with own_groups():
            out[name] = _grad_norm_case(cfg)
    return out


def _grad_norm_case(cfg):
    """One mesh layout's grad_norm / clip_grad_norm / param_norm results on this rank."""
    from fmoe.model import copy_full_value
    from fmoe.parallel.mesh import build_meshes

    meshes = build_meshes(**cfg)
    params = _toy_params(meshes)
    full = {n: g for n, g in _full_grads().items() if n in params}
    res = dict(expected2=_norm(full.values(), 2), expected_inf=_norm(full.values(), INF))
    for n, p in params.items():
        p.grad = _like(p, full[n])
    with counting_all_reduce() as calls:
        res["norm2"] = grad_norm(params.values())
        res["norm_inf"] = grad_norm(list(params.values()), norm_type=INF)
    res["calls"] = len(calls)
    res["norm3"], res["expected3"] = grad_norm(params.values(), norm_type=3), _norm(full.values(), 3)
    res["norm2_loop"] = grad_norm(params.values(), foreach=False)  # a loop instead of _foreach_norm

    if meshes.tp == 1:  # a group of one rank (tp): no collective; plain grads as torch does
        plain = params["plain"]
        with counting_all_reduce() as calls:
            res["one_rank"] = clip_grad_norm([plain], 0.5, group=meshes.tp_mesh)
        res["one_rank_calls"] = len(calls)
        ref = torch.nn.Parameter(torch.zeros(7))
        ref.grad = full["plain"].clone()
        res["one_rank_expected"] = torch.nn.utils.clip_grad_norm_([ref], 0.5).float()
        res["one_rank_grad_same"] = torch.equal(plain.grad, ref.grad)
        with pytest.raises(ValueError, match=r"parameters\[0\]: its gradient's mesh has \d+ ranks, which does not divide the 1"):
            grad_norm([params["experts"]], group=meshes.tp_mesh)
        plain.grad = _like(plain, full["plain"])

    # clipping to a quarter: every local shard scaled by max_norm / (norm + 1e-6)
    max_norm = res["expected2"] / 4
    res["clip_returned"] = clip_grad_norm(params.values(), max_norm)
    coef = max_norm / (res["clip_returned"] + 1e-6)
    res["clip_error"] = max(float((_local(p.grad) - _local(_like(p, full[n] * coef))).abs().sum()) for n, p in params.items())
    res["after_clip"], res["max_norm"] = grad_norm(params.values()), max_norm
    for n, p in params.items():
        p.grad = _like(p, full[n])
    res["clip_loop_returned"] = clip_grad_norm(params.values(), max_norm, foreach=False)
    res["clip_loop_error"] = max(float((_local(p.grad) - _local(_like(p, full[n] * coef))).abs().sum()) for n, p in params.items())
    before = {n: _local(p.grad).clone() for n, p in params.items()}
    res["inf_after_clip"] = grad_norm(params.values(), norm_type=INF)
    res["clip_big_returned"] = clip_grad_norm(params.values(), 1e6, norm_type=INF)
    res["clip_big_unchanged"] = all(torch.equal(_local(p.grad), before[n]) for n, p in params.items())

    # the expert gradient missing on the ranks of one expert-parallel coordinate
    ep_rank, rows = meshes.expert["ep"].get_local_rank(), 4 // meshes.ep
    missing = full["experts"].clone()
    missing[rows : 2 * rows] = 0
    for n, p in params.items():
        p.grad = _like(p, full[n])
    if ep_rank == 1:
        params["experts"].grad = None
    res["norm_missing"] = grad_norm(params.values())
    res["expected_missing"] = _norm([missing] + [g for n, g in full.items() if n != "experts"], 2)

    # a rank holding no parameter at all still takes part
    mine = [params["experts"]] if ep_rank == 0 else []
    params["experts"].grad = _like(params["experts"], full["experts"]) if ep_rank == 0 else None
    res["norm_nothing"] = grad_norm(mine, norm_type=INF)
    res["expected_nothing"] = _norm([full["experts"][:rows]], INF)

    # param_norm and zero_grad_count: each element once, as one process counts them;
    # dense.bias has no gradient on any rank (all its elements count)
    values, zeroed = _full_values()
    with torch.no_grad():
        for n, p in params.items():
            copy_full_value(p, values[n])
            p.grad = None if n == "dense.bias" else _like(p, zeroed[n])
    with counting_all_reduce() as calls:
        res["param_norm"] = param_norm(params.values())
        res["zero_count"] = zero_grad_count(params.values())
    res["health_calls"], res["names"] = len(calls), list(params)
    return res


def _check_grad_norm(results, configs):
    for name in configs:
        per_rank = [r[name] for r in results]
        for key in ("norm2", "norm_inf", "norm3", "norm2_loop", "clip_returned", "clip_loop_returned", "after_clip", "norm_missing", "norm_nothing",
                    "param_norm"):
            values = [r[key] for r in per_rank]
            assert all(v.dtype == torch.float32 and v.dim() == 0 for v in values), (name, key)
            assert all(torch.equal(v, values[0]) for v in values), (name, key, values)  # identical everywhere
        r = per_rank[0]
        assert r["calls"] == 2, name  # one collective per norm
        assert float(r["norm2"]) == pytest.approx(r["expected2"], rel=1e-5), name
        assert float(r["norm_inf"]) == r["expected_inf"] == 7.5, name
        assert float(r["norm3"]) == pytest.approx(r["expected3"], rel=1e-5), name
        assert float(r["norm2_loop"]) == pytest.approx(r["expected2"], rel=1e-5), name
        assert float(r["clip_loop_returned"]) == pytest.approx(r["expected2"], rel=1e-5), name
        assert float(r["clip_returned"]) == pytest.approx(r["expected2"], rel=1e-5), name
        assert float(r["after_clip"]) == pytest.approx(r["max_norm"], rel=1e-5), name
        assert float(r["norm_missing"]) == pytest.approx(r["expected_missing"], rel=1e-5), name
        assert float(r["norm_nothing"]) == r["expected_nothing"], name
        # param_norm, zero_grad_count: one collective each, the values of one process
        # (this one: torch.distributed is not initialised here) on the full tensors
        assert not dist.is_initialized()
        values, zeroed = _full_values()
        one = {n: torch.nn.Parameter(values[n]) for n in r["names"]}
        for n, p in one.items():
            p.grad = None if n == "dense.bias" else zeroed[n]
        assert r["health_calls"] == 2, name
        exact = float(torch.cat([p.detach().double().flatten() for p in one.values()]).norm())
        assert float(r["param_norm"]) == pytest.approx(float(param_norm(one.values())), rel=1e-6), name
        assert float(r["param_norm"]) == pytest.approx(exact, rel=1e-6), name
        zeros = zero_grad_count(one.values())
        assert int(zeros) == sum(int((p.grad == 0).sum()) for p in one.values() if p.grad is not None) + 3, name
        for q in per_rank:
            assert q["zero_count"].dtype == torch.int64 and q["zero_count"].dim() == 0, name
            assert int(q["zero_count"]) == int(zeros), name
        for q in per_rank:
            assert q["clip_error"] < 1e-6 and q["clip_loop_error"] < 1e-6, name
            if "one_rank" in q:
                assert q["one_rank_calls"] == 0 and torch.equal(q["one_rank"], q["one_rank_expected"]), name
                assert q["one_rank_grad_same"], name
            assert q["clip_big_unchanged"], name  # below max_norm: the gradients are left alone
            assert torch.equal(q["clip_big_returned"], q["inf_after_clip"]), name


# ---------------------------------------------------------------------------- refusals that need a world


def _world_refusals(rank, world_size):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from fmoe.parallel.mesh import build_meshes

    meshes = build_meshes(dp_shard=-1, ep=world_size)
    refused = {}
    with pytest.raises(ValueError, match="group: .*1-D DeviceMesh, got a 4-D mesh"):
        all_reduce_sums({"a": 1.0}, meshes.dense)
    refused["2-D mesh"] = True
    p = torch.nn.Parameter(DTensor.from_local(torch.zeros(2), meshes.axis("ep"), [Replicate()]))
    p.grad = DTensor.from_local(torch.ones(2), meshes.axis("ep"), [Partial()])
    with pytest.raises(ValueError, match=r"parameters\[0\]: .*Partial"):
        grad_norm([p])
    refused["Partial grad"] = True
    # a group of the gradient's mesh size over other ranks: the tp pair beside a gradient sharded over dp_shard (rank 0: ranks 0, 2
    # against 0, 1) summed other shards, 5.29 on ranks 0-1 and 15.87 on ranks 2-3 for 11.83, each pair clipping by its own factor
    sliced = build_meshes(dp_shard=2, tp=2, ep=1)
    q = torch.nn.Parameter(distribute_tensor(torch.zeros(8), sliced.axis("dp_shard"), [Shard(0)]))
    q.grad = distribute_tensor(torch.arange(8.0), sliced.axis("dp_shard"), [Shard(0)])
    shard = sorted(sliced.axis("dp_shard").mesh.tolist())
    for fn in (grad_norm, lambda ps, group: clip_grad_norm(ps, 1.0, group=group)):
        with pytest.raises(ValueError, match=rf"^parameters\[0\]: its gradient's mesh holds ranks {re.escape(str(shard))}, not all in "
                                             rf"the group's ranks {re.escape(str(sorted(sliced.axis('tp').mesh.tolist())))}"):
            fn([q], group=sliced.axis("tp"))
    refused["group beside the mesh"] = torch.equal(q.grad.to_local(), torch.arange(8.0).chunk(2)[sliced.axis("dp_shard").get_local_rank()])  # left unscaled
    refused["norm over the world"] = grad_norm([q]).item() == pytest.approx(float(torch.arange(8.0).norm()))
    return refused


# ---------------------------------------------------------------------------- the two worlds

GRAD_CONFIGS_2 = {
    "fsdp over dp, experts over ep": dict(dp_shard=2, ep=2),
    "tp, dp of one rank": dict(dp_shard=1, tp=2, ep=2),
}
GRAD_CONFIGS_4 = {
    "fsdp and tp slices, experts over edp x ep": dict(dp_shard=2, tp=2, ep=2),
    "hsdp, experts over ep": dict(dp_replicate=2, dp_shard=2, ep=2),
    "fsdp over 4 (an empty shard), tp none": dict(dp_shard=4, ep=2),
}


def _mismatched_names_results(rank):
    """Ranks passing other names: rank 0 {loss, aux}, rank 1 {loss, z} summed into each other's
    names (loss 1.5 and 102 for 3.0); layers listed in another order summed into each other's."""
    sums = all_reduce_sums({"loss": 1.0 + rank, "aux" if rank == 0 else "z": 100.0 if rank == 0 else 0.5}, dist.group.WORLD)
    names = ["layer_1", "layer_2"] if rank == 0 else ["layer_2", "layer_1"]
    own = {"layer_1": torch.tensor([10, 0]), "layer_2": torch.tensor([0, 14])} if rank == 0 else {"layer_1": torch.tensor([1, 2]), "layer_2": torch.tensor([3, 4])}
    counts = all_reduce_counts(own, dist.group.WORLD, names=names, n_experts=2)
    # other layers, as many of them: rank 0's layer_2 [10, 0] and rank 1's layer_3 [0, 7] summed into each other ([10, 7] on both)
    other = ["layer_1", "layer_2"] if rank == 0 else ["layer_1", "layer_3"]
    crossed = all_reduce_counts({"layer_1": torch.tensor([1, 1]), other[1]: torch.tensor([10, 0] if rank == 0 else [0, 7])}, dist.group.WORLD,
                                names=other, n_experts=2)
    # names a weak fingerprint took for the same: crc32 % 2**20 of these two collides; joined by "\0", these two lists read alike
    collided = all_reduce_sums({"loss_130": 1.0} if rank == 0 else {"loss_22100": 2.0}, dist.group.WORLD)
    joined = all_reduce_sums({"a\0b": 1.0, "c": 2.0} if rank == 0 else {"a": 1.0, "b\0c": 2.0}, dist.group.WORLD)
    # names whose fingerprints agree in their first 32 bits only: each of the three slots is checked, not any one
    first_slot = "loss_2314" if rank == 0 else "loss_85585"
    slot_sums = all_reduce_sums({first_slot: 1.5 + rank}, dist.group.WORLD)
    slot_counts = all_reduce_counts({first_slot: torch.tensor([1, 2])}, dist.group.WORLD, names=[first_slot], n_experts=2)
    return dict(sums={k: v.item() for k, v in sums.items()}, counts={k: v.tolist() for k, v in counts.items()}, order=list(counts),
                crossed={k: v.tolist() for k, v in crossed.items()},
                collided={k: v.item() for k, v in collided.items()}, joined={k: v.item() for k, v in joined.items()},
                slot_sums={k: v.item() for k, v in slot_sums.items()}, slot_counts={k: v.tolist() for k, v in slot_counts.items()})


def _nan_inf_norm_results(rank, world_size):
    """The inf norm of a gradient sharded over the ranks with a NaN on one rank's shard only
    (rows 0-3 on rank 0, 4-7 on rank 1), for the NaN on each rank in turn."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for nan_row in (1, 6):
        full = torch.arange(1.0, 9.0).reshape(8, 1)
        full[nan_row, 0] = float("nan")
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 1), mesh, [Shard(0)]))
        p.grad = distribute_tensor(full, mesh, [Shard(0)])
        norm = grad_norm([p], norm_type=INF)
        clipped = clip_grad_norm([p], 1.0, norm_type=INF)
        out[nan_row] = (norm.item(), clipped.item(), p.grad.to_local().isnan().all().item())
    return out


def _world2(rank, world_size):
    return dict(
        nan_inf=_nan_inf_norm_results(rank, world_size),
        seq=_seq_split_results(rank, SEQ_CASES_2, dist.group.WORLD, rank),
        seq_layers=_seq_layers_results(rank, world_size),
        counts=_counts_results(rank, world_size),
        sums=_sums_results(rank, dist.group.WORLD),
        mismatched=_mismatched_names_results(rank),
        global_loss=_global_loss_results(rank, world_size, [0, 4, 11]),
        grad_norm=_grad_norm_results(rank, world_size, GRAD_CONFIGS_2),
    )


def _world4(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from fmoe.parallel.mesh import build_meshes

    world_mesh = init_device_mesh("cpu", (world_size,))
    # two data-parallel pairs, each splitting its own batch over its tp pair
    meshes = build_meshes(dp_shard=2, tp=2, ep=1)
    tp_cases = {"tp pair": SEQ_CASES_2["a whole short document plus parts"]}
    dp_rank, tp_rank = divmod(rank, 2)
    return dict(
        seq=_seq_split_results(rank, SEQ_CASES_4, world_mesh, rank),
        seq_layers=_seq_layers_results(rank, world_size),
        seq_tp=_seq_split_results(rank, tp_cases, meshes.axis("tp"), tp_rank, seed=100 * dp_rank),
        counts=_counts_results(rank, world_size),
        counts_dp=_counts_results(rank, world_size, meshes.axis("dp")),
        sums=_sums_results(rank, meshes.axis("dp")),
        global_loss=_global_loss_results(rank, world_size, [0, 3, 3, 8, 14]),
        grad_norm=_grad_norm_results(rank, world_size, GRAD_CONFIGS_4),
        refusals=_world_refusals(rank, world_size),
    )


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_world2, 2, timeout=120)


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_world4, 4, timeout=180)


# ---------------------------------------------------------------------------- tests


def test_an_inf_norm_is_nan_on_every_rank_where_one_rank_s_shard_holds_a_nan(world2):
    """gloo's MAX of NaN and a number gives either, by the ranks' order: a NaN on rank 1's
    shard gave an inf norm of 4.0 (rank 0's maximum), and the clip scaled the gradients by a
    finite factor. Now NaN on both ranks, wherever the NaN is, and the clip's gradients NaN
    (as one process's clip_grad_norm makes them)."""
    for r in world2:
        for nan_row in (1, 6):
            norm, clipped, grads_nan = r["nan_inf"][nan_row]
            assert math.isnan(norm) and math.isnan(clipped) and grads_nan, (nan_row, r["nan_inf"])


def test_seq_loss_split_over_2_ranks_adds_up_to_unsplit(world2):
    _check_seq_split([r["seq"] for r in world2], SEQ_CASES_2, [0, 1])


def test_seq_loss_split_over_4_ranks_and_over_tp_pairs(world4):
    _check_seq_split([r["seq"] for r in world4], SEQ_CASES_4, [0, 1, 2, 3])
    seq_tp = [r["seq_tp"] for r in world4]
    for pair in ([0, 1], [2, 3]):  # each pair its own batch: reduced over its tp group only
        _check_seq_split(seq_tp, {"tp pair": None}, pair)
    assert float(seq_tp[0]["tp pair"]["ref"]) != float(seq_tp[2]["tp pair"]["ref"])


def test_seq_losses_of_every_layer_in_one_collective(world2, world4):
    _check_seq_layers([r["seq_layers"] for r in world2])
    _check_seq_layers([r["seq_layers"] for r in world4])


def test_all_reduce_counts_one_collective_and_ranks_without_layers(world2, world4):
    _check_counts([r["counts"] for r in world2])
    _check_counts([r["counts"] for r in world4])
    for pair in ([0, 2], [1, 3]):  # over the dp axis (a 1-D DeviceMesh): summed over the pair only
        _check_counts([world4[r]["counts_dp"] for r in pair], pair, 4)


def test_all_reduce_sums(world2, world4):
    _check_sums([r["sums"] for r in world2], [0, 1])
    for pair in ([0, 2], [1, 3]):  # over the dp axis (a 1-D DeviceMesh): the ranks of one tp index
        _check_sums([world4[r]["sums"] for r in pair], pair)


def test_names_that_differ_between_ranks_never_sum_into_each_other(world2):
    """all_reduce_sums: every value NaN on every rank (a fingerprint of the names rides in the
    collective, read on the device); all_reduce_counts: each layer's own counts whatever order
    each rank lists the layers in, every count -1 where the ranks name other layers."""
    for rank, result in enumerate(world2):
        got = result["mismatched"]
        assert list(got["sums"]) == ["loss", "aux" if rank == 0 else "z"] and all(v != v for v in got["sums"].values()), got
        for key in ("collided", "joined"):
            assert len(got[key]) == (1 if key == "collided" else 2) and all(v != v for v in got[key].values()), (key, got[key])
        assert got["counts"] == {"layer_1": [11, 2], "layer_2": [3, 18]} and got["order"] == (["layer_1", "layer_2"] if rank == 0 else ["layer_2", "layer_1"])
        assert got["crossed"] == {"layer_1": [-1, -1], "layer_2" if rank == 0 else "layer_3": [-1, -1]}, got["crossed"]
        name = "loss_2314" if rank == 0 else "loss_85585"
        assert _names_fingerprint(["loss_2314"])[0] == _names_fingerprint(["loss_85585"])[0]  # the pair's first 32 bits agree
        assert list(got["slot_sums"]) == [name] and got["slot_sums"][name] != got["slot_sums"][name], got["slot_sums"]
        assert got["slot_counts"] == {name: [-1, -1]}, got["slot_counts"]


def test_global_loss_adds_up_over_ranks_and_gradients_sum(world2, world4):
    _check_global_loss([r["global_loss"] for r in world2], 11)
    _check_global_loss([r["global_loss"] for r in world4], 14)


def test_grad_norm_and_clip_over_meshes_2_ranks(world2):
    _check_grad_norm([r["grad_norm"] for r in world2], GRAD_CONFIGS_2)


def test_grad_norm_and_clip_over_meshes_4_ranks(world4):
    _check_grad_norm([r["grad_norm"] for r in world4], GRAD_CONFIGS_4)


def test_refusals_that_need_a_world(world4):
    for r in world4:
        assert r["refusals"] == {"2-D mesh": True, "Partial grad": True, "group beside the mesh": True, "norm over the world": True}


def test_global_loss_micro_batches_with_running_counts():
    """Running counts over micro-batches with n_score_tokens = the step's token count: the
    values add up to sum_m E * sum_e C_m[e] / (k N_m) * S_m[e] / N_step (one process)."""
    E, k = 4, 2
    scores, experts = zip(*(ops.aux_scores(torch.randn(T, E), k) for T in (5, 7)))
    n_step = 12
    running, n_run, total, expected = torch.zeros(E, dtype=torch.int64), 0, 0.0, 0.0
    for s, e in zip(scores, experts):
        running = running + ops.tokens_per_expert(e, E)
        n_run += s.shape[0]
        total += float(global_load_balancing_loss(s, running, k=k, n_tokens=n_run, n_score_tokens=n_step))
        expected += float(E * (running.float() / (k * n_run) * s.sum(0) / n_step).sum())
    assert total == pytest.approx(expected, rel=1e-6)
    # the default n_score_tokens is n_tokens: the plain switch loss
    value = global_load_balancing_loss(scores[0], running, k=k, n_tokens=torch.tensor(9))
    assert float(value) == pytest.approx(float(ops.load_balancing_loss(scores[0], running, k=k, n_tokens=9)), rel=1e-6)
    # float64 token counts (all_reduce_sums' values) still give a float32 value
    n64 = torch.tensor(9.0, dtype=torch.float64)
    assert global_load_balancing_loss(scores[0], running, k=k, n_tokens=n64, n_score_tokens=n64 + 3).dtype == torch.float32


def test_z_loss_split_shares_add_up_to_the_mean_and_its_gradient():
    """Rows 0..4 and 5..11 (and an empty shard) as three ranks' tokens: the shares add up to
    z_loss over the 12 rows, and each share's gradient is its rows of the unsplit one."""
    logits = torch.randn(12, 5, requires_grad=True)
    upstream = 0.7
    (ops.z_loss(logits) * upstream).backward()
    whole, grad = float(ops.z_loss(logits.detach())), logits.grad.clone()
    logits.grad = None
    shards = [logits[:5], logits[5:], logits[12:]]
    values = [z_loss_split(shard, n_tokens=n) for shard, n in zip(shards, (12, torch.tensor(12), 12))]
    assert sum(float(v.detach()) for v in values) == pytest.approx(whole, rel=1e-6)
    assert float(values[2].detach()) == 0.0 and values[2].requires_grad
    (sum(values) * upstream).backward()
    torch.testing.assert_close(logits.grad, grad, rtol=1e-6, atol=1e-7)
    # padding (mask False) left out: the shares add up to z_loss(mask=), n_tokens the 8 kept rows
    keep = torch.arange(12) % 3 != 2
    logits.grad = None
    (ops.z_loss(logits, mask=keep) * upstream).backward()
    whole, grad = float(ops.z_loss(logits.detach(), mask=keep)), logits.grad.clone()
    logits.grad = None
    values = [z_loss_split(shard, n_tokens=8, mask=m) for shard, m in zip(shards, (keep[:5], keep[5:], keep[12:]))]
    assert sum(float(v.detach()) for v in values) == pytest.approx(whole, rel=1e-6)
    assert whole != pytest.approx(float(ops.z_loss(logits.detach())), rel=1e-3)
    (sum(values) * upstream).backward()
    torch.testing.assert_close(logits.grad, grad, rtol=1e-6, atol=1e-7)
    _raises(r"mask: expected None or a bool tensor \[5\]", z_loss_split, shards[0], n_tokens=8, mask=keep)
    # one rank holding every token (n_tokens = its rows), and one whose 7 rows hold only 4 kept tokens (n_tokens = 4 < 7)
    assert float(z_loss_split(logits.detach(), n_tokens=12)) == pytest.approx(float(ops.z_loss(logits.detach())), rel=1e-6)
    assert float(z_loss_split(shards[1].detach(), n_tokens=4, mask=keep[5:])) == pytest.approx(float(ops.z_loss(shards[1].detach(), mask=keep[5:])), rel=1e-6)
    # a float64 token count (e.g. all_reduce_sums' value) still gives a float32 value
    assert z_loss_split(shards[0].detach(), n_tokens=torch.tensor(12.0, dtype=torch.float64)).dtype == torch.float32


# ---------------------------------------------------------------------------- refusals in one process


def _raises(match, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


def test_bad_inputs_raise_value_errors_naming_the_argument():
    scores, experts = ops.aux_scores(torch.randn(6, 4), 2)
    cu = torch.tensor([0, 5, 13], dtype=torch.int32)
    split = seq_load_balancing_loss_split
    _raises("start: expected >= 0", split, scores, experts, cu, k=2, start=-1, group=None)
    _raises(r"start: .*\[8, 14\) reach past the end of cu_seqlens \(T = 13\)", split, scores, experts, cu, k=2, start=8, group=None)
    _raises("experts: expected shape", split, scores, experts[:, :1], cu, k=2, start=0, group=None)
    _raises("scores: expected a 2-D", split, scores[0], experts, cu, k=2, start=0, group=None)
    _raises("cu_seqlens: must start at 0", split, scores, experts, torch.tensor([1, 13]), k=2, start=0, group=None)
    _raises("cu_seqlens: must be non-decreasing", split, scores, experts, torch.tensor([0, 9, 5, 13]), k=2, start=0, group=None)
    _raises("group: expected a torch.distributed ProcessGroup or a 1-D DeviceMesh, got str", split, scores, experts, cu, k=2, start=0, group="tp")
    _raises("start / token_index: expected exactly one", split, scores, experts, cu, k=2, group=None)
    _raises("start / token_index: expected exactly one", split, scores, experts, cu, k=2, start=0, token_index=torch.arange(6), group=None)
    _raises(r"token_index: expected shape \(6,\)", split, scores, experts, cu, k=2, token_index=torch.arange(5), group=None)
    _raises(r"token_index: expected indices in \[0, 13\)", split, scores, experts, cu, k=2, token_index=torch.arange(8, 14), group=None)
    _raises("token_index: expected dtype int32 or int64", split, scores, experts, cu, k=2, token_index=torch.arange(6.0), group=None)
    _raises(r"token_index: expected indices in \[0, 13\)", split, scores, experts, cu, k=2, token_index=torch.arange(-1, 5), group=None)
    # a context-parallel rank holding no token: its empty token_index is fine (the group is checked after)
    _raises("group: expected", split, scores[:0], experts[:0], cu, k=2, token_index=torch.arange(0), group=None)
    _raises(r"cu_seqlens: expected a 1-D tensor", split, scores, experts, torch.tensor([[0, 6, 13]]), k=2, start=0, group=None)
    _raises("cu_seqlens: expected at least 2 entries", split, scores[:0], experts[:0], torch.tensor([], dtype=torch.int32), k=2, start=0, group=None)
    # check=False: the free checks still run; the value checks (a host sync) do not
    _raises("cu_seqlens: expected dtype int32 or int64", split, scores, experts, cu.float(), k=2, start=0, group=None, check=False)
    _raises("cu_seqlens: expected at least 2 entries", split, scores[:0], experts[:0], cu[:1], k=2, start=0, group=None, check=False)
    _raises("group: expected", split, scores, experts, cu, k=2, start=8, group=None, check=False)
    past = experts.clone()
    past[0, 0] = 7  # an id past E = 4: refused as the unsplit op refuses it (it counted nowhere)
    _raises(r"^experts: ids must lie in -1..3 \(-1: a dropped or skipped slot\), got 0..7$", split, scores, past, cu, k=2, start=0, group=None)
    layers = seq_load_balancing_losses_split
    kw = dict(k=2, group=None, names=["a", "b"], n_experts=4, start=0)
    _raises(r"scores: layer names \['c'\] are not in names", layers, {"c": scores}, {"c": experts}, cu, **kw)
    _raises(r"experts: expected the layers of scores \['a'\], got \['b'\]", layers, {"a": scores}, {"b": experts}, cu, **kw)
    _raises(r"experts\['a'\]: expected shape \(6, 2\)", layers, {"a": scores}, {"a": experts[:, :1]}, cu, **kw)
    _raises(r"scores\['a'\]: expected 5 experts \(n_experts\), got shape \(6, 4\)", layers, {"a": scores}, {"a": experts}, cu, **{**kw, "n_experts": 5})
    _raises(r"scores\['b'\]: expected the same 6 local tokens", layers, {"a": scores, "b": scores[:5]}, {"a": experts, "b": experts[:5]}, cu, **kw)
    _raises("names: expected unique layer names", layers, {}, {}, cu, **{**kw, "names": ["a", "a"]})
    _raises(r"^experts\['b'\]: ids must lie in -1..3 \(-1: a dropped or skipped slot\), got -2..", layers, {"a": scores, "b": scores},
            {"a": experts, "b": experts - 2}, cu, **kw)
    _raises("scores: expected a mapping", layers, scores, experts, cu, **kw)
    _raises("n_experts: expected >= 1", layers, {}, {}, cu, **{**kw, "n_experts": 0})
    # a rank without a layer: its tokens are token_index's, which its mask must match (and the group is checked after)
    layerless = dict(k=2, names=["a"], n_experts=4, token_index=torch.arange(4))
    _raises(r"mask: expected None or a bool tensor \[4\] .*, got torch.bool \[5\]", layers, {}, {}, cu, group=None, mask=torch.ones(5, dtype=torch.bool), **layerless)
    _raises("group: expected", layers, {}, {}, cu, group=None, mask=torch.ones(4, dtype=torch.bool), **layerless)

    good = {"a": torch.ones(4, dtype=torch.int64)}
    _raises(r"counts: layer names \['b'\] are not in names", all_reduce_counts, {"b": torch.ones(4, dtype=torch.int64)}, None, names=["a"], n_experts=4)
    _raises(r"counts\['a'\]: expected a tensor of shape \(4,\)", all_reduce_counts, {"a": torch.ones(3, dtype=torch.int64)}, None, names=["a"], n_experts=4)
    _raises(r"counts\['a'\]: expected an integer tensor", all_reduce_counts, {"a": torch.ones(4)}, None, names=["a"], n_experts=4)
    _raises("names: expected unique", all_reduce_counts, good, None, names=["a", "a"], n_experts=4)
    _raises("names: expected a sequence of layer-name strings", all_reduce_counts, good, None, names="a", n_experts=4)
    _raises("names: expected a sequence of layer-name strings", all_reduce_counts, good, None, names=["a", 1], n_experts=4)
    _raises(r"counts\['a'\]: expected an integer tensor", all_reduce_counts, {"a": torch.ones(4, dtype=torch.bool)}, None, names=["a"], n_experts=4)
    _raises("n_experts: expected >= 1", all_reduce_counts, good, None, names=["a"], n_experts=0)
    _raises("group: expected", all_reduce_counts, good, None, names=["a"], n_experts=4)
    _raises("group: expected", all_reduce_counts, good, None, names=(n for n in ["a"]), n_experts=4)  # a generator, read once

    counts = ops.tokens_per_expert(experts, 4)
    _raises("n_score_tokens: expected >= 1", global_load_balancing_loss, scores, counts, k=2, n_tokens=6, n_score_tokens=0)
    _raises("n_tokens: expected >= 1", global_load_balancing_loss, scores, counts, k=2, n_tokens=0)
    _raises(r"counts: expected a tensor of shape \(4,\)", global_load_balancing_loss, scores, counts[:3], k=2, n_tokens=6)

    _raises("n_tokens: expected >= 1", z_loss_split, scores, n_tokens=0)
    _raises(r"n_tokens: expected at least this rank's 6 tokens \(T over all ranks of the split\), got 5", z_loss_split, scores, n_tokens=5)
    _raises("n_tokens: expected an int or a 1-element tensor", z_loss_split, scores, n_tokens=torch.ones(2))
    _raises("logits: expected a 2-D", z_loss_split, scores[0], n_tokens=6)

    _raises(r"values\['x'\]: expected a real 1-element tensor", all_reduce_sums, {"x": torch.ones(2)}, None)
    _raises(r"values\['x'\]: expected a number", all_reduce_sums, {"x": "1"}, None)
    _raises(r"values\['x'\]: expected a number", all_reduce_sums, {"x": True}, None)
    _raises(r"values\['x'\]: expected a real 1-element tensor", all_reduce_sums, {"x": torch.ones(1, dtype=torch.complex64)}, None)
    _raises("values: expected a mapping", all_reduce_sums, [("x", 1.0)], None)
    _raises("group: expected", all_reduce_sums, {"x": 1.0}, None)
    _raises("group: expected", all_reduce_sums, {"x": np.float32(1.5), "y": np.int64(2)}, None)  # numpy's scalars are numbers
    _raises(r"values: expected string names, got \[1\]", all_reduce_sums, {"x": 1.0, 1: 2.0}, None)  # sorted: one order on every rank
    # dist.group.WORLD before init_process_group is None: said so (it read "got NoneType")
    assert not dist.is_initialized()
    for fn, args, kwargs in ((all_reduce_counts, (good, dist.group.WORLD), dict(names=["a"], n_experts=4)), (all_reduce_sums, ({"x": 1.0}, dist.group.WORLD), {}),
                             (split, (scores, experts, cu), dict(k=2, start=0, group=dist.group.WORLD))):
        _raises(r"^group: expected a torch.distributed ProcessGroup or a 1-D DeviceMesh, got None: torch.distributed is not initialised", fn,
                *args, **kwargs)
    # grad_norm / clip_grad_norm's argument checks: tests/optim/test_grads.py
