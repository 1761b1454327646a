"""Expert parallelism (fmoe.parallel.expert) in gloo processes against moe() in one process.

Every worker builds the whole problem from a fixed seed (so all ranks agree), runs the
single-process reference moe(x_all, full params) on the concatenation of every data
group's tokens, then the distributed moe(x_r, local params, experts=...), an
ExpertParallel over the local params, on its own tokens and expert slice, and compares
outputs and gradients (random upstream gradient) in float32. Gradients of parameters held by several ranks are summed over those
ranks first: router and shared experts over the data ranks ("dp"), expert slices over
"edp". With a capacity factor ("cap_" cases) each data group drops slots on its own T
tokens, so the reference is moe() run on each data group's tokens alone, concatenated.
Host reads of the distributed forward and backward are counted (fmoe.train.metrics.
HostReads): none with a capacity factor, exactly the count exchange without one; one
capacity case runs the distributed moe() call under torch.compile(fullgraph=True).

A spawn costs seconds of imports, so one spawn per world size runs many cases; a worker
records mismatches instead of raising, so that every rank still reaches every collective,
and each pytest case asserts on its own record.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from tests.parallel.dist import own_groups, run_distributed

H, F, FS, E = 8, 6, 4, 8  # hidden, expert FFN, shared FFN, experts
TIMEOUT = 180.0  # the 4-process spawn takes about 60 s on 2 cores, 15 of them a compile

# name -> (mesh sizes, tokens per data group, extra); tokens are odd-sized per rank
CASES_2 = {
    "ep2": (dict(ep=2), (5, 7), {}),
    "etp2": (dict(ep=1, etp=2), (5, 7), {}),
    "tp2_ep2": (dict(tp=2, ep=2), (10,), {}),
    "empty_ep2": (dict(ep=2), (0, 7), dict(k=1, one_expert=3)),
    "ep2_on_input": (dict(ep=2), (5, 7), dict(on_input=True)),  # the routing weights scale the experts' input (Llama 4)
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
    "ep2_etp2_on_input": (dict(ep=2, etp=2), (5, 7, 3, 9), dict(on_input=True)),
}
# capacity layout: cap = capacity factor, drop = whether slots are dropped (asserted, so the
# case tests what it says), max_tokens = the largest T of the ep x etp group where the T
# differ, compiled = the whole distributed moe() call under torch.compile(fullgraph=True)
# (one case, all three axes: a compile costs 15 s here)
CASES_2.update({
    "cap_ep2": (dict(ep=2), (6, 6), dict(cap=1.0, drop=True)),
    "cap_ep2_no_drop": (dict(ep=2), (5, 7), dict(cap=8.0, drop=False, max_tokens=7)),
    "cap_tp2_ep2": (dict(tp=2, ep=2), (10,), dict(cap=1.0, drop=True)),
    "cap_empty_ep2": (dict(ep=2), (0, 7), dict(k=1, one_expert=3, cap=1.0, drop=True, max_tokens=7)),
    "cap_ep2_on_input": (dict(ep=2), (6, 6), dict(cap=1.0, drop=True, on_input=True)),
    # a factor that keeps every slot: the buffers hold T rows per expert, not ceil(T k / E * 1000) = 1500
    "cap_ep2_huge_factor": (dict(ep=2), (6, 6), dict(cap=1000.0, drop=False, buffer_rows=6)),
    "cap_ep2_huge_factor_max_tokens": (dict(ep=2), (5, 7), dict(cap=1000.0, drop=False, max_tokens=7, buffer_rows=7)),
})
CASES_4.update({
    "cap_ep4": (dict(ep=4), (6, 6, 6, 6), dict(cap=1.0, drop=True)),
    "cap_ep2_etp2": (dict(ep=2, etp=2), (5, 7, 3, 9), dict(cap=1.25, drop=True, max_tokens=9)),
    # each ep group is a tp pair holding one data group's T: C may differ between the groups
    "cap_tp2_ep2": (dict(tp=2, ep=2), (10, 6), dict(cap=1.0, drop=True, same_groups=("ep", "tp"))),
    "cap_tp2_ep4_no_drop": (dict(tp=2, ep=4), (10, 6), dict(cap=4.0, drop=False, max_tokens=10)),
    "cap_empty_ep2_etp2": (dict(ep=2, etp=2), (0, 5, 3, 0), dict(k=1, one_expert=6, cap=1.0, drop=True, max_tokens=5)),
    "cap_tp2_ep2_etp2_compiled": (dict(tp=2, ep=2, etp=2), (10, 6), dict(cap=1.0, drop=True, max_tokens=10, compiled=True)),
})
# name -> (mesh sizes, padded: dispatch_padded / combine_padded instead of dispatch / combine)
ROUND_TRIPS_2 = {"round_trip_ep2": (dict(ep=2), False), "round_trip_padded_ep2": (dict(ep=2), True)}
ROUND_TRIPS_4 = {
    "round_trip_ep4": (dict(ep=4), False), "round_trip_ep2_etp2": (dict(ep=2, etp=2), False),
    "round_trip_padded_ep4": (dict(ep=4), True), "round_trip_padded_ep2_etp2": (dict(ep=2, etp=2), True),
}


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


def _expert_parallel(ep, params, cfg):
    """moe()'s `experts` callable for an ExpertParallel over this rank's expert weights."""
    return lambda x, routes: ep(x, routes, params, cfg)


def _moe_case(
    sizes: dict, tokens: tuple, k: int = 2, one_expert=None, same_groups=None,
    cap=None, drop=None, max_tokens=None, compiled=False, on_input=False, buffer_rows=None,
) -> list[str]:
    from fmoe.layers import MoEConfig, moe
    from fmoe.parallel import expert as expert_module
    from fmoe.parallel.expert import ExpertParallel
    from fmoe.parallel.mesh import build_meshes
    from fmoe.train.metrics import HostReads

    meshes = build_meshes(**sizes)
    # k = 1 needs pre_softmax for a router gradient
    cfg = MoEConfig(n_experts=E, k=k, pre_softmax=k == 1, capacity_factor=cap, weights_on_input=on_input)
    params, x_all, dy_all = _problem(sum(tokens), one_expert=one_expert)
    fails = []
    if same_groups is not None:  # the layout the case is meant to test
        a, b = (dist.get_process_group_ranks(meshes.group(n)) for n in same_groups)
        if a != b:
            fails.append(f"{same_groups}: groups {a} and {b} differ")

    ref_inputs = {"x": x_all.clone().requires_grad_(), **{n: p.clone().requires_grad_() for n, p in params.items()}}
    ref_params = {n: p for n, p in ref_inputs.items() if n != "x"}
    if cap is None:
        y_ref, stats_ref = moe(ref_inputs["x"], ref_params, cfg)
        counts_ref = stats_ref["tokens_per_expert"]
    else:  # each data group drops slots on its own T tokens
        groups = [slice(sum(tokens[:i]), sum(tokens[: i + 1])) for i in range(len(tokens))]
        outs = [moe(ref_inputs["x"][rows], ref_params, cfg) for rows in groups]
        y_ref = torch.cat([y for y, _ in outs])
        counts_ref = sum(stats["tokens_per_expert"] for _, stats in outs)
        if drop != (int(counts_ref.sum()) < sum(tokens) * k):
            fails.append(f"expected {'some' if drop else 'no'} dropped slots, kept {counts_ref.tolist()}")
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

    ep = ExpertParallel(meshes.axis("ep"), etp_mesh=meshes.axis("etp"), tp_mesh=meshes.tp_mesh, max_tokens=max_tokens)
    if compiled:
        # the whole moe() call, expert-parallel collectives included, as one graph
        call = torch.compile(
            lambda x, p: moe(x, p, cfg, experts=_expert_parallel(ep, p, cfg)), fullgraph=True, backend="aot_eager"
        )
        y, stats = call(inputs["x"], local)
        got = _grads(y, inputs, dy_all[rows])
    else:
        buffers, dispatch_padded = [], expert_module.dispatch_padded  # buffer_rows: the capacity layout's C, as dispatched
        expert_module.dispatch_padded = lambda x_ECH, **kw: buffers.append(tuple(x_ECH.shape)) or dispatch_padded(x_ECH, **kw)
        try:
            with HostReads() as reads:
                y, stats = moe(inputs["x"], local, cfg, experts=_expert_parallel(ep, local, cfg))
                got = _grads(y, inputs, dy_all[rows])
        finally:
            expert_module.dispatch_padded = dispatch_padded
        if buffer_rows is not None and buffers != [(E, buffer_rows, H)]:
            fails.append(f"dispatched capacity buffers {buffers}, expected [{(E, buffer_rows, H)}]")
        if cap is not None and reads.count:
            fails.append(f"{reads.count} host reads with a capacity factor: {dict(reads.sites)}")
        exchange = [site for site in reads.sites if site.split(":")[0].endswith("fmoe/parallel/expert.py")]
        if cap is None and (reads.count != 1 or len(exchange) != 1):
            fails.append(f"expected one host read (the count exchange in dispatch), got {reads.count}: {dict(reads.sites)}")

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
    if not torch.equal(counts, counts_ref):
        fails.append(f"tokens_per_expert summed over ranks {counts.tolist()} != {counts_ref.tolist()}")
    if one_expert is not None and cap is None and counts[one_expert] != sum(tokens):
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


def _round_trip_padded_case(rank: int, world: int, sizes: dict) -> list[str]:
    """dispatch_padded puts row (e, c) of every rank's [E, C, H] buffer on the owner of e,
    ordered (local expert, ep rank, etp rank, c), with fixed offsets; combine_padded brings
    it back (etp times, once per F-shard); neither reads the host, forward or backward."""
    from fmoe.parallel.expert import combine_padded, dispatch_padded
    from fmoe.parallel.mesh import build_meshes
    from fmoe.train.metrics import HostReads

    meshes = build_meshes(**sizes)
    ep, etp, C = meshes.ep, meshes.etp, 3
    L = E // ep
    ep_mesh, etp_mesh = meshes.axis("ep"), meshes.axis("etp")  # slicing a mesh reads its rank table
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(E, C, H, generator=g) for _ in range(world)]
    dy = torch.randn(E, C, H, generator=g)
    fails = []

    x = xs[rank].clone().requires_grad_()
    with HostReads() as reads:
        x_local, meta = dispatch_padded(x, ep_mesh=ep_mesh, etp_mesh=etp_mesh)
        y = combine_padded(x_local, meta)  # the identity expert
        (grad_x,) = torch.autograd.grad(y, x, dy)
    if reads.count:
        fails.append(f"{reads.count} host reads: {dict(reads.sites)}")

    j = ep_mesh.get_local_rank()
    block = rank - (j * etp + etp_mesh.get_local_rank())  # first rank of this ep x etp block
    expected = torch.stack([
        torch.stack([torch.stack([xs[block + s * etp + qq][j * L + l] for qq in range(etp)]) for s in range(ep)])
        for l in range(L)
    ])  # [L, S, Q, C, H]
    if not torch.equal(x_local, expected.reshape(L * ep * etp * C, H)):
        fails.append("x_local is not the senders' rows of this rank's experts in (l, s, q, c) order")
    expected_offsets = torch.arange(1, L + 1, dtype=torch.int32) * (ep * etp * C)
    if not torch.equal(meta.offsets, expected_offsets):
        fails.append(f"meta.offsets {meta.offsets.tolist()} != {expected_offsets.tolist()}")
    if not torch.equal(y, x * etp):
        fails.append(f"combine_padded(dispatch_padded(x)) != {etp} * x")
    if not torch.equal(grad_x, dy * etp):
        fails.append(f"the round trip's gradient is not {etp} * dy")
    return fails


def _bad_inputs_case(rank: int, world: int) -> list[str]:
    """Caller mistakes raise a ValueError naming the argument, on every rank before any
    collective: the group still works afterwards."""
    from fmoe.layers import MoEConfig, moe
    from fmoe.parallel.expert import ExpertParallel, combine_padded, dispatch, dispatch_padded, split_tokens
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

    def run(p, cfg, expert_parallel=ep):
        return moe(x, p, cfg, experts=_expert_parallel(expert_parallel, p, cfg))

    cfg = MoEConfig(n_experts=E, k=2)
    cfg3 = MoEConfig(n_experts=3, k=2)
    expect(r"cfg\.n_experts", lambda: run(dict(local, router=params["router"][:3]), cfg3), "E % ep")
    expect(r"params\['w_gate'\]", lambda: run(params, cfg), "full w_gate under ep")
    expect(r"params\['w_down'\]", lambda: run(dict(local, w_down=local["w_down"].transpose(1, 2)), cfg), "w_down [L, H, F]")
    expect(r"params\['w_up'\]", lambda: run(dict(local, w_up=local["w_up"].double()), cfg), "float64 w_up")
    expect(r"ep_mesh", lambda: ExpertParallel(meshes.dense), "a 4-D mesh")
    expect(r"max_tokens", lambda: ExpertParallel(meshes.axis("ep"), max_tokens=-1), "negative max_tokens")
    expect(r"max_tokens: expected >= 1, got 0", lambda: ExpertParallel(meshes.axis("ep"), max_tokens=0), "max_tokens = 0")
    capped = dataclasses.replace(cfg, capacity_factor=1.0)
    expect(r"^x:.*max_tokens", lambda: run(local, capped, ExpertParallel(meshes.axis("ep"), max_tokens=4)), "T > max_tokens")
    expect(r"counts_E", lambda: dispatch(x, torch.zeros(3, dtype=torch.int64), ep_mesh=meshes.axis("ep")), "counts of 3 experts")
    # counts refused on one rank only: its peer raises with it (it waited in the rows' exchange before), negative ones
    # are named (a RuntimeError of repeat_interleave on one rank before, the other returning)
    over = torch.full((E,), 1 if rank == 0 else 0, dtype=torch.int64)  # 8 rows of x's 5 on rank 0, none on rank 1
    expect(r"counts_E: they add up to 8 rows, more than x_perm's 5" if rank == 0 else r"counts_E: another rank's were refused",
           lambda: dispatch(x, over, ep_mesh=meshes.axis("ep")), "more rows than x on rank 0")
    negative = torch.tensor([-1, 3, 1, 1, 0, 0, 0, 0])
    expect(r"counts_E: expected row counts >= 0, got \[-1, 3", lambda: dispatch(x, negative, ep_mesh=meshes.axis("ep")), "a negative count")
    one_negative = negative if rank == 0 else torch.tensor([1, 1, 0, 0, 0, 0, 0, 0])  # rank 1's are fine
    expect(r"counts_E: expected row counts >= 0" if rank == 0 else r"counts_E: another rank's were refused",
           lambda: dispatch(x, one_negative, ep_mesh=meshes.axis("ep")), "a negative count on rank 0 only")
    expect(r"x_ECH", lambda: dispatch_padded(torch.zeros(3, 2, H), ep_mesh=meshes.axis("ep")), "3 experts over ep = 2")
    expect(r"x_ECH", lambda: dispatch_padded(torch.zeros(E * 2, H), ep_mesh=meshes.axis("ep")), "a 2-D buffer")
    _, meta = dispatch_padded(torch.zeros(E, 2, H), ep_mesh=meshes.axis("ep"))  # on every rank: a valid meta
    expect(r"y_local", lambda: combine_padded(torch.zeros(5, H), meta), "y_local of the wrong row count")

    tp_meshes = build_meshes(tp=2)
    tp = ExpertParallel(tp_mesh=tp_meshes.tp_mesh)
    expect(r"^t: expected a number of rows divisible by tp = 2, got shape \(5, 8\)", lambda: split_tokens(x, tp_meshes.tp_mesh), "split_tokens of 5 rows")
    expect(r"^x:", lambda: run(params, cfg, tp), "T % tp")
    expect(r"token_shards", lambda: ExpertParallel(tp_mesh=tp_meshes.tp_mesh, token_shards=2), "token_shards with a tp_mesh")
    expect(r"token_shards", lambda: ExpertParallel(meshes.axis("ep"), token_shards=0), "token_shards = 0")

    alive = torch.ones(1)
    dist.all_reduce(alive)
    if alive.item() != world:
        fails.append("the group is out of step after the errors")
    return fails


def _parallelize_max_tokens_case(rank: int, world: int) -> list[str]:
    """parallelize(max_tokens=) with ep = 2 and a capacity factor: ranks passing micro-batches
    of other T (12 and 7 tokens) size the experts' slots alike and run (without it their
    exchange buffers differ and gloo aborts); no slot dropped (capacity factor 4), each
    rank's logits are one process's of its own tokens. Its bad arguments, and a second
    parallelize of the same model, are ValueErrors naming them."""
    from fmoe.model import Transformer, TransformerConfig
    from fmoe.parallel import build_meshes, parallelize

    cfg = TransformerConfig(vocab_size=32, hidden=H, n_layers=1, n_dense=0, n_experts=4, k=2, ffn_expert=F, n_heads=2,
                            n_kv_heads=1, head_dim=4, capacity_factor=4.0, impl="torch")
    torch.manual_seed(0)
    whole = Transformer(cfg)
    model = Transformer(cfg)
    model.load_state_dict(whole.state_dict())
    fails = []
    meshes = build_meshes(ep=2)
    def refused(fn, message, what):
        try:
            fn()
            fails.append(f"{what}: accepted")
        except ValueError as e:
            if message not in str(e):
                fails.append(f"{what}: {e}")

    refused(lambda: parallelize(model, meshes.dense, max_tokens=0), "meshes: expected fmoe.parallel.build_meshes(...)'s Meshes, got DeviceMesh",
            "parallelize over a DeviceMesh")
    refused(lambda: parallelize(model, meshes, max_tokens=0), "max_tokens: expected >= 1, got 0", "parallelize with max_tokens=0")
    # ep = 2 over a model without a MoE block: refused (it ran as plain data parallelism before, the ep asked for unused)
    dense = Transformer(dataclasses.replace(cfg, n_dense=1))
    refused(lambda: parallelize(dense, meshes), "meshes: ep / etp: expert parallelism (2 x 1) needs a model with experts, and this one has "
            "no MoE block", "parallelize with ep = 2 of a model without MoE blocks")
    # tp = 2 over a module tree of one's own (no fmoe Block to split): refused (every tp rank held and ran the whole model)
    own = torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Linear(H, H))
    refused(lambda: parallelize(own, build_meshes(tp=world, has_experts=False)), f"tp: Sequential holds no fmoe.model Block (Attention, "
            f"DenseMLP, MoE inside one) to split, so tp = {world} cannot apply", "parallelize with tp of a module of one's own")
    parallelize(model, meshes, max_tokens=12)
    refused(lambda: parallelize(model, meshes), "model: already parallelized", "parallelize applied twice")
    dispatchers = [m.experts.dispatcher for m in model.modules() if hasattr(getattr(m, "experts", None), "dispatcher")]
    if [d.max_tokens for d in dispatchers] != [12]:
        fails.append(f"dispatchers' max_tokens: {[d.max_tokens for d in dispatchers]}")
    T = 12 if rank == 0 else 7
    ids = torch.randint(0, 32, (T,), generator=torch.Generator().manual_seed(rank))
    cu = torch.tensor([0, T], dtype=torch.int32)
    with torch.no_grad():
        got, want = model.logits(ids, cu), whole.logits(ids, cu)
    _close(fails, "logits", got, want)
    return fails


def _token_shards_case(rank: int, world: int) -> list[str]:
    """ExpertParallel(token_shards=2): each rank holds half of a micro-batch whose capacity
    drop ran over all of it, and one rank's tokens hold every slot of two experts: the
    capacity layout sized from both shards' tokens keeps them (sized from one shard's, it
    dropped half: outputs 2.1-2.6 off, rows of zeros), as local_experts on the whole batch."""
    from fmoe.layers import MoEConfig, local_experts
    from fmoe.ops import drop_by_capacity, route
    from fmoe.ops.routing import Routes
    from fmoe.parallel.expert import ExpertParallel
    from fmoe.parallel.mesh import build_meshes

    params, x, dy = _problem(8)
    logits = torch.zeros(8, E)
    logits[:4, 0], logits[:4, 1], logits[4:, 2], logits[4:, 3] = 5.0, 4.0, 5.0, 4.0  # rank 0's tokens: experts 0 and 1 alone
    cfg = MoEConfig(n_experts=E, k=2, capacity_factor=2.0)
    routes = drop_by_capacity(route(logits, 2), E, 2.0)  # C = ceil(8 * 2 / 8 * 2) = 4: nothing dropped
    fails = [] if int((routes.experts >= 0).sum()) == 16 else [f"the case drops slots: {routes.experts.tolist()}"]
    experts = {n: params[n] for n in ("w_gate", "w_up", "w_down")}
    ref_x = x.clone().requires_grad_()
    y_ref, _ = local_experts(ref_x, routes, experts, cfg)
    (ref_dx,) = torch.autograd.grad(y_ref, ref_x, dy)
    meshes = build_meshes(ep=2)
    j, rows = meshes.axis("ep").get_local_rank(), slice(4 * rank, 4 * rank + 4)
    local = {n: w[j * E // 2:(j + 1) * E // 2] for n, w in experts.items()}
    mine = x[rows].clone().requires_grad_()
    y, _ = ExpertParallel(meshes.axis("ep"), token_shards=2)(mine, Routes(routes.weights[rows], routes.experts[rows]), local, cfg)
    (dx,) = torch.autograd.grad(y, mine, dy[rows])
    _close(fails, "y", y, y_ref[rows])
    _close(fails, "grad x", dx, ref_dx[rows])
    return fails


def _expert_biases_case(rank: int, world: int) -> list[str]:
    """Routed experts with biases (gpt-oss's b_gate, b_up, b_down) over etp = 2: each etp rank
    adds b_down / etp to its partial sum (b_down added whole on each was 2.1 off); each rank
    holds its own tokens, and the biases' gradients are one process's over every rank's tokens
    (b_gate, b_up: the rank's F columns; b_down: the whole, on every etp rank)."""
    from fmoe.layers import MoEConfig, local_experts
    from fmoe.ops import route
    from fmoe.ops.routing import Routes
    from fmoe.parallel.expert import ExpertParallel
    from fmoe.parallel.mesh import build_meshes

    params, x_all, dy_all = _problem(10, seed=3)  # each etp rank its own 5 tokens (etp is carved from the data ranks)
    g = torch.Generator().manual_seed(4)
    full = {n: params[n] for n in ("w_gate", "w_up", "w_down")}
    full.update(b_gate=torch.randn(E, F, generator=g) * 0.4, b_up=torch.randn(E, F, generator=g) * 0.4, b_down=torch.randn(E, H, generator=g))
    cfg = MoEConfig(n_experts=E, k=2)
    routes_all = route(x_all @ params["router"].T, 2)
    ref = {n: t.clone().requires_grad_() for n, t in full.items()}
    y_ref, _ = local_experts(x_all, routes_all, ref, cfg)
    ref_grads = dict(zip(ref, torch.autograd.grad(y_ref, list(ref.values()), dy_all)))
    rows = slice(5 * rank, 5 * rank + 5)
    x, dy, routes = x_all[rows], dy_all[rows], Routes(routes_all.weights[rows], routes_all.experts[rows])
    meshes = build_meshes(ep=1, etp=2)
    q, Fl = meshes.axis("etp").get_local_rank(), F // 2
    cols = slice(q * Fl, (q + 1) * Fl)
    local = dict(w_gate=full["w_gate"][:, :, cols], w_up=full["w_up"][:, :, cols], w_down=full["w_down"][:, cols], b_gate=full["b_gate"][:, cols],
                 b_up=full["b_up"][:, cols], b_down=full["b_down"])
    local = {n: t.clone().requires_grad_() for n, t in local.items()}
    y, _ = ExpertParallel(None, etp_mesh=meshes.axis("etp"))(x, routes, local, cfg)
    grads = dict(zip(local, torch.autograd.grad(y, list(local.values()), dy)))
    fails = []
    _close(fails, "y", y, y_ref[rows])
    _close(fails, "grad b_down", grads["b_down"], ref_grads["b_down"])  # every etp rank's tokens' (copy_to_tp sums it over etp)
    for name in ("b_gate", "b_up"):
        _close(fails, f"grad {name}", grads[name], ref_grads[name][:, cols])
    return fails


def _worker(rank: int, world: int, cases: dict, round_trips: dict, bad_inputs: bool) -> dict:
    results = {}
    for name, (sizes, tokens, extra) in cases.items():
        with own_groups():
            results[name] = _moe_case(sizes, tokens, **extra)
    for name, (sizes, padded) in round_trips.items():
        with own_groups():
            results[name] = (_round_trip_padded_case if padded else _round_trip_case)(rank, world, sizes)
    if bad_inputs:
        with own_groups():
            results["bad_inputs"] = _bad_inputs_case(rank, world)
        with own_groups():
            results["parallelize_max_tokens"] = _parallelize_max_tokens_case(rank, world)
        with own_groups():
            results["token_shards"] = _token_shards_case(rank, world)
        with own_groups():
            results["expert_biases_etp2"] = _expert_biases_case(rank, world)
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


@pytest.mark.parametrize("name", [*CASES_2, *ROUND_TRIPS_2, "bad_inputs", "parallelize_max_tokens", "token_shards", "expert_biases_etp2"])
def test_world2(world2, name):
    _assert_case(world2, name)


@pytest.mark.parametrize("name", [*CASES_4, *ROUND_TRIPS_4])
def test_world4(world4, name):
    _assert_case(world4, name)


# ----------------------------------------------------------------------------------------
# one process: the capacity layout against permute
# ----------------------------------------------------------------------------------------


def test_permute_padded_matches_permute():
    """permute_padded holds each expert's rows in permute's order, then zero rows up to C;
    unpermute through its plan gives permute's result, gradients included; a slot past the
    capacity (impossible after drop_by_capacity) gets no row; no host read."""
    from fmoe.ops import drop_by_capacity, permute, route, unpermute
    from fmoe.parallel.expert import permute_padded
    from fmoe.train.metrics import HostReads

    g = torch.Generator().manual_seed(3)
    T, k, n_experts, C = 7, 2, 4, 3
    routes = drop_by_capacity(route(torch.randn(T, n_experts, generator=g), k), n_experts, 0.75)  # C = ceil(2.625)
    assert routes.experts.eq(-1).any(), "the case should drop slots"
    x = torch.randn(T, H, generator=g, requires_grad=True)
    dy = torch.randn(T, H, generator=g)

    x_perm, plan = permute(x, routes.experts, n_experts)
    with HostReads() as reads:
        x_ECH, plan_padded = permute_padded(x, routes.experts, n_experts, C)
        y = unpermute(x_ECH.view(n_experts * C, H), plan_padded, routes.weights)
        (grad_x,) = torch.autograd.grad(y, x, dy)
    assert reads.count == 0, dict(reads.sites)
    assert x_ECH.shape == (n_experts, C, H)
    assert torch.equal(plan_padded.counts, plan.counts)
    assert plan_padded.offsets.tolist() == [C, 2 * C, 3 * C, 4 * C]
    ends = plan.offsets.tolist()
    for e, n in enumerate(plan.counts.tolist()):
        assert torch.equal(x_ECH[e, :n], x_perm[ends[e] - n : ends[e]]), f"expert {e}'s rows"
        assert not x_ECH[e, n:].any(), f"expert {e}'s padding"
    y_ref = unpermute(x_perm, plan, routes.weights)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(grad_x, torch.autograd.grad(y_ref, x, dy)[0], rtol=1e-6, atol=1e-7)

    # every token to expert 1, capacity 2: tokens 0 and 1 keep a row, the rest none
    x_ECH, plan_padded = permute_padded(x, torch.ones(T, 1, dtype=torch.int64), n_experts, 2)
    assert plan_padded.row_of_slot.flatten().tolist() == [2, 3] + [-1] * (T - 2)
    assert torch.equal(x_ECH[1], x[:2]) and not x_ECH[[0, 2, 3]].any()

    x_ECH, plan_padded = permute_padded(x[:0], routes.experts[:0], n_experts, C)  # no tokens
    assert x_ECH.shape == (n_experts, C, H) and not x_ECH.any() and plan_padded.slot_of_row.eq(-1).all()


def test_one_process_refusals():
    """Without meshes (one process, no collective): dispatch refuses counts of no expert and
    counts one row past x_perm's; combine a y_local of another row count or a meta not
    dispatch's; permute_padded experts of fewer rows than x and a negative capacity;
    dispatch_padded a buffer of no expert; combine_padded a meta not dispatch_padded's."""
    from fmoe.parallel.expert import combine, combine_padded, dispatch, dispatch_padded, permute_padded

    x = torch.randn(5, H)
    with pytest.raises(ValueError, match=r"^counts_E: expected E = 0 experts divisible by ep = 1"):
        dispatch(x, torch.zeros(0, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^counts_E: they add up to 6 rows, more than x_perm's 5"):
        dispatch(x, torch.tensor([3, 3]))
    x_local, meta = dispatch(x, torch.tensor([2, 3]))
    assert torch.equal(x_local, x) and meta.offsets.tolist() == [2, 5]
    with pytest.raises(ValueError, match=r"^y_local: expected dispatch's 5 rows, got shape \(4, 8\)"):
        combine(x[:4], meta)
    with pytest.raises(ValueError, match=r"^meta: expected the DispatchMeta returned by dispatch, got dict"):
        combine(x, {})
    with pytest.raises(ValueError, match=r"^experts: expected 5 rows, one per token of x, got shape \(4, 2\)"):
        permute_padded(x, torch.zeros(4, 2, dtype=torch.int64), 4, 2)
    with pytest.raises(ValueError, match=r"^capacity: "):
        permute_padded(x, torch.zeros(5, 2, dtype=torch.int64), 4, -1)
    with pytest.raises(ValueError, match=r"^x_ECH: expected E = 0 experts \(dim 0\) divisible by ep = 1"):
        dispatch_padded(torch.zeros(0, 2, H))
    _, padded_meta = dispatch_padded(torch.zeros(4, 2, H))
    with pytest.raises(ValueError, match=r"^meta: expected the PaddedDispatchMeta returned by dispatch_padded, got DispatchMeta"):
        combine_padded(torch.zeros(8, H), meta)
    assert combine_padded(torch.ones(8, H), padded_meta).shape == (4, 2, H)


def test_permute_padded_adds_a_bf16_token_s_slots_in_float32():
    """A bf16 x's gradient through permute_padded: each token's K slot rows added in float32 and
    rounded once, as fmoe.ops.permute does (bf16 adds one by one round at each: 4e-3 off here)."""
    from fmoe.parallel.expert import permute_padded

    g = torch.Generator().manual_seed(0)
    T, K, n_experts = 8, 4, 4
    x = torch.randn(T, 16, generator=g).bfloat16().requires_grad_()
    experts = torch.stack([torch.randperm(n_experts, generator=g) for _ in range(T)])
    x_ECH, plan = permute_padded(x, experts, n_experts, T)
    dy = torch.randn(n_experts * T, 16, generator=g).bfloat16()
    (grad,) = torch.autograd.grad(x_ECH, x, dy.view(n_experts, T, 16))
    expected = dy.float()[plan.row_of_slot.long()].sum(1).bfloat16()  # [T, K, H] -> [T, H]
    assert torch.equal(grad, expected)
