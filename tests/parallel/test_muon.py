"""fmoe.parallel.muon.DistributedMuon in gloo processes against fmoe.optim.Muon in one process.

Every worker builds the same toy model from a fixed seed and lays it out as a trainer would:
dense matrices under fully_shard (HSDP over meshes.dp_mesh, and a block over the 1-D "dp"
mesh whose smallest matrix leaves a rank an empty shard with 4 ranks), a TP-like matrix
sharded over a matrix dim (a 2-D (Shard(0), Shard(1)) mesh with 4 ranks), two matrices on
meshes of half the world that differ between ranks (4 ranks; their gradients summed over
the other half by hand), expert stacks sharded over their experts on the expert mesh, and a
plain replicated matrix. Each rank feeds its own tokens; the loss is a sum over tokens
divided by the global count and FSDP's gradient division is off, so gradients equal the
single-process ones. Five steps of DistributedMuon (in "sync" mode, wait() after each step;
in "hooks" mode, model= hooks only; in "added" mode, as "hooks" with the second param group
given by add_param_group) must follow Muon on the concatenated data. A spawn costs
seconds of imports, so one spawn per world size records everything and the pytest cases
assert on the records (a worker that raised would leave the others waiting on it).

Legend: T tokens, D model dim, H hidden, R bottleneck, P projection, F expert FFN, E experts.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from fmoe.optim.muon import Muon, newton_schulz, shape_scale
from fmoe.parallel.muon import DistributedMuon
from tests.parallel.dist import run_distributed

D, H, R, P, F, E = 6, 10, 3, 9, 5, 4
T_GLOBAL = 18  # tokens per step over all ranks: 9+9 or 5+5+4+4
STEPS = 5
TIMEOUT = 120.0
# two param groups with different hyperparameters; lr decays through param_groups each step
GROUPS = (
    (("inp.weight", "experts.w_up", "tp.weight", "sub1.weight", "rep.weight"), dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1)),
    (("block.mid.weight", "block.up.weight", "experts.w_down", "sub2.weight"), dict(lr=0.03, momentum=0.8, nesterov=False, scale="spectral")),
)
LR_DECAY = 0.7
# NS on one owner (per mesh: sub1 and sub2 live on meshes of half the world with 4 ranks)
OWNED = ("inp.weight", "tp.weight", "sub1.weight", "sub2.weight", "rep.weight", "block.mid.weight", "block.up.weight")
LOCAL = ("experts.w_up", "experts.w_down")  # whole matrices on every rank


# ----------------------------------------------------------------------------------------
# The toy model (fmoe's [in, out] layout: x @ w)
# ----------------------------------------------------------------------------------------


def _whole(w: torch.Tensor) -> torch.Tensor:
    """The full matrix of a DTensor laid out by hand (not FSDP's), with its gradient declared
    Partial so that backward sums the ranks' contributions into w's layout."""
    if not isinstance(w, DTensor):
        return w
    n = w.device_mesh.ndim
    return w.redistribute(w.device_mesh, [Replicate()] * n).to_local(grad_placements=[Partial()] * n)


class Linear(nn.Module):
    def __init__(self, fan_in: int, fan_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(fan_in, fan_out) / math.sqrt(fan_in))

    def forward(self, x):
        return x @ _whole(self.weight)


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w_up = nn.Parameter(torch.randn(E, H, F) / math.sqrt(H))
        self.w_down = nn.Parameter(torch.randn(E, F, H) / math.sqrt(F))

    def forward(self, h_TH, expert_T):
        up_THF, down_TFH = _whole(self.w_up)[expert_T], _whole(self.w_down)[expert_T]
        return h_TH + torch.einsum("tf,tfh->th", torch.tanh(torch.einsum("th,thf->tf", h_TH, up_THF)), down_TFH)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mid, self.up = Linear(H, R), Linear(R, H)

    def forward(self, h):
        return h + self.up(torch.tanh(self.mid(h)))


class Tied(nn.Module):
    """One matrix in two modules: `late`, registered first, runs second."""

    def __init__(self):
        super().__init__()
        self.late, self.early = Linear(6, 6), Linear(6, 6)
        self.early.weight = self.late.weight

    def forward(self, x):
        return self.late(torch.tanh(self.early(x)))


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.experts, self.block, self.tp = Linear(D, H), Experts(), Block(), Linear(H, P)
        self.sub1, self.sub2, self.rep = Linear(P, P), Linear(P, P), Linear(P, D)

    def forward(self, x_TD, expert_T):
        h = self.block(self.experts(torch.tanh(self.inp(x_TD)), expert_T))
        h = torch.tanh(self.tp(h))
        return self.rep(torch.tanh(self.sub2(torch.tanh(self.sub1(h)))))


def _data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(T_GLOBAL, D, generator=g), torch.randint(0, E, (T_GLOBAL,), generator=g), torch.randn(T_GLOBAL, D, generator=g)


def _loss(model, x, expert, y):
    return (model(x, expert) - y).square().sum() / T_GLOBAL  # sum over tokens / global count


def _groups(model, **extra):
    params = dict(model.named_parameters())
    return [dict(params=[params[n] for n in names], **hyper, **extra) for names, hyper in GROUPS]


def _reference() -> dict:
    """Muon in one process on the concatenated data: losses and parameters after each step."""
    model = Toy()
    opt = Muon(_groups(model), ns_dtype=torch.float32)
    losses, params = [], []
    for step in range(STEPS):
        loss = _loss(model, *_data(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        for group in opt.param_groups:
            group["lr"] *= LR_DECAY
        losses.append(loss.item())
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return dict(losses=losses, params=params)


# ----------------------------------------------------------------------------------------
# Workers
# ----------------------------------------------------------------------------------------


def _meshes(world: int):
    from fmoe.parallel.mesh import build_meshes

    return build_meshes(ep=2) if world == 2 else build_meshes(dp_replicate=2, dp_shard=2, ep=2)


def _distributed_toy(meshes):
    """Toy laid out over the world (module docstring). Returns the model and, for the
    parameters whose mesh is not the whole world, the group over which their gradient is
    still to be summed after backward."""
    from torch.distributed.fsdp import fully_shard

    world = meshes.dense.size()
    dense = meshes.dense
    if world == 2:
        tp_mesh, tp_placements = dense["dp_shard"], [Shard(1)]
        # shard_experts' layout: experts over ep, the FFN dim over etp (of size 1: still local)
        up_placements, down_placements = [Replicate(), Shard(0), Shard(2)], [Replicate(), Shard(0), Replicate()]
        sub1_mesh, sub2_mesh, sums = dense["dp_shard"], meshes.batch["dp"], {}
    else:
        tp_mesh, tp_placements = dense["dp_replicate", "dp_shard"], [Shard(0), Shard(1)]
        up_placements = [Shard(0), Shard(0), Replicate()]  # one expert per rank
        down_placements = [Replicate(), Shard(0), Shard(1)]  # replicated over edp: computed twice
        # meshes of half the world that differ between ranks ({0, 1} or {2, 3}; {0, 2} or {1, 3}):
        # the ranks of each must agree on its owner without seeing the other's parameters
        sub1_mesh, sub2_mesh = dense["dp_shard"], dense["dp_replicate"]
        sums = {"sub1.weight": dense.get_group("dp_replicate"), "sub2.weight": dense.get_group("dp_shard")}
    model = Toy()
    for module, mesh in ((model.inp, meshes.dp_mesh), (model.block, meshes.batch["dp"])):
        fully_shard(module, mesh=mesh)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    model.tp.weight = nn.Parameter(distribute_tensor(model.tp.weight.detach(), tp_mesh, tp_placements))
    model.sub1.weight = nn.Parameter(distribute_tensor(model.sub1.weight.detach(), sub1_mesh, [Shard(1)]))
    model.sub2.weight = nn.Parameter(distribute_tensor(model.sub2.weight.detach(), sub2_mesh, [Shard(0)]))
    model.gradient_sums = sums
    model.experts.w_up = nn.Parameter(distribute_tensor(model.experts.w_up.detach(), meshes.expert, up_placements))
    model.experts.w_down = nn.Parameter(distribute_tensor(model.experts.w_down.detach(), meshes.expert, down_placements))
    return model


def _my_tokens(rank: int, world: int, step: int):
    return [t.tensor_split(world)[rank] for t in _data(step)]


def _forward_backward(model, rank, world, step) -> float:
    loss = _loss(model, *_my_tokens(rank, world, step))
    loss.backward()
    dist.all_reduce(model.rep.weight.grad)  # the plain replicated matrix: sum over the world
    params = dict(model.named_parameters())
    for name, group in model.gradient_sums.items():  # the rest of the world for a half-world mesh
        local = params[name].grad.to_local()  # an uneven Shard(1) shard is a strided view
        summed = local.contiguous()
        dist.all_reduce(summed, group=group)
        local.copy_(summed)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _full_params(model) -> dict:
    return {n: _full(p) for n, p in model.named_parameters()}


def _train(rank, world, meshes, *, hooks: bool, ns_calls: list, added: bool = False) -> dict:
    """Five steps; "sync" waits after each step, "hooks" relies on model= hooks; "added"
    (added=True) as "hooks" with the second group given by add_param_group, then wait()
    instead of the checkpoint round trip."""
    model = _distributed_toy(meshes)
    params = dict(model.named_parameters())
    groups = _groups(model)
    opt = DistributedMuon(groups[:1] if added else groups, ns_dtype=torch.float32, model=model if hooks else None)
    if added:
        opt.add_param_group(groups[1])
    record = dict(losses=[], params=[], ns_calls=[], expected_ns_calls=[], checks={})
    for step in range(STEPS):
        record["losses"].append(_forward_backward(model, rank, world, step))
        if hooks and step > 0:  # the forward above wrote step-1's updates: record them now
            record["checks"][f"nothing pending after forward {step}"] = not opt.pending
            record["params"].append(_full_params(model))
        before = _full_params(model) if hooks and step == 0 else None
        del ns_calls[:]
        opt.step()
        record["ns_calls"].append(sorted(ns_calls))
        record["expected_ns_calls"].append(sorted(
            [tuple(params[n].shape) for n in OWNED if opt.owner_of(params[n]) == rank]
            + [tuple(params[n].to_local().shape) for n in LOCAL]
        ))
        if hooks and step == 0:  # the owned matrices are still in flight, the local ones written
            after = _full_params(model)
            checks = record["checks"]
            checks["pending after step: exactly the owned matrices"] = {id(p) for p in opt.pending} == {id(params[n]) for n in OWNED}
            checks["owned matrices unchanged before wait"] = all(torch.equal(before[n], after[n]) for n in OWNED)
            checks["local matrices written in step"] = all(not torch.equal(before[n], after[n]) for n in LOCAL)
        opt.zero_grad()
        for group in opt.param_groups:  # before wait(): the update keeps the lr of its step
            group["lr"] *= LR_DECAY
        if not hooks:
            opt.wait()
            record["params"].append(_full_params(model))
    if added:
        opt.wait()
        record["params"].append(_full_params(model))
    elif hooks:
        record["dcp"] = _checkpoint_round_trip(rank, world, meshes, model, opt)
        record["params"].append(record["dcp"].pop("saved_params"))
    record["owners"] = {n: opt.owner_of(p) for n, p in params.items()}
    record["mesh_ranks"] = {n: tuple(p.device_mesh.mesh.flatten().tolist()) if isinstance(p, DTensor) else tuple(range(world)) for n, p in params.items()}
    record["load_per_rank"] = opt.load_per_rank
    return record


def _checkpoint_round_trip(rank, world, meshes, model, opt) -> dict:
    """Right after step() (updates in flight): the model's state dict, then the optimizer's
    (momentum laid out like the parameters); set_state_dict into a fresh model and
    optimizer, then one more step on both; and a model load while updates are in flight."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict
    from torch.utils._pytree import tree_map

    params = dict(model.named_parameters())
    checks = {}
    msd = get_model_state_dict(model)  # the model's state-dict pre-hook completes the pending updates
    checks["nothing pending after get_model_state_dict"] = not opt.pending
    out = dict(saved_params={n: _full(msd[n]) for n in params}, checks=checks)
    _, osd = get_state_dict(model, opt)
    layouts = []
    for n, p in params.items():
        buf = osd["state"][n]["momentum_buffer"]
        if isinstance(p, DTensor):
            layouts.append(isinstance(buf, DTensor) and buf.placements == p.placements and buf.device_mesh == p.device_mesh)
        else:
            layouts.append(type(buf) is torch.Tensor and buf.shape == p.shape)
    checks["momentum buffers laid out like their parameters"] = all(layouts)
    saved_momentum = {n: _full(osd["state"][n]["momentum_buffer"]) for n in params}

    model2 = _distributed_toy(meshes)
    opt2 = DistributedMuon(_groups(model2), ns_dtype=torch.float32, model=model2)
    # torch's optimizers alias loaded state tensors: give opt2 its own copies
    copies = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (msd, osd))
    set_state_dict(model2, opt2, model_state_dict=copies[0], optim_state_dict=copies[1])
    params2 = dict(model2.named_parameters())
    checks["loaded momentum equals saved"] = all(torch.equal(_full(opt2.state[params2[n]]["momentum_buffer"]), saved_momentum[n]) for n in params)
    checks["loaded lr equals saved"] = [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]
    for m, o in ((model, opt), (model2, opt2)):
        _forward_backward(m, rank, world, STEPS)
        o.step()
        o.wait()
        o.zero_grad()
    full, full2 = _full_params(model), _full_params(model2)
    checks["a step after loading equals a step without"] = all(torch.equal(full[n], full2[n]) for n in params)

    # a load while updates are in flight: the model's load pre-hook completes them first,
    # so that they do not land on the loaded values
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    _forward_backward(model, rank, world, STEPS + 1)
    opt.step()
    model.load_state_dict(snapshot)
    opt.wait()
    checks["pending updates land before a model load"] = all(torch.equal(_full(p), full[n]) for n, p in params.items())
    return out


def _nothing_owned(rank, world, meshes) -> dict:
    """One owned matrix: world - 1 ranks own nothing and still take part (no hang)."""
    model = _distributed_toy(meshes)
    _forward_backward(model, rank, world, 0)
    p = model.inp.weight
    start, grad = _full(p), _full(p.grad)
    opt = DistributedMuon([p], lr=0.1, ns_dtype=torch.float32)
    for _ in range(2):  # same gradient twice: the momentum grows
        opt.step()
    opt.wait()
    return dict(owner=opt.owner_of(p), load_per_rank=opt.load_per_rank, start=start, grad=grad, end=_full(p))


def _bad_layouts(meshes) -> dict:
    """ValueErrors for DTensor layouts: Partial, and (on a 2-D mesh) local shards that are
    not blocks of the matrix: rows {0, 2} | {1, 3} | {4, 6} | {5, 7} of 8; rows [0, 2) |
    [1, 2) | [3, 5) | none of 5 (they overlap, and reach the last row)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    layouts = {"partial": (meshes.batch["dp"], [Partial()], (4, 4), (4, 4))}
    if meshes.dense.size() == 4:
        mesh, strided = meshes.dense["dp_replicate", "dp_shard"], [Shard(0), _StridedShard(0, split_factor=2)]
        rows = {(0, 0): 2, (0, 1): 1, (1, 0): 2, (1, 1): 0}[tuple(mesh.get_coordinate())]
        layouts.update(strided=(mesh, strided, (2, 4), (8, 4)), strided_uneven=(mesh, strided, (rows, 2), (5, 2)))
    messages = {}
    for name, (mesh, placements, local_shape, shape) in layouts.items():
        p = nn.Parameter(DTensor.from_local(torch.zeros(local_shape), mesh, placements, run_check=False, shape=torch.Size(shape), stride=(shape[1], 1)))
        try:
            DistributedMuon([p])
            messages[name] = "no error"
        except ValueError as e:
            messages[name] = str(e)
    # the plain Muon on an FSDP2 shard: named, and pointed to DistributedMuon (it named no parameter and no way out)
    shard = nn.Parameter(DTensor.from_local(torch.zeros(2, 4), meshes.batch["dp"], [Shard(0)], run_check=False,
                                            shape=torch.Size((2 * meshes.batch["dp"].size(), 4)), stride=(4, 1)))
    try:
        Muon([("blocks.0.attn.wq", shard)])
        messages["plain muon"] = "no error"
    except ValueError as e:
        messages["plain muon"] = str(e)
    return messages


def _rules(rank, world) -> dict:
    """The documented rules on small cases: owners largest numel first, each to the least
    loaded rank (ties: the first); a load_state_dict without model= hooks right after a step
    (its update in flight), through DCP's set_state_dict and by hand; with 4 ranks an expert
    stack split over its experts and over a matrix dim (etp 2), orthogonalised whole."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._pytree import tree_map

    ties = [nn.Parameter(torch.zeros(4, 4)) for _ in range(2)]
    sizes = [nn.Parameter(torch.zeros(*s)) for s in ((2, 2), (2, 2), (2, 2), (2, 2), (4, 4))]  # numel 4, 4, 4, 4, 16
    opt = DistributedMuon(sizes)
    out = dict(tie_owners=[DistributedMuon(ties).owner_of(p) for p in ties], owners=[opt.owner_of(p) for p in sizes],
               load_per_rank=opt.load_per_rank, loads={})
    g = torch.Generator().manual_seed(0)
    w0, grad = torch.randn(world, 6, generator=g), torch.randn(world, 6, generator=g)
    mesh = init_device_mesh("cpu", (world,))
    for how in ("set_state_dict", "by hand"):
        model = nn.Linear(6, world, bias=False)
        model.weight = nn.Parameter(distribute_tensor(w0.clone(), mesh, [Shard(0)]))
        p = model.weight
        opt = DistributedMuon([p], lr=0.1, ns_dtype=torch.float32)  # no model=: no hooks complete its updates
        p.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
        opt.step()
        opt.wait()
        msd, osd = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, get_state_dict(model, opt))
        saved = p.full_tensor().clone()
        opt.step()  # its update in flight
        if how == "set_state_dict":  # the optimizer first, then the model
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        else:
            opt.load_state_dict(osd)
            model.load_state_dict(msd)
        pending = len(opt.pending)
        opt.wait()
        out["loads"][how] = (pending, float((p.full_tensor() - saved).abs().max()))
    if world == 4:
        w0, grad = torch.randn(2, 4, 6, generator=g), torch.randn(2, 4, 6, generator=g)
        experts = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "etp"))
        p = nn.Parameter(distribute_tensor(w0.clone(), experts, [Shard(0), Shard(2)]))
        p.grad = distribute_tensor(grad.clone(), experts, [Shard(0), Shard(2)])
        opt = DistributedMuon([p], lr=0.1, ns_dtype=torch.float32)
        opt.step()
        opt.wait()
        ref = nn.Parameter(w0.clone())
        ref.grad = grad.clone()
        Muon([ref], lr=0.1, ns_dtype=torch.float32).step()
        out["etp stack"] = (opt.owner_of(p), float((p.full_tensor() - ref.detach()).abs().max()))
    return out


def _edge_data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(3, 4, 6, generator=g), torch.randn(3, 4, 6, generator=g)


def _muon_step(w0: torch.Tensor, grads: torch.Tensor) -> list[torch.Tensor]:
    """Single-process Muon's matrices after one step from w0[i] with gradient grads[i]."""
    ref = [nn.Parameter(w.clone()) for w in w0]
    for p, grad in zip(ref, grads):
        p.grad = grad.clone()
    Muon(ref, lr=0.1, ns_dtype=torch.float32).step()
    return [p.detach() for p in ref]


def _edges(rank, world) -> dict:
    """On the world's 1-D mesh: a DTensor replicated over its whole mesh and two plain
    matrices (one table, 24 elements each); wait([a]) after a step, then state_dict(); and a
    model.state_dict() after remove_hooks() with an update in flight."""
    from torch.distributed.device_mesh import init_device_mesh

    w0, grads = _edge_data()
    mesh = init_device_mesh("cpu", (world,))
    params = [nn.Parameter(distribute_tensor(w0[0].clone(), mesh, [Replicate()])), nn.Parameter(w0[1].clone()), nn.Parameter(w0[2].clone())]
    opt = DistributedMuon(params, lr=0.1, ns_dtype=torch.float32)
    for p, grad in zip(params, grads):
        p.grad = distribute_tensor(grad.clone(), mesh, [Replicate()]) if isinstance(p, DTensor) else grad.clone()
    opt.step()
    out = dict(owners=[opt.owner_of(p) for p in params])
    opt.wait([params[1]])
    out["pending after wait([a])"] = [i for i, p in enumerate(params) if any(p is q for q in opt.pending)]
    opt.state_dict()
    out["pending after state_dict"] = len(opt.pending)
    out["params"] = [_full(p) for p in params]
    model = nn.Linear(6, 4, bias=False)
    model.weight = nn.Parameter(distribute_tensor(w0[0].clone(), mesh, [Shard(0)]))
    opt = DistributedMuon([model.weight], lr=0.1, ns_dtype=torch.float32, model=model)
    opt.remove_hooks()
    model.weight.grad = distribute_tensor(grads[0].clone(), mesh, [Shard(0)])
    opt.step()
    model.state_dict()
    out["pending after model.state_dict() without hooks"] = len(opt.pending)
    opt.wait()
    torch.manual_seed(0)
    tied = Tied()
    opt = DistributedMuon(list(tied.parameters()), lr=0.1, ns_dtype=torch.float32, model=tied)
    tied(grads[0]).sum().backward()
    opt.step()
    seen = []
    tied.early.register_forward_pre_hook(lambda module, args: seen.append(module.weight.detach().clone()))
    tied(grads[0])
    opt.wait()
    out["tied: the module that runs first sees the update"] = torch.equal(seen[0], tied.early.weight.detach())
    return out


def _worker(rank: int, world: int) -> dict:
    import fmoe.parallel.muon as distributed_muon

    ns_calls = []

    def counting(G, *args, **kwargs):
        ns_calls.append(tuple(G.shape))
        return newton_schulz(G, *args, **kwargs)

    distributed_muon.newton_schulz = counting  # this process only
    meshes = _meshes(world)
    out = dict(
        sync=_train(rank, world, meshes, hooks=False, ns_calls=ns_calls),
        hooks=_train(rank, world, meshes, hooks=True, ns_calls=ns_calls),
        added=_train(rank, world, meshes, hooks=True, ns_calls=ns_calls, added=True),
        nothing_owned=_nothing_owned(rank, world, meshes),
        bad_layouts=_bad_layouts(meshes),
        rules=_rules(rank, world),
        edges=_edges(rank, world),
    )
    return out


# ----------------------------------------------------------------------------------------
# pytest side: one spawn per world size
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def spawned(request):
    return request.param, run_distributed(_worker, request.param, timeout=TIMEOUT)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("mode", ["sync", "hooks", "added"])
def test_matches_single_process_muon(spawned, reference, mode):
    size, results = spawned
    for rank, result in enumerate(results):
        record = result[mode]
        assert len(record["params"]) == STEPS
        for step in range(STEPS):
            got, want = record["losses"][step], reference["losses"][step]
            assert abs(got - want) <= 1e-5 * abs(want), (rank, step, got, want)
            for name, expected in reference["params"][step].items():
                err = _rel(record["params"][step][name], expected)
                assert err <= 1e-5, f"rank {rank}, step {step}, {name}: relative error {err:.2e}"


def test_async_and_hooks(spawned):
    size, results = spawned
    for rank, result in enumerate(results):
        for mode in ("hooks", "added"):
            failed = [name for name, ok in result[mode]["checks"].items() if not ok]
            assert not failed, f"rank {rank}, {mode}: {failed}"


def test_group_added_later_is_the_constructors(spawned):
    """A group given by add_param_group gets the forward pre-hooks of model= (a forward used
    its stale weights) and the same owners: the same bits as the group given at construction."""
    size, results = spawned
    for rank, result in enumerate(results):
        hooks, added = result["hooks"], result["added"]
        assert added["owners"] == hooks["owners"] and added["losses"] == hooks["losses"], rank
        for step, (got, want) in enumerate(zip(added["params"], hooks["params"])):
            assert all(torch.equal(got[n], want[n]) for n in want), (rank, step)


def test_only_owners_run_newton_schulz(spawned, reference):
    size, results = spawned
    shape = {n: tuple(p.shape) for n, p in reference["params"][0].items()}
    for mode in ("sync", "hooks", "added"):
        for rank, result in enumerate(results):
            record = result[mode]
            assert record["ns_calls"] == record["expected_ns_calls"], (mode, rank)
        # each copy of an owned (2-D) matrix, one per distinct mesh, is orthogonalised once per step
        copies = {(n, r[mode]["mesh_ranks"][n]) for r in results for n in OWNED}
        for step in range(STEPS):
            calls = sorted(c for result in results for c in result[mode]["ns_calls"][step] if len(c) == 2)
            assert calls == sorted(shape[n] for n, _ in copies), (mode, step, calls)


def test_ownership_is_balanced_and_consistent(spawned, reference):
    size, results = spawned
    numel = {n: p.numel() for n, p in reference["params"][0].items()}
    records = [result[mode] for result in results for mode in ("sync", "hooks")]
    owner = {}  # (name, mesh ranks) -> owner: the ranks of a mesh agree, the owner is one of them
    for record in records:
        assert all(record["owners"][n] is None for n in LOCAL)
        for n in OWNED:
            ranks = record["mesh_ranks"][n]
            assert record["owners"][n] in ranks
            assert owner.setdefault((n, ranks), record["owners"][n]) == record["owners"][n], (n, ranks)
    # one table per set of ranks: balanced within it
    for table in {ranks for _, ranks in owner}:
        load = {r: sum(numel[n] for (n, ranks), o in owner.items() if ranks == table and o == r) for r in table}
        largest = max(numel[n] for n, ranks in owner if ranks == table)
        assert max(load.values()) <= min(load.values()) + largest, (table, load)
    world = tuple(range(size))
    assert sum(ranks == world for _, ranks in owner) >= 5  # most matrices are on the world's ranks
    for rank, result in enumerate(results):
        expected = {}
        for n in OWNED:
            o = result["sync"]["owners"][n]
            expected[o] = expected.get(o, 0) + numel[n]
        assert result["sync"]["load_per_rank"] == expected


def test_owners_follow_the_documented_rule(spawned):
    """Largest numel first, each to the least loaded rank, ties to the first rank: 16 to rank
    0, then the 4s to the others in turn (smallest first loaded rank 0 with 24 of 32)."""
    size, results = spawned
    want = [1, 1, 1, 1, 0] if size == 2 else [1, 2, 3, 1, 0]
    loads = {0: 16, 1: 16} if size == 2 else {0: 16, 1: 8, 2: 4, 3: 4}
    for rank, result in enumerate(results):
        rules = result["rules"]
        assert rules["tie_owners"] == [0, 1] and rules["owners"] == want and rules["load_per_rank"] == loads, (rank, rules)


def test_a_load_without_model_hooks_completes_the_updates_in_flight_first(spawned):
    """load_state_dict completes the pending updates, then loads: the stale update of the
    step before the load does not land on the loaded weights (3.8e-2 off them when it did)."""
    size, results = spawned
    for rank, result in enumerate(results):
        for how, (pending, off) in result["rules"]["loads"].items():
            assert pending == 0 and off == 0.0, (rank, how, pending, off)


def test_an_expert_stack_split_over_a_matrix_dim_is_orthogonalised_whole(spawned):
    """etp 2: each expert's matrix is split over its columns; one owner gathers it whole, as
    single-process Muon sees it (each rank orthogonalising its shard was 2.4e-2 off)."""
    size, results = spawned
    if size == 2:
        pytest.skip("needs a 2 x 2 (ep, etp) mesh: the world4 case runs it")
    for rank, result in enumerate(results):
        owner, off = result["rules"]["etp stack"]
        assert owner in range(4) and off < 1e-6, (rank, owner, off)


def test_checkpoint_round_trip(spawned):
    size, results = spawned
    for rank, result in enumerate(results):
        failed = [name for name, ok in result["hooks"]["dcp"]["checks"].items() if not ok]
        assert not failed, f"rank {rank}: {failed}"


def test_rank_owning_nothing_takes_part(spawned):
    size, results = spawned
    record = results[0]["nothing_owned"]
    assert record["load_per_rank"] == {record["owner"]: record["start"].numel()}
    for result in results:
        assert torch.equal(result["nothing_owned"]["end"], record["end"])
    w = nn.Parameter(record["start"].clone())
    opt = Muon([w], lr=0.1, ns_dtype=torch.float32)
    for _ in range(2):
        w.grad = record["grad"].clone()
        opt.step()
    assert _rel(record["end"], w.detach()) <= 1e-5


def test_bad_layouts_are_refused(spawned):
    size, results = spawned
    for result in results:
        messages = result["bad_layouts"]
        assert "params" in messages["partial"] and "Partial" in messages["partial"]
        assert messages["plain muon"].startswith("params[0] (blocks.0.attn.wq): a DTensor of shape (") and "sharded over a matrix dim" in messages["plain muon"] \
            and "fmoe.parallel.DistributedMuon gathers them under FSDP2" in messages["plain muon"], messages["plain muon"]
        if size == 4:
            for name in ("strided", "strided_uneven"):
                assert messages[name].startswith("params: a DTensor whose local shards are not blocks of the matrix"), messages[name]


def test_replicated_dtensors_and_plain_matrices_are_owned_and_waited_per_parameter(spawned):
    """A DTensor replicated over its whole mesh is owned by one rank, as plain matrices are,
    in the world's table: rank 0, then plain a to rank 1 (broadcast from it), b to the next
    least loaded; wait([a]) completes a only, state_dict() the rest; Muon's results."""
    size, results = spawned
    ref = _muon_step(*_edge_data())
    for rank, result in enumerate(results):
        edges = result["edges"]
        assert edges["owners"] == [0, 1, 0 if size == 2 else 2], (rank, edges["owners"])
        assert edges["pending after wait([a])"] == [0, 2] and edges["pending after state_dict"] == 0, (rank, edges)
        assert all(torch.equal(got, want) for got, want in zip(edges["params"], ref)), rank


def test_a_tied_matrix_is_written_before_whichever_of_its_modules_runs_first(spawned):
    size, results = spawned
    for rank, result in enumerate(results):
        assert result["edges"]["tied: the module that runs first sees the update"], rank


def test_after_remove_hooks_a_model_state_dict_leaves_the_update_in_flight(spawned):
    size, results = spawned
    for rank, result in enumerate(results):
        assert result["edges"]["pending after model.state_dict() without hooks"] == 1, rank


# ----------------------------------------------------------------------------------------
# One process: no process group
# ----------------------------------------------------------------------------------------


def test_single_process_equals_muon():
    torch.manual_seed(1)
    ws = [torch.randn(7, 5), torch.randn(3, 4, 6)]
    ref = [nn.Parameter(w.clone()) for w in ws]
    got = [nn.Parameter(w.clone()) for w in ws]
    opt_ref = Muon(ref, lr=0.1, weight_decay=0.1, ns_dtype=torch.float32)
    opt = DistributedMuon(got, lr=0.1, weight_decay=0.1, ns_dtype=torch.float32)
    for _ in range(3):
        grads = [torch.randn_like(w) for w in ws]
        for ps, o in ((ref, opt_ref), (got, opt)):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            o.step()
    opt.wait()
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert opt.owner_of(got[0]) is None and opt.load_per_rank == {}


def test_update_uses_shape_scale():
    w = nn.Parameter(torch.zeros(8, 2))
    w.grad = torch.randn(8, 2)
    DistributedMuon([w], lr=1.0, momentum=0.0, ns_dtype=torch.float32).step()
    expected = -shape_scale(w.shape, "moonlight") * newton_schulz(w.grad, dtype=torch.float32)
    assert torch.allclose(w.detach(), expected)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), "lr"),
        (dict(momentum=1.0), "momentum"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(ns_steps=0), "ns_steps"),
        (dict(scale="unit"), "scale"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistributedMuon([nn.Parameter(torch.zeros(3, 3))], **kwargs)


def test_bad_params_and_model():
    with pytest.raises(ValueError, match="params.*ndim >= 2"):
        DistributedMuon([nn.Parameter(torch.zeros(3))])
    for dtype in (torch.int64, torch.complex64):  # as Muon refuses them
        with pytest.raises(ValueError, match=f"^params: expected floating-point parameters, got {dtype}"):
            DistributedMuon([torch.zeros(3, 3, dtype=dtype)])
    w = nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="params.*twice"):
        DistributedMuon([w, w])
    with pytest.raises(ValueError, match="model"):
        DistributedMuon([w], model=nn.Linear(3, 3))
    with pytest.raises(ValueError, match="param"):
        DistributedMuon([w]).owner_of(torch.zeros(2, 2))


def test_params_must_be_an_ordered_collection():
    """A set's order differs between processes: the ranks assigned different owners and
    tags, and hung. torch's TypeError, as in Muon and AdamW, at the top level too."""
    w = nn.Parameter(torch.zeros(3, 3))
    for params in ({w}, [{"params": {w}}]):
        with pytest.raises(TypeError, match="^params: expected an ordered collection"):
            DistributedMuon(params)
    opt = DistributedMuon([nn.Parameter(torch.zeros(2, 2))])
    with pytest.raises(TypeError, match="^params: expected an ordered collection"):
        opt.add_param_group({"params": {w}})
    assert len(opt.param_groups) == 1


def test_add_param_group_checks_the_model():
    """A group added later must belong to `model` too, as the constructor's (it was taken
    without a check or a hook)."""
    model = nn.Linear(3, 3, bias=False)
    opt = DistributedMuon([model.weight], model=model)
    stranger = nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"^model: parameters of shapes \[\(3, 3\)\] are not parameters of the model"):
        opt.add_param_group({"params": [stranger]})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match=r"^params: a parameter of shape \(3, 3\) appears twice"):
        opt.add_param_group({"params": [model.weight]})


def test_sparse_gradient_is_refused_before_any_update():
    """As Muon: the dense matrix was updated (and its momentum made) before the sparse one failed in NS."""
    dense, sparse = nn.Parameter(torch.ones(3, 3)), nn.Parameter(torch.ones(3, 3))
    dense.grad, sparse.grad = torch.randn(3, 3), torch.eye(3).to_sparse()
    opt = DistributedMuon([dense, sparse], lr=0.1)
    with pytest.raises(RuntimeError, match="^Muon does not support sparse gradients"):
        opt.step()
    assert torch.equal(dense.detach(), torch.ones(3, 3)) and not opt.state


def test_hyperparameters_set_later_are_checked_at_step():
    w = nn.Parameter(torch.ones(3, 3))
    opt = DistributedMuon([w])
    opt.param_groups[0]["lr"] = float("nan")
    w.grad = torch.ones(3, 3)
    with pytest.raises(ValueError, match="^lr: expected"):
        opt.step()
    assert torch.equal(w.detach(), torch.ones(3, 3)) and not opt.state


def test_load_refuses_a_momentum_buffer_of_another_shape():
    w = nn.Parameter(torch.ones(3, 4))
    opt = DistributedMuon([w])
    w.grad = torch.ones(3, 4)
    opt.step()
    saved = opt.state_dict()
    saved["state"][0]["momentum_buffer"] = torch.zeros(4, 3)
    fresh = DistributedMuon([nn.Parameter(torch.ones(3, 4))])
    with pytest.raises(ValueError, match=r"^state_dict: expected momentum_buffer of parameter 0 to have the parameter's shape \(3, 4\), got \(4, 3\)"):
        fresh.load_state_dict(saved)
    assert not fresh.state


def test_named_parameters_and_loaded_groups_are_checked_as_muon_s():
    """(name, tensor) pairs were refused as matrices of shape "tuple"; a saved group whose lr
    is a tensor loaded and every later step failed."""
    torch.manual_seed(2)
    ws = [torch.randn(4, 3), torch.randn(3, 5)]
    named, plain = [nn.Parameter(w.clone()) for w in ws], [nn.Parameter(w.clone()) for w in ws]
    opt = DistributedMuon([("a", named[0]), ("b", named[1])], lr=0.1, ns_dtype=torch.float32)
    ref = DistributedMuon(plain, lr=0.1, ns_dtype=torch.float32)
    for ps, o in ((named, opt), (plain, ref)):
        for p, w in zip(ps, ws):
            p.grad = w.cos()
        o.step()
        o.wait()
    assert all(torch.equal(a, b) for a, b in zip(named, plain))
    saved = opt.state_dict()
    assert saved["param_groups"][0]["param_names"] == ["a", "b"]
    saved["param_groups"][0]["lr"] = torch.tensor(0.1)
    with pytest.raises(ValueError, match=r"^state_dict: param group 0: lr: expected a number \(a tensor lr"):
        ref.load_state_dict(saved)
    assert type(ref.param_groups[0]["lr"]) is float


def test_a_world_of_one_rank_updates_every_matrix_in_step(one_rank_mesh):
    """One rank: a plain matrix and a DTensor on the one-rank mesh are local (no owner),
    written by step() itself with nothing left for wait(), as Muon writes them."""
    g = torch.Generator().manual_seed(4)
    w0, grads = torch.randn(2, 5, 3, generator=g), torch.randn(2, 5, 3, generator=g)
    plain, sharded = nn.Parameter(w0[0].clone()), nn.Parameter(distribute_tensor(w0[1].clone(), one_rank_mesh, [Shard(0)]))
    plain.grad, sharded.grad = grads[0].clone(), distribute_tensor(grads[1].clone(), one_rank_mesh, [Shard(0)])
    opt = DistributedMuon([plain, sharded], lr=0.1, ns_dtype=torch.float32)
    opt.step()
    assert [opt.owner_of(plain), opt.owner_of(sharded)] == [None, None] and not opt.pending
    ref = _muon_step(w0, grads)
    assert torch.equal(plain.detach(), ref[0]) and torch.equal(sharded.full_tensor(), ref[1])


def test_ns_steps_reaches_newton_schulz():
    w = nn.Parameter(torch.zeros(6, 4))
    w.grad = torch.randn(6, 4, generator=torch.Generator().manual_seed(5))
    DistributedMuon([w], lr=1.0, momentum=0.0, ns_steps=2, ns_dtype=torch.float32).step()
    expected = -shape_scale(w.shape, "moonlight") * newton_schulz(w.grad, steps=2, dtype=torch.float32)
    assert torch.equal(w.detach(), expected)


def test_remove_hooks_forgets_the_model():
    """Groups added after remove_hooks() are neither hooked nor checked against the model."""
    model = nn.Linear(3, 3, bias=False)
    opt = DistributedMuon([model.weight], model=model)
    opt.remove_hooks()
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(3, 3))]})
    assert len(opt.param_groups) == 2


def test_loaded_momentum_buffers_have_their_own_storage():
    """An optimizer loaded from another's in-memory state_dict() does not step the other's
    momentum buffer."""
    w = nn.Parameter(torch.ones(3, 4))
    w.grad = torch.ones(3, 4)
    opt = DistributedMuon([w], lr=0.1)
    opt.step()
    fresh_w = nn.Parameter(torch.ones(3, 4))
    fresh = DistributedMuon([fresh_w], lr=0.1)
    fresh.load_state_dict(opt.state_dict())
    fresh_w.grad = torch.ones(3, 4)
    fresh.step()
    assert torch.equal(opt.state[w]["momentum_buffer"], torch.ones(3, 4))
    assert torch.equal(fresh.state[fresh_w]["momentum_buffer"], torch.full((3, 4), 1.95))
