"""Gradient helpers: the gradient norm and its clipping, the parameter norm, the count of
zero gradients, float32 accumulation of bf16 gradients.

    grad_norm(parameters, *, norm_type=2.0, group=None, pp_group=None) -> 0-D float32 tensor
    clip_grad_norm(parameters, max_norm, *, norm_type=2.0, group=None, pp_group=None, copies=())
        -> the pre-clip norm
    clip_factor(norm, max_norm) -> min(1, max_norm / (norm + 1e-6)), a 0-D float32 tensor
    param_norm(parameters, *, group=None, pp_group=None, copies=()) -> 0-D float32 tensor
    zero_grad_count(parameters, *, group=None, pp_group=None, copies=()) -> 0-D int64 tensor
    Float32GradAccumulator(model, patterns)    float32 sums of chosen parameters' gradients

Clipping (torch.nn.utils.clip_grad_norm_'s rule): every gradient is scaled by

    coef = min(1, max_norm / (norm + 1e-6)),    norm = ||concat of all gradients||_p

and the pre-clip norm is returned as a float32 0-D tensor on the device, never a Python
number: the train loop reads it once per step, with its other logged values. On CUDA the
scale is one Triton launch per gradient dtype (fmoe.optim.adamw.scale_), with the bits of
torch's: torch's own multi-tensor multiply falls back to a kernel per tensor when the factor's dtype is not
the gradients' (a float32 norm over bf16 gradients), which ran at 32% of the copy rate on an
H100 (benchmarks/RESULTS.md). Or the factor
is passed to fmoe.optim.AdamW's step (`grad_norm`, then `step(grad_factor=clip_factor(norm,
max_norm))`), which multiplies each gradient as it reads it: the same update (bit for bit
with float32 gradients) without a pass over the gradients of its own.

One process or many: with torch.distributed not initialised, or a group of one rank, no
collective is issued and plain-tensor gradients in float32 (or float64) go through
torch.nn.utils.get_total_norm / clip_grad_norm_ themselves (the same bits as torch, the norm
cast to float32). Where any gradient is bf16 or fp16 the norm is the rule below, in float32
and float64, as on many ranks: torch's computes those gradients' norms in their own dtype
(193.0 where the norm is 193.31), so one process would clip otherwise than N. Under torchrun the norm is taken over the whole model, whatever mesh each
gradient lives on:

Gradient norm over meshes. Gradients are plain tensors (a full copy on every rank) or
DTensors on any mesh of the world: FSDP2 shards over the data mesh, experts Shard(0) over
ep with FSDP over edp, TP shards, meshes that are slices of the world. Rank q computes

    a_q = sum_grads  sum |local shard|^p / replicas(grad)
    replicas = world / mesh.size() * prod_{mesh dims d with Replicate} mesh.size(d)
    (= world for a plain tensor)

replicas counts the ranks holding an identical copy of that local shard (the other slices
of the world and the Replicate dims of its own mesh), so one SUM all_reduce of a_q over the
world gives sum |g|^p over the full gradients with every element counted once; the norm is
its p-th root (a MAX all_reduce of the local max for p = inf). Under pipeline parallelism
the world above is one stage's ranks (`group`) and the stages' sums are then added over
the pipeline group (`pp_group`): each stage holds different parameters. Shard placements (including
FSDP2's _StridedShard and uneven or empty shards) split the elements disjointly; a Partial
placement is refused (its local values are not the gradient's). Every rank issues that one
collective, the same on all, whatever it holds (no gradient at all sends a zero): a skipped
collective hangs the others. Per tensor the norm is accumulated in float32, across tensors
and ranks in float64.

The same rule applied to the parameters' values gives param_norm (||concat of all
parameters||_2, for logging the weights' growth). zero_grad_count counts the elements whose
gradient is exactly 0 (a parameter without a .grad: all its elements), each element once:
integer counts cannot be divided by `replicas` exactly, so rank q adds its count times
world / replicas (an integer: replicas divides the world), the SUM over the world is then
world times the count, divided back exactly in int64.

Float32GradAccumulator: with bf16 parameters, autograd sums the micro-batch gradients into a
bf16 .grad, rounding after every micro-batch (8 significant bits: once the sum is 256 times
a micro-batch's contribution, that contribution is rounded away). For the parameters that
need it (the router, whose logits decide discrete choices) the accumulator moves each
micro-batch's bf16 gradient into a float32 sum as soon as autograd has produced it:

    main_grad[p] = sum_i float32(grad_i(p))      (one bf16 rounding per micro-batch, not per sum)

It is for models whose parameters are stored in bf16. fmoe's train loop does not need it:
it keeps float32 master weights (FSDP2's mixed precision, on one process too), so every
gradient, the router's included, is summed across micro-batches in float32 into the
float32 .grad the optimizer reads (tests/parallel/test_mixed_precision.py).

The process-group helpers (process_group, collective_device) are shared with
fmoe.parallel's reductions.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fmoe.ops.backend import IMPLS, use_triton
from fmoe.ops.checks import check_float
from fmoe.optim.adamw import scale_

Group = Union[dist.ProcessGroup, DeviceMesh]
Parameters = Union[torch.Tensor, Iterable[torch.Tensor]]

# added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does
_CLIP_EPS = 1e-6


# ----------------------------------------------------------------------------------------
# Process groups
# ----------------------------------------------------------------------------------------


def process_group(group, name: str = "group") -> dist.ProcessGroup:
    """The process group of `group`: a ProcessGroup, or the group of a 1-D DeviceMesh.
    ValueError naming `name` for anything else (a 2-D mesh, None, a string)."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"{name}: expected a process group or a 1-D DeviceMesh, got a {group.ndim}-D mesh "
                f"{group.mesh_dim_names} (slice one axis, e.g. meshes.dense['tp'])"
            )
        return group.get_group()
    if isinstance(group, dist.ProcessGroup):
        return group
    if group is None and not (dist.is_available() and dist.is_initialized()):  # dist.group.WORLD before init_process_group
        raise ValueError(f"{name}: expected a torch.distributed ProcessGroup or a 1-D DeviceMesh, got None: torch.distributed is not "
                         "initialised (run under torchrun and call init_process_group; dist.group.WORLD is None until then)")
    raise ValueError(f"{name}: expected a torch.distributed ProcessGroup or a 1-D DeviceMesh, got {type(group).__name__}")


def collective_device(group: dist.ProcessGroup, tensors: Sequence[torch.Tensor]) -> torch.device:
    """Where a collective's buffer lives: on the GPU for an nccl-only group (nccl reduces
    CUDA tensors only, and a rank holding no tensor must still pick the same kind of device
    as the others), else with the local tensors, else on the CPU."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if tensors:
        return tensors[0].device
    return torch.device("cpu")


def _group_and_size(group) -> tuple[Optional[dist.ProcessGroup], int]:
    """(the group to reduce over, its size): `group` itself, the world when None under
    torch.distributed, or (None, 1) in a process without torch.distributed."""
    if group is not None:
        pg = process_group(group)
        return pg, dist.get_world_size(pg)
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD, dist.get_world_size()
    return None, 1


# ----------------------------------------------------------------------------------------
# Gradient norm and clipping
# ----------------------------------------------------------------------------------------


def _check_norm_type(norm_type) -> float:
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real) or not norm_type > 0:  # NaN fails too
        raise ValueError(f"norm_type: expected a number > 0 or inf, got {norm_type!r}")
    return float(norm_type)


def _check_max_norm(max_norm) -> float:
    """max_norm as a float: any real number > 0 (numpy's scalars too; inf: no clipping), not a
    bool, NaN or a tensor."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not max_norm > 0:
        raise ValueError(f"max_norm: expected a positive number, got {max_norm!r}")
    return float(max_norm)


def _as_param_list(parameters) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    try:
        params = list(parameters)
    except TypeError:
        raise ValueError(f"parameters: expected a tensor or an iterable of tensors, got {type(parameters).__name__}") from None
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"parameters[{i}]: expected a tensor, got {type(p).__name__}")
    return params


def _with_grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters whose .grad is not None and holds elements: an empty one adds nothing
    to a norm (an expert stack with no local experts), and torch's inf norm refuses it."""
    return [q for q in params if q.grad is not None and q.grad.numel()]


_LOW_PRECISION = (torch.bfloat16, torch.float16)  # gradient dtypes whose norm torch sums in their own dtype


def _torch_path(tensors: list[Optional[torch.Tensor]], world: int) -> bool:
    """Whether torch's own single-process functions apply: one rank, plain tensors, none in
    bf16 or fp16 (torch sums those in their own dtype: 193.0 for a norm of 193.31, where many
    ranks sum in float32, so one process would clip otherwise than N)."""
    return world == 1 and not any(isinstance(t, DTensor) or (t is not None and t.dtype in _LOW_PRECISION) for t in tensors)


def _local_shards(tensors: list[Optional[torch.Tensor]], pg: Optional[dist.ProcessGroup], world: int,
                  what: str = "its gradient") -> list[tuple[torch.Tensor, int]]:
    """(this rank's local shard, number of ranks holding an identical copy of it) for every
    tensor that is not None (the parameters' .grad, or the parameters themselves; `what`
    names them in errors); the tensors' own storage, so in-place scaling sticks. A DTensor
    whose mesh holds a rank outside pg is a ValueError (read on the host, no collective):
    a group of the same size over other ranks summed other shards, another norm on each
    slice of ranks."""
    out = []
    inside: dict[int, bool] = {}  # id(mesh) -> whether its ranks lie in pg (many tensors share a mesh)
    group_ranks = None
    whole_world = pg is None or world == dist.get_world_size()  # every mesh lies in the world: nothing to read
    for i, t in enumerate(tensors):
        if t is None:
            continue
        if not isinstance(t, DTensor):
            out.append((t, world))  # a plain tensor: the same full tensor on every rank
            continue
        mesh = t.device_mesh
        if any(pl.is_partial() for pl in t.placements):
            raise ValueError(
                f"parameters[{i}]: {what} has a Partial placement {t.placements} (not yet reduced); "
                "reduce it (redistribute to Shard/Replicate) before taking the norm"
            )
        if mesh.size() > world or world % mesh.size():
            raise ValueError(f"parameters[{i}]: {what}'s mesh has {mesh.size()} ranks, which does not divide the {world} ranks of the group")
        if not whole_world and id(mesh) not in inside:
            group_ranks = set(dist.get_process_group_ranks(pg)) if group_ranks is None else group_ranks
            inside[id(mesh)] = set(mesh.mesh.flatten().tolist()) <= group_ranks
        if not whole_world and not inside[id(mesh)]:
            raise ValueError(f"parameters[{i}]: {what}'s mesh holds ranks {sorted(mesh.mesh.flatten().tolist())}, not all in the group's "
                             f"ranks {sorted(group_ranks)}: pass a group that holds every rank of the gradients' meshes (e.g. the world)")
        if mesh.get_coordinate() is None:
            continue  # this rank is outside the tensor's mesh and holds none of it
        replicas = world // mesh.size()  # the other slices of the world hold the same shard
        for dim, placement in enumerate(t.placements):
            if placement.is_replicate():
                replicas *= mesh.size(dim)
        out.append((t.to_local(), replicas))
    return out


_NORMED_IN_FLOAT32 = (torch.float32, torch.bfloat16, torch.float16)


def _tensor_norms(grads: list[torch.Tensor], p: float, foreach: Optional[bool]) -> list[torch.Tensor]:
    """The float32 p-norm of each tensor: torch._foreach_norm, or a loop when foreach=False.
    float64 and complex tensors (torch's norms refuse dtype=float32 for them) are normed in
    their own precision (|z| for complex values), then cast to float32."""
    if foreach is False or any(g.dtype not in _NORMED_IN_FLOAT32 for g in grads):
        return [torch.linalg.vector_norm(g, p, dtype=torch.float32) if g.dtype in _NORMED_IN_FLOAT32
                else torch.linalg.vector_norm(g, p).float() for g in grads]
    return list(torch._foreach_norm(grads, p, dtype=torch.float32))


def _max_keeping_nan(local: torch.Tensor, group) -> torch.Tensor:
    """The MAX over `group` of a 0-D float32 `local`, NaN where any rank's is NaN: gloo's MAX
    of NaN and a number gives either, by the ranks' order (a NaN on one rank's shard was
    lost, and the clip scaled the gradients by a finite factor). One collective of the value
    with NaN as 0 and a NaN flag."""
    packed = torch.stack([torch.where(local.isnan(), 0.0, local), local.isnan().float()])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    return torch.where(packed[1] > 0, float("nan"), packed[0])


def _distributed_norm(tensors: list[Optional[torch.Tensor]], p: float, pg: Optional[dist.ProcessGroup], world: int,
                      foreach: Optional[bool], pp: Optional[dist.ProcessGroup] = None, what: str = "its gradient") -> torch.Tensor:
    """The module docstring's algorithm over `tensors` (the .grad of each parameter, or the
    parameters; None is skipped); the collective only when the group has ranks to join;
    then over the pipeline group pp (the other stages' sums), when given."""
    shards = [(g, r) for g, r in _local_shards(tensors, pg, world, what) if g.numel() > 0]  # empty shards add 0
    if pg is None:
        device = shards[0][0].device if shards else torch.device("cpu")
    else:
        device = collective_device(pg, [g for g, _ in shards])
    by_replicas: dict[int, list[torch.Tensor]] = {}
    for g, replicas in shards:
        by_replicas.setdefault(replicas, []).append(g)

    if math.isinf(p):
        local = torch.zeros((), dtype=torch.float32, device=device)
        for grads in by_replicas.values():  # a copy changes no maximum: replicas do not matter
            norms = _tensor_norms(grads, p, foreach)
            local = torch.maximum(local, torch.stack([n.to(device) for n in norms]).max())
        if world > 1:
            local = _max_keeping_nan(local, pg)
        if pp is not None:
            local = _max_keeping_nan(local, pp)
        return local

    local = torch.zeros((), dtype=torch.float64, device=device)
    for replicas, grads in by_replicas.items():
        norms = _tensor_norms(grads, p, foreach)
        # each copy of a shard adds 1/replicas of it, so the world's sum counts it once
        local = local + torch.stack([n.to(device) for n in norms]).double().pow(p).sum() / replicas
    if world > 1:
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=pg)
    if pp is not None:
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=pp)
    return local.pow(1.0 / p).float()


def _pipeline_group(pp_group, group) -> Optional[dist.ProcessGroup]:
    """pp_group's process group (None when not given); with one, `group` must be the stage's."""
    if pp_group is None:
        return None
    if group is None:
        raise ValueError("group: with pp_group, pass the group of this pipeline stage's ranks (e.g. meshes.stage_mesh), "
                         "not the world: the parameters differ from stage to stage")
    return process_group(pp_group, "pp_group")


def grad_norm(
    parameters: Parameters,
    *,
    norm_type: float = 2.0,
    group: Optional[Group] = None,
    foreach: Optional[bool] = None,
    pp_group: Optional[Group] = None,
) -> torch.Tensor:
    """The p-norm of all the gradients together, on one process or over the ranks of `group`.

    One process (torch.distributed not initialised, or `group` of one rank) with plain-tensor
    gradients: torch.nn.utils.get_total_norm of the .grad tensors, bit for bit, cast to
    float32, unless one is bf16 or fp16 (then the rule below, in float32 and float64, as
    on many ranks); no collective. Otherwise one all_reduce over `group` (default: the world;
    every rank holding any of the gradients must be in it): SUM of sum_grads sum |local
    shard|^p / replicas for finite p, MAX of the local max |g| for p = inf (module
    docstring). Then every rank of the group must call it, with its own parameters (a rank
    holding no gradient still takes part); plain-tensor gradients are taken to be the same
    on every rank of the group.

    Parameters without a .grad, or with an empty one, are skipped (as if their gradient
    were zero); none at all gives 0. No host sync.

    Args:
        parameters: a tensor or an iterable of tensors (their .grad: tensor or DTensor).
        norm_type: p > 0 (any real number: numpy's scalars too), or float("inf").
        group: a ProcessGroup or 1-D DeviceMesh; None for the world (or no group at all
            without torch.distributed).
        foreach: torch._foreach kernels (None or True) or a loop over the tensors (False),
            as in torch.nn.utils.clip_grad_norm_.
        pp_group: pipeline parallelism: the ranks holding the other stages' parameters
            (meshes.pp_mesh). `group` is then this stage's ranks (meshes.stage_mesh), the
            parameters this stage's, and the stages' sums are added over pp_group (one
            more collective): every stage's parameters counted once. A parameter held by
            two stages (a tied embedding) must be passed by one of them only.
    Returns: 0-D float32 tensor on the gradients' device (the collective's under several
    ranks), identical on every rank.

    >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([3.0, 4.0])
    >>> grad_norm([w])
    tensor(5.)
    """
    p = _check_norm_type(norm_type)
    params = _as_param_list(parameters)
    pp = _pipeline_group(pp_group, group)
    pg, world = _group_and_size(group)
    grads = [q.grad for q in params]
    if pp is None and _torch_path(grads, world):
        return torch.nn.utils.get_total_norm([q.grad for q in _with_grads(params)], p, foreach=foreach).float()
    return _distributed_norm(grads, p, pg, world, foreach, pp)


@torch.no_grad()
def clip_grad_norm(
    parameters: Parameters,
    max_norm: float,
    *,
    norm_type: float = 2.0,
    group: Optional[Group] = None,
    foreach: Optional[bool] = None,
    pp_group: Optional[Group] = None,
    copies: Parameters = (),
    impl: str = "auto",
) -> torch.Tensor:
    """Clip the gradients' total norm to `max_norm` in place; return the pre-clip norm.

    The norm is grad_norm's (one collective over `group` under torch.distributed, every rank
    calls it; none on one process), then every local gradient (shard) is scaled by
    min(1, max_norm / (norm + 1e-6)). On one process with plain-tensor gradients, none of
    them bf16 or fp16, this is torch.nn.utils.clip_grad_norm_ itself (the same bits; the norm
    cast to float32).
    Parameters without a .grad, or with an empty one, are skipped. No host sync.

    Args: as grad_norm; max_norm: a positive real number (inf: no clipping, the gradients
        left as they are even when the norm is inf or NaN: grad_norm). copies:
        parameters whose gradients are scaled too but not counted in the norm: copies of
        parameters counted elsewhere (a pipeline's tied embedding on its last stage, whose
        gradient equals the first stage's); skipped in parameters where they also appear there, as param_norm and
        zero_grad_count skip them. impl: how the gradients are scaled (scale_): "auto" (one Triton launch
        per dtype on CUDA), "triton" or "torch"; the bits are the same. foreach=False
        scales them one by one.
    Returns: 0-D float32 tensor, the norm before clipping, identical on every rank.

    >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([3.0, 4.0])
    >>> clip_grad_norm([w], 1.0)
    tensor(5.)
    >>> w.grad
    tensor([0.6000, 0.8000])
    """
    max_norm = _check_max_norm(max_norm)
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    p = _check_norm_type(norm_type)
    copies = list({id(c): c for c in _as_param_list(copies)}.values())  # each scaled once
    params = _without_copies(_as_param_list(parameters), copies)  # a copy also given in parameters: not counted, scaled once
    if math.isinf(max_norm):  # no clipping: torch's factor inf / (inf + 1e-6) made an infinite gradient NaN
        return grad_norm(params, norm_type=p, group=group, foreach=foreach, pp_group=pp_group)
    pp = _pipeline_group(pp_group, group)
    pg, world = _group_and_size(group)
    grads = [q.grad for q in params]
    if pp is None and not copies and _torch_path(grads, world):
        counted = _with_grads(params)
        present = [q.grad for q in counted]
        if foreach is False or not present or not use_triton(impl, *present):
            return torch.nn.utils.clip_grad_norm_(counted, max_norm, norm_type=p, foreach=foreach).float()
        # torch's norm and factor, in its dtypes (torch.nn.utils.clip_grad_norm_), and its bits
        norm = torch.nn.utils.get_total_norm(present, p, foreach=foreach)
        scale_(present, torch.clamp(max_norm / (norm + _CLIP_EPS), max=1.0), impl=impl)
        return norm.float()
    norm = _distributed_norm(grads, p, pg, world, foreach, pp)
    coef = clip_factor(norm, max_norm)
    local = [g for g, _ in _local_shards(grads + [q.grad for q in copies], pg, world)]
    if foreach is False:
        for g in local:
            g.mul_(coef.to(g.device))
    else:
        scale_(local, coef, impl=impl)
    return norm


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The clipping's factor min(1, max_norm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_
    forms it (the same bits), for fmoe.optim.AdamW.step(grad_factor=...).

    Args: norm: 0-D tensor, the gradients' norm (grad_norm's); max_norm: a positive real
        number (inf: no clipping, a factor of 1 whatever the norm).
    Returns: 0-D float32 tensor on norm's device. No host sync.

    >>> clip_factor(torch.tensor(5.0), 1.0)
    tensor(0.2000)
    """
    max_norm = _check_max_norm(max_norm)
    check_float("norm", norm, 0, "[] (grad_norm's)")
    if math.isinf(max_norm):  # inf / (inf + 1e-6) is NaN
        return torch.ones((), dtype=torch.float32, device=norm.device)
    return (max_norm / (norm + _CLIP_EPS)).clamp(max=1.0).float()


def _without_copies(params: list[torch.Tensor], copies: list[torch.Tensor]) -> list[torch.Tensor]:
    """params less the tensors that are also in copies (by identity)."""
    skip = {id(c) for c in copies}
    return [p for p in params if id(p) not in skip]


@torch.no_grad()
def param_norm(
    parameters: Parameters,
    *,
    group: Optional[Group] = None,
    pp_group: Optional[Group] = None,
    copies: Parameters = (),
) -> torch.Tensor:
    """The 2-norm of all the parameters' values together, ||concat of all parameters||_2,
    on one process or over the ranks of `group`: grad_norm's rule applied to the values.

    Accumulated in float32 per tensor (bf16 weights included: not torch's get_total_norm,
    which would sum in bf16) and in float64 across tensors and ranks. One process: no
    collective. Otherwise one SUM all_reduce over `group` (every rank calls it, a rank
    holding nothing sends 0), each DTensor shard counted once (Replicate placements and the
    other slices of the world divide it by its copies, module docstring), plain tensors
    taken to be the same on every rank; then, with pp_group, one more over the pipeline
    stages. No host sync.

    Args: as clip_grad_norm. copies: parameters not counted (skipped where they also
        appear in `parameters`): the pipeline's tied-embedding copy, so that the same
        (counted, copies) as clip_grad_norm's can be passed.
    Returns: 0-D float32 tensor, identical on every rank.

    >>> param_norm([torch.nn.Parameter(torch.tensor([3.0, 4.0]))])
    tensor(5.)
    """
    params = _without_copies(_as_param_list(parameters), _as_param_list(copies))
    for i, p in enumerate(params):  # an integer buffer passed in: torch's "Expected a floating point" before
        if not (p.is_floating_point() or p.is_complex()):
            raise ValueError(f"parameters[{i}]: expected floating-point values, got {p.dtype}")
    pp = _pipeline_group(pp_group, group)
    pg, world = _group_and_size(group)
    return _distributed_norm(params, 2.0, pg, world, None, pp, what="its value")


@torch.no_grad()
def zero_grad_count(
    parameters: Parameters,
    *,
    group: Optional[Group] = None,
    pp_group: Optional[Group] = None,
    copies: Parameters = (),
) -> torch.Tensor:
    """The number of parameter elements whose gradient is exactly 0 (+0.0 or -0.0), each
    element of the whole model counted once; a parameter without a .grad counts all its
    elements (it got no gradient). It counts the embedding rows of tokens the step did not
    contain and the experts no token reached; a count that rises over training flags dead
    units or gradients underflowing to 0.

    Counted on each rank's local shards, weighted by world / replicas and summed by one
    all_reduce over `group` (module docstring: exact in int64), then over pp_group when
    given; every rank calls it. One process: no collective. No host sync.

    Args: as param_norm (copies are not counted).
    Returns: 0-D int64 tensor, identical on every rank.

    >>> w = torch.nn.Parameter(torch.ones(3)); w.grad = torch.tensor([0.0, 2.0, -0.0])
    >>> zero_grad_count([w, torch.nn.Parameter(torch.ones(2, 2))])
    tensor(6)
    """
    params = _without_copies(_as_param_list(parameters), _as_param_list(copies))
    pp = _pipeline_group(pp_group, group)
    pg, world = _group_and_size(group)
    grads = _local_shards([p.grad for p in params], pg, world, "its gradient")
    bare = _local_shards([p if p.grad is None else None for p in params], pg, world, "its value")
    if pg is None:
        device = grads[0][0].device if grads else bare[0][0].device if bare else torch.device("cpu")
    else:
        device = collective_device(pg, [t for t, _ in grads + bare])
    weighted = torch.zeros((), dtype=torch.int64, device=device)
    for g, replicas in grads:
        assert world % replicas == 0, (world, replicas)
        weighted = weighted + (g == 0).sum().to(device) * (world // replicas)
    for p, replicas in bare:
        assert world % replicas == 0, (world, replicas)
        weighted = weighted + p.numel() * (world // replicas)
    if world > 1:
        dist.all_reduce(weighted, op=dist.ReduceOp.SUM, group=pg)
    count = weighted // world  # every element was added world times over the ranks
    if pp is not None:
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=pp)
    return count


# ----------------------------------------------------------------------------------------
# Float32 accumulation
# ----------------------------------------------------------------------------------------


class Float32GradAccumulator:
    """Accumulate the gradients of the parameters whose name matches a pattern in float32.

    model:    its named_parameters() (requires_grad ones) are matched against
    patterns: regular expressions, re.search on the full name, so "router" matches
              "layers.3.moe.router.weight" anywhere in the name and "^head\\." only at the
              start; one string is one pattern. ValueError when nothing matches.

    Hooks (register_post_accumulate_grad_hook) add each micro-batch's .grad into a float32
    buffer in `main_grads` (name -> tensor, created by the first gradient after zero_grad)
    and set the parameter's .grad back to None, so bf16 never holds a sum. Other parameters
    are untouched. One step:

        acc = Float32GradAccumulator(model, patterns=("router",))
        for micro_batch in micro_batches:
            loss_fn(model, micro_batch).backward()
        acc.copy_to_grad()                 # float32 sums -> .grad, cast to the param's dtype
        clip_grad_norm(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(); acc.zero_grad()
        ...
        acc.remove()                       # back to plain autograd accumulation

    Call zero_grad before the next backward: a .grad left by copy_to_grad would be summed
    in again by the first hook.
    """

    def __init__(self, model: torch.nn.Module, patterns: Union[str, Iterable[str]] = ("router",)):
        if not isinstance(model, torch.nn.Module):  # a list of parameters: an AttributeError on named_parameters before
            raise ValueError(f"model: expected a torch.nn.Module (its named_parameters are matched), got {type(model).__name__}")
        try:
            patterns = [patterns] if isinstance(patterns, str) else list(patterns)
        except TypeError:  # patterns=3
            raise ValueError(f"patterns: expected a regular expression or an iterable of them, got {patterns!r}") from None
        try:
            if not all(isinstance(p, str) for p in patterns):  # a bytes pattern compiles, then fails on every name
                raise TypeError("not a string")
            regexes = [re.compile(p) for p in patterns]
        except (re.error, TypeError) as e:
            raise ValueError(f"patterns: expected regular expressions, got {patterns!r} ({e})") from None
        self.params = {
            name: p
            for name, p in model.named_parameters()
            if p.requires_grad and any(r.search(name) for r in regexes)
        }
        if not self.params:
            raise ValueError(f"patterns: {patterns!r} match no trainable parameter name of the model")
        self.main_grads: dict[str, torch.Tensor] = {}
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(name)) for name, p in self.params.items()]

    def _hook(self, name: str):
        def accumulate(param: torch.Tensor) -> None:
            if name in self.main_grads:
                self.main_grads[name].add_(param.grad)  # bf16 -> float32 in the add, exactly
            else:
                self.main_grads[name] = param.grad.to(torch.float32, copy=True)
            param.grad = None

        return accumulate

    def copy_to_grad(self) -> None:
        """Set each matched parameter's .grad to its float32 sum cast to the parameter's dtype
        (torch requires a .grad of the parameter's dtype, and its optimizers expect it); an
        optimizer that can use the float32 sums reads `main_grads` instead. A parameter that
        got no gradient since zero_grad keeps .grad None, so the optimizer skips it as usual."""
        for name, grad in self.main_grads.items():
            param = self.params[name]
            param.grad = grad.to(param.dtype, copy=True)

    def zero_grad(self) -> None:
        """Drop the float32 sums and the matched parameters' .grad (set to None)."""
        self.main_grads.clear()
        for param in self.params.values():
            param.grad = None

    def remove(self) -> None:
        """Remove the hooks; the matched parameters accumulate in their own dtype again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
