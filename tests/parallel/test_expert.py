"""Expert parallelism (fmoe.parallel.expert) in gloo processes against moe() in one process.

Every worker builds the whole problem from a fixed seed (so all ranks agree), runs the
single-process reference moe(x_all, full params) on the concatenation of every data
group's tokens, then the distributed moe(x_r, local params, dispatcher=ExpertParallel(...))
on its own tokens and expert slice, and compares outputs and gradients (random upstream
gradient) in float32. Gradients of parameters held by several ranks are summed over those
ranks first: router and shared experts over the data ranks ("dp"), expert slices over
"edp". A spawn costs seconds of imports, so one spawn per world size runs many cases; a
worker records mismatches instead of raising, so that every rank still reaches every
collective, and each pytest case asserts on its own record.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.parallel.dist import run_distributed

H, F, FS, E = 8, 6, 4, 8  # hidden, expert FFN, shared FFN, experts
TIMEOUT = 120.0

# name -> (mesh sizes, tokens per data group, extra); tokens are odd-sized per rank
CASES_2 = {
    "ep2": (dict(ep=2), (5, 7), {}),
    "etp2": (dict(ep=1, etp=2), (5, 7), {}),
    "tp2_ep2": (dict(tp=2, ep=2), (10,), {}),
    "empty_ep2": (dict(ep=2), (0, 7), dict(k=1, one_expert=3)),
}
CASES_4 = {
    "ep4": (dict(ep=4), (5, 7, 3, 9), {}),
    "tp2_ep2": (dict(tp=2, ep=2), (10, 6), dict(same_groups=("ep", "tp"))),  # ep groups = tp pairs
    "tp2_ep4": (dict(tp=2, ep=4), (10, 6), {}),
    "tp2_etp2": (dict(tp=2, etp=2), (14, 6), dict(same_groups=("etp", "tp"))),
    "tp2_ep2_etp2": (dict(tp=2, ep=2, etp=2), (10, 6), {}),
    "ep2_etp2": (dict(ep=2, etp=2), (5, 7, 3, 9), {}),
    "empty_ep4": (dict(ep=4), (5, 0, 7, 3), dict(k=1, one_expert=3)),
    "empty_ep2_etp2": (dict(ep=2, etp=2), (0, 5, 3, 0), dict(k=1, one_expert=6)),
    "empty_tp2_ep2": (dict(tp=2, ep=2), (0, 6), dict(k=1, one_expert=0)),
}
ROUND_TRIPS_2 = {"round_trip_ep2": dict(ep=2)}
ROUND_TRIPS_4 = {"round_trip_ep4": dict(ep=4), "round_trip_ep2_etp2": dict(ep=2, etp=2)}


# ----------------------------------------------------------------------------------------
# worker side (module level: the spawned processes import these)
# ----------------------------------------------------------------------------------------


def _problem(n_tokens: int, *, one_expert=None, seed: int = 0):
    """Full parameters, x [n_tokens, H] and an upstream gradient dy, the same on every rank."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    params = dict(
        router=randn(E, H, scale=0.5),
        w_gate=randn(E, H, F, scale=0.4), w_up=randn(E, H, F, scale=0.4), w_down=randn(E, F, H, scale=0.4),
        shared_w_gate=randn(H, FS, scale=0.4), shared_w_up=randn(H, FS, scale=0.4),
        shared_w_down=randn(FS, H, scale=0.4), shared_gate=randn(H, scale=0.4),
    )
    x, dy = randn(n_tokens, H), randn(n_tokens, H)
    if one_expert is not None:
        # a positive feature that only one router row reads: every token picks that expert
        x[:, 0] = x[:, 0].abs() + 1
        params["router"][one_expert] = 0.0
        params["router"][one_expert, 0] = 20.0
    return params, x, dy


def _grads(y, inputs: dict, dy):
    return dict(zip(inputs, torch.autograd.grad(y, list(inputs.values()), dy)))


def _close(fails: list, what: str, actual, expected) -> None:
    try:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    except AssertionError as e:
        fails.append(f"{what}: {e}")


def _moe_case(sizes: dict, tokens: tuple, k: int = 2, one_expert=None, same_groups=None) -> list[str]:
    from fmoe.layers import MoEConfig, moe
    from fmoe.parallel.expert import ExpertParallel
    from fmoe.parallel.mesh import build_meshes

    meshes = build_meshes(**sizes)
    cfg = MoEConfig(n_experts=E, k=k, pre_softmax=k == 1)  # k = 1 needs pre_softmax for a router gradient
    params, x_all, dy_all = _problem(sum(tokens), one_expert=one_expert)
    fails = []
    if same_groups is not None:  # the layout the case is meant to test
        a, b = (dist.get_process_group_ranks(meshes.group(n)) for n in same_groups)
        if a != b:
            fails.append(f"{same_groups}: groups {a} and {b} differ")

    ref_inputs = {"x": x_all.clone().requires_grad_(), **{n: p.clone().requires_grad_() for n, p in params.items()}}
    y_ref, stats_ref = moe(ref_inputs["x"], {n: p for n, p in ref_inputs.items() if n != "x"}, cfg)
    ref = _grads(y_ref, ref_inputs, dy_all)

    # this rank's tokens: those of its data group (the tp ranks of a group hold them alike)
    d = meshes.axis("dp").get_local_rank()
    assert len(tokens) == meshes.dp, (tokens, meshes.sizes)
    rows = slice(sum(tokens[:d]), sum(tokens[: d + 1]))
    j, q = meshes.axis("ep").get_local_rank(), meshes.axis("etp").get_local_rank()
    L, Fl = E // meshes.ep, F // meshes.etp
    experts_slice = slice(j * L, (j + 1) * L)
    local = {n: p.clone() for n, p in params.items()}
    local["w_gate"] = params["w_gate"][experts_slice, :, q * Fl : (q + 1) * Fl].clone()
    local["w_up"] = params["w_up"][experts_slice, :, q * Fl : (q + 1) * Fl].clone()
    local["w_down"] = params["w_down"][experts_slice, q * Fl : (q + 1) * Fl, :].clone()
    inputs = {"x": x_all[rows].clone().requires_grad_(), **{n: p.requires_grad_() for n, p in local.items()}}

    ep = ExpertParallel(meshes.axis("ep"), etp_mesh=meshes.axis("etp"), tp_mesh=meshes.tp_mesh)
    y, stats = moe(inputs["x"], local, cfg, dispatcher=ep)
    got = _grads(y, inputs, dy_all[rows])

    _close(fails, "y", y, y_ref[rows])
    _close(fails, "grad x", got["x"], ref["x"][rows])
    for name in ("router", "shared_w_gate", "shared_w_up", "shared_w_down", "shared_gate"):
        # the tp ranks of a data group each hold the group's whole gradient: sum over data ranks
        dist.all_reduce(got[name], group=meshes.group("dp"))
        _close(fails, f"grad {name}", got[name], ref[name])
    for name in ("w_gate", "w_up", "w_down"):
        dist.all_reduce(got[name], group=meshes.group("edp"))
    _close(fails, "grad w_gate", got["w_gate"], ref["w_gate"][experts_slice, :, q * Fl : (q + 1) * Fl])
    _close(fails, "grad w_up", got["w_up"], ref["w_up"][experts_slice, :, q * Fl : (q + 1) * Fl])
    _close(fails, "grad w_down", got["w_down"], ref["w_down"][experts_slice, q * Fl : (q + 1) * Fl, :])
    counts = stats["tokens_per_expert"].clone()
    dist.all_reduce(counts)  # each rank counts its own slice: the sum is the total
    if not torch.equal(counts, stats_ref["tokens_per_expert"]):
        fails.append(f"tokens_per_expert summed over ranks {counts.tolist()} != {stats_ref['tokens_per_expert'].tolist()}")
    if one_expert is not None and counts[one_expert] != sum(tokens):
        fails.append(f"not every token went to expert {one_expert}: {counts.tolist()}")
    return fails


def _round_trip_case(rank: int, world: int, sizes: dict) -> list[str]:
    """dispatch puts every rank's rows of an expert on its owner, in global token order;
    combine brings them back (etp times, once per F-shard); the metadata counts are the
    senders' counts."""
    from fmoe.ops import permute
    from fmoe.parallel.expert import combine, dispatch
    from fmoe.parallel.mesh import build_meshes

    meshes = build_meshes(**sizes)
    ep, etp, k = meshes.ep, meshes.etp, 2
    L = E // ep
    g = torch.Generator().manual_seed(1)
    tokens = [3, 4, 9, 0][:world]  # rank 3: none
    xs = [torch.randn(t, H, generator=g) for t in tokens]
    experts = [torch.randint(0, E - 1, (t, k), generator=g) for t in tokens]  # expert E-1 gets none
    experts[0][1, 1] = -1  # a dropped slot: its row is not sent
    fails = []

    x = xs[rank].clone().requires_grad_()
    x_perm, plan = permute(x, experts[rank], E)
    x_local, meta = dispatch(x_perm, plan.counts, ep_mesh=meshes.axis("ep"), etp_mesh=meshes.axis("etp"))

    j = meshes.axis("ep").get_local_rank()
    block = rank - (j * etp + meshes.axis("etp").get_local_rank())  # first rank of this ep x etp block
    expected_rows, expected_counts = [], torch.zeros(etp, ep, L, dtype=torch.int64)
    for l in range(L):
        for s in range(ep):
            for qq in range(etp):
                src = block + s * etp + qq
                hit = experts[src] == j * L + l  # [T, k]: rows in token, then slot order
                expected_rows.append(xs[src][hit.nonzero()[:, 0]])
                expected_counts[qq, s, l] = hit.sum()
    expected = torch.cat(expected_rows)
    if not torch.equal(x_local, expected):
        fails.append(f"x_local rows differ from the senders' rows in expert, token order: {x_local} vs {expected}")
    if not torch.equal(meta.recv_counts, expected_counts):
        fails.append(f"meta.recv_counts {meta.recv_counts.tolist()} != senders' counts {expected_counts.tolist()}")
    if not torch.equal(meta.offsets, expected_counts.sum((0, 1)).cumsum(0).to(torch.int32)):
        fails.append(f"meta.offsets {meta.offsets.tolist()} do not end each local expert's rows")

    y_perm = combine(x_local, meta)  # the identity expert
    if not torch.equal(y_perm, x_perm * etp):
        fails.append(f"combine(dispatch(x_perm)) != {etp} * x_perm")
    dy = torch.randn(y_perm.shape, generator=g)
    (grad_x_perm,) = torch.autograd.grad(y_perm, x_perm, dy)
    kept = int(plan.counts.sum())
    expected_grad = torch.cat([dy[:kept] * etp, torch.zeros_like(dy[kept:])])
    if not torch.equal(grad_x_perm, expected_grad):
        fails.append("the round trip's gradient is not etp * dy on the sent rows and 0 on the others")
    return fails


def _bad_inputs_case(rank: int, world: int) -> list[str]:
    """Caller mistakes raise a ValueError naming the argument, on every rank before any
    collective: the group still works afterwards."""
    from fmoe.layers import MoEConfig, moe
    from fmoe.parallel.expert import ExpertParallel, dispatch
    from fmoe.parallel.mesh import build_meshes

    fails = []
    meshes = build_meshes(ep=2)
    ep = ExpertParallel(meshes.axis("ep"))
    params, x, _ = _problem(5)
    local = dict(params, w_gate=params["w_gate"][:4], w_up=params["w_up"][:4], w_down=params["w_down"][:4])

    def expect(pattern, fn, what):
        try:
            with pytest.raises(ValueError, match=pattern):
                fn()
        except BaseException as e:  # pytest.raises fails with its own exception type
            fails.append(f"{what}: {type(e).__name__}: {e}")

    cfg3 = MoEConfig(n_experts=3, k=2)
    p3 = dict(local, router=params["router"][:3])
    expect(r"cfg\.n_experts", lambda: moe(x, p3, cfg3, dispatcher=ep), "E % ep")
    expect(r"params\['w_gate'\]", lambda: moe(x, params, MoEConfig(n_experts=E, k=2), dispatcher=ep), "full w_gate under ep")
    wrong_down = dict(local, w_down=local["w_down"].transpose(1, 2))
    expect(r"params\['w_down'\]", lambda: moe(x, wrong_down, MoEConfig(n_experts=E, k=2), dispatcher=ep), "w_down [L, H, F]")
    wrong_dtype = dict(local, w_up=local["w_up"].double())
    expect(r"params\['w_up'\]", lambda: moe(x, wrong_dtype, MoEConfig(n_experts=E, k=2), dispatcher=ep), "float64 w_up")
    expect(r"ep_mesh", lambda: ExpertParallel(meshes.dense), "a 4-D mesh")
    expect(r"counts_E", lambda: dispatch(x, torch.zeros(3, dtype=torch.int64), ep_mesh=meshes.axis("ep")), "counts of 3 experts")

    tp_meshes = build_meshes(tp=2)
    tp = ExpertParallel(tp_mesh=tp_meshes.tp_mesh)
    expect(r"^x:", lambda: moe(x, params, MoEConfig(n_experts=E, k=2), dispatcher=tp), "T % tp")

    alive = torch.ones(1)
    dist.all_reduce(alive)
    if alive.item() != world:
        fails.append("the group is out of step after the errors")
    return fails


def _worker(rank: int, world: int, cases: dict, round_trips: dict, bad_inputs: bool) -> dict:
    results = {name: _moe_case(sizes, tokens, **extra) for name, (sizes, tokens, extra) in cases.items()}
    results.update({name: _round_trip_case(rank, world, sizes) for name, sizes in round_trips.items()})
    if bad_inputs:
        results["bad_inputs"] = _bad_inputs_case(rank, world)
    return results


# ----------------------------------------------------------------------------------------
# pytest side: one spawn per world size, one test per case
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_worker, 2, CASES_2, ROUND_TRIPS_2, True, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_worker, 4, CASES_4, ROUND_TRIPS_4, False, timeout=TIMEOUT)


def _assert_case(results: list[dict], name: str) -> None:
    fails = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res[name]]
    assert not fails, f"{name}:\n" + "\n".join(fails)


@pytest.mark.parametrize("name", [*CASES_2, *ROUND_TRIPS_2, "bad_inputs"])
def test_world2(world2, name):
    _assert_case(world2, name)


@pytest.mark.parametrize("name", [*CASES_4, *ROUND_TRIPS_4])
def test_world4(world4, name):
    _assert_case(world4, name)
