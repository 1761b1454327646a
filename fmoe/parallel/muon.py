"""Layer-wise distributed Muon: each matrix is orthogonalised on one rank, the update travels
back asynchronously.

The math is fmoe.optim.Muon's, unchanged (see fmoe/optim/muon.py for the references):

    M   <- mu M + G                               momentum buffer      (elementwise: on shards)
    D    = G + mu M   (nesterov)  or  M           update direction     (elementwise: on shards)
    O    = NS(D)                                  Newton-Schulz        (whole matrix: one rank)
    W   <- W (1 - lr wd) - lr s(m, n) O                                (elementwise: on shards)

Newton-Schulz needs the whole matrix, the other three lines do not. Parameters fall in two
kinds, decided from their DTensor placements at construction:

    owned   a DTensor sharded over a matrix dim (FSDP2's Shard(0) of a dense [in, out]
            weight, HSDP, a TP shard, FSDP2 over TP), a DTensor replicated over its whole
            mesh, or a plain tensor while torch.distributed is initialised (taken as
            replicated over the world, its gradient already identical on every rank):
            exactly one rank of the parameter's mesh, its OWNER, runs NS.
    local   a DTensor whose Shard placements (on mesh dims of size > 1) are all on leading
            (batch) dims: an expert stack [E, H, F] sharded over its experts by EP and/or
            FSDP over the expert data mesh (with etp = 1). Each local tensor holds whole
            matrices, so every rank runs Muon on its own experts ("experts over the expert
            data group"); no communication. Mesh dims over which such a stack is replicated
            compute the same update redundantly. Without torch.distributed (one process)
            every parameter is local.

Ownership (`owner_of`, `load_per_rank`): greedy by size, decided at construction without
communication. The owned matrices of each param group, largest numel first (ties in group
order), each go to the least-loaded rank of their mesh (ties: the first in the mesh's
row-major order; a plain tensor's mesh is the world), loads summing numel over the matrices
on the same ranks. There is one load table per set of ranks (a mesh's, in row-major
order): the ranks of a mesh all see the same matrices on it, in the same order, so they all
compute the same owners, even where meshes are slices that differ between ranks (the dp
groups of different tp ranks), which a table shared across meshes would not guarantee.
Within a table the least-loaded rank grows by at most the largest matrix each time, so
max load <= min load + the largest matrix; FSDP2's dp mesh, HSDP's 2-D one, build_meshes'
"dp" and the world of plain tensors share one table when they hold the same ranks.

Communication of one step (point-to-point on the default group: isend / irecv with
per-matrix tags; every message has its matching receive posted in the same step, so a rank
that owns nothing never blocks anyone):

    1. gather: every shard of the direction goes to the owner (one holder of each distinct
       block when a mesh dim replicates it); all of them are posted before any is waited on;
    2. the owner waits for its matrix's blocks, assembles D and runs NS on the whole matrix;
    3. scatter: the owner sends every other rank of the mesh its block of O (async); the
       receivers post their receive at once. A plain tensor is broadcast (async).

What overlaps with what: the gathers of all matrices are in flight while the local expert
updates run and while the owners run NS on earlier matrices; each matrix's scatter is posted
as soon as its NS is done and overlaps the NS of the following matrices and, after step()
returns, the caller's next forward up to the module that uses the matrix.

Why not DTensor.redistribute(async_op=True) (a Partial -> Shard reduce-scatter): with torch
2.13 on gloo, async functional collectives corrupt the heap now and then (abort or segfault
within a few hundred steps of a two-rank loop of gathers and reduce-scatters, with or without
uneven shards); plain c10d async ops with buffers held here do not. The blocks also let
only the owner receive the direction, where a redistribute to Replicate would send it to
every rank. The blocks come from DTensor's own layout rule (the local shape and offset of
every mesh coordinate); a layout whose local shards are not blocks of the matrix is refused
at construction.

Asynchrony contract: `step()` returns with the scatters of step t in flight; the momentum
buffers and the local (expert) parameters are already updated, the owned parameters are not
yet. A pending update (O's block with the lr, weight decay and scale of step t) is completed
and written into the parameter by whichever comes first:

    - `wait()` (all) or `wait(params)`: the explicit call;
    - with `model=`: a forward pre-hook, registered with prepend=True on the module that
      FSDP manages the parameter with (its nearest ancestor, itself included, that is an
      FSDPModule; else the module that holds the parameter; each of them for a parameter
      tied to several modules), so that the update lands just before FSDP's own pre-forward
      all-gathers the new shards; also model.state_dict() and
      model.load_state_dict() (pre-hooks), so DCP checkpoints see written parameters and a
      load is not overwritten by a late update;
    - the next `step()`, `state_dict()` and `load_state_dict()` of this optimizer.

Without `model=`, call `wait()` before reading the parameters (forward, eval, checkpoint).
With `model=` too, a read that is none of the above (`p.full_tensor()`, `param_norm`,
`replica_mismatches`, a copy of the weights) sees step t-1's values until `wait()`. With
FSDP2 explicit forward prefetch (set_modules_to_forward_prefetch) a module's shards can
be all-gathered before its own pre-hook runs: call `wait()` before the forward there. So do
torch's multi-stage pipeline schedules (interleaved_1f1b, looped_bfs: a stage's FSDP modules
unsharded ahead of its forward; the forward then read step t-1's weights): call `wait()`
after `step()` there (examples/train_moe.py does, with --pp_virtual > 1).

The momentum buffer of a DTensor parameter is a DTensor with the parameter's mesh and
placements (a DCP checkpoint reshards it like the parameter); of a plain tensor, a plain
tensor. A parameter's .grad must be None on all ranks of its mesh or on none (a rank that
skips a matrix would leave its messages unmatched: a hang).

Limitations: the owner's link carries a whole matrix in and out per step (as a gather and a
scatter would). A stack sharded over both a leading dim and a matrix dim (experts with
etp > 1) is gathered whole and orthogonalised whole by one owner, where a gather over etp
only and one owner per expert shard would do. The load of a matrix is its numel, not NS's
m n min(m, n) cost. Point-to-point sends on NCCL open a communicator per pair of ranks on
first use.

    opt = DistributedMuon(muon_params, lr=3e-4, weight_decay=0.1, model=model)
    for batch in batches:
        loss = loss_fn(model(batch))        # hooks write step t-1's updates just in time
        loss.backward()
        opt.step()                          # returns with the scatters in flight
        opt.zero_grad()
    opt.wait()                              # before evaluating or saving without hooks

Legend: m rows, n cols of one matrix; E experts, H hidden, F expert FFN size.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from fmoe.optim.adamw import check_ordered, check_saved_groups, check_state_shapes, split_names, with_names
from fmoe.optim.muon import apply_update, check_hyperparameters, momentum_direction, newton_schulz, own_buffers, shape_scale
from fmoe.ops.backend import local_tensor as _local

Block = tuple[slice, ...]  # a rank's shard of a matrix: one slice per dim of the full tensor


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _is_local(p: torch.Tensor) -> bool:
    """Whether every rank holds whole matrices of p and updates them itself (module docstring)."""
    if not isinstance(p, DTensor):
        return not _distributed()
    if p.device_mesh.size() == 1:
        return True
    # a Shard on a mesh dim of size 1 (etp = 1 in shard_experts' layout) splits nothing
    sizes = p.device_mesh.shape
    shard_dims = [pl.dim % p.ndim for pl, size in zip(p.placements, sizes) if size > 1 and getattr(pl, "dim", None) is not None]
    return bool(shard_dims) and all(d < p.ndim - 2 for d in shard_dims)


def _mesh_ranks(p: torch.Tensor) -> list[int]:
    """The global ranks of p's mesh in row-major order (the world for a plain tensor)."""
    if isinstance(p, DTensor):
        return p.device_mesh.mesh.flatten().tolist()
    return list(range(dist.get_world_size()))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Who sends what for one owned DTensor: every rank's block of the full matrix, and the
    ranks whose blocks the owner gathers (one holder per distinct block; the owner's own
    block when it holds it). tag: this matrix's message tags are 2 tag (gather) and
    2 tag + 1 (scatter)."""

    owner: int
    blocks: dict[int, Block]
    sources: dict[int, Block]
    tag: int


def _plan(p: DTensor, owner: int, tag: int) -> _Plan:
    """Blocks from DTensor's layout rule for every mesh coordinate; ValueError when the local
    shards are not blocks that tile the matrix (replicas aside)."""
    mesh, shape = p.device_mesh, tuple(p.shape)
    ranks = mesh.mesh
    blocks = {}
    for coordinate in itertools.product(*(range(size) for size in mesh.shape)):
        local_shape, offset = _compute_local_shape_and_global_offset(shape, tuple(mesh.shape), list(coordinate), p.placements)
        blocks[int(ranks[coordinate])] = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
    if not _tiles(blocks.values(), shape):
        raise ValueError(f"params: a DTensor whose local shards are not blocks of the matrix ({p.placements}) is not supported")
    me = dist.get_rank()
    assert tuple(s.stop - s.start for s in blocks[me]) == tuple(p.to_local().shape), (blocks[me], p.to_local().shape)
    sources, seen = {}, set()  # one sender per distinct non-empty block: the owner if it holds it, else the lowest rank
    for rank, block in sorted(blocks.items(), key=lambda item: (item[0] != owner, item[0])):
        key = tuple((s.start, s.stop) for s in block)
        if _numel(block) and key not in seen:
            seen.add(key)
            sources[rank] = block
    return _Plan(owner=owner, blocks=blocks, sources=sources, tag=tag)


def _numel(block: Block) -> int:
    return math.prod(s.stop - s.start for s in block)


def _tiles(blocks: Iterable[Block], shape: tuple[int, ...]) -> bool:
    """Whether the distinct non-empty blocks are the cells of a grid over `shape`: along
    every dim their intervals partition [0, size), and every combination occurs."""
    distinct = {tuple((s.start, s.stop) for s in block) for block in blocks if _numel(block)}
    if not distinct:
        return math.prod(shape) == 0
    cells = 1
    for d, size in enumerate(shape):
        intervals = sorted({block[d] for block in distinct})
        starts, stops = [a for a, _ in intervals], [b for _, b in intervals]
        if starts != [0] + stops[:-1] or stops[-1] != size:
            return False
        cells *= len(intervals)
    return len(distinct) == cells


@dataclasses.dataclass
class _Update:
    """O's block for one parameter with the hyperparameters of its step; pending while the
    messages in `works` are in flight (`keep` holds their buffers), written by apply()."""

    update: torch.Tensor  # O's block for this rank, a receive buffer until `works` complete
    lr: float
    weight_decay: float
    scale: float  # shape_scale(param.shape, group["scale"])
    works: list = dataclasses.field(default_factory=list)
    keep: list = dataclasses.field(default_factory=list)

    def apply(self, p: torch.Tensor) -> None:
        for work in self.works:
            work.wait()
        apply_update(_local(p), self.update, lr=self.lr, weight_decay=self.weight_decay, scale=self.scale)


class DistributedMuon(torch.optim.Optimizer):
    """Muon over sharded and replicated matrices, NS on one owner rank per matrix.

    Args:
        params: tensors, (name, tensor) pairs or param-group dicts (each group may override any keyword below),
            in a list (a set is a TypeError: its order differs between ranks): FSDP2/TP
            DTensors, expert stacks sharded over their leading dims, plain tensors.
        lr, momentum, nesterov, weight_decay, ns_steps, scale, ns_dtype: as fmoe.optim.Muon
            (the same update, per group; a schedule may change param_groups' lr between
            steps).
        model: the module the parameters belong to. When given, forward pre-hooks write
            each pending update just before its parameter's next use, and model.state_dict()
            / load_state_dict() complete all pending updates first (module docstring).

    Every rank must construct it (and add_param_group) with the same parameters in the same
    order, after the model is sharded (fully_shard, distribute_tensor): ownership and hooks
    are decided per group as it is added.
    `step()` leaves the owned matrices' updates in flight: see `wait()` and the module
    docstring. `owner_of(param)`, `load_per_rank` and `pending` expose the ownership and
    the work in flight; `remove_hooks()` undoes what `model=` registered.
    """

    def __init__(
        self, params, lr: float = 1e-3, momentum: float = 0.95, nesterov: bool = True, weight_decay: float = 0.0,
        *, ns_steps: int = 5, scale: str = "moonlight", ns_dtype: torch.dtype = torch.bfloat16,
        model: Optional[nn.Module] = None,
    ):
        self._owner: dict[torch.Tensor, Optional[int]] = {}  # param -> global rank, None: local
        self._plans: dict[torch.Tensor, _Plan] = {}  # owned DTensors
        self._load: dict[tuple[int, ...], dict[int, int]] = {}  # mesh ranks -> (rank -> numel owned)
        self._pending: dict[torch.Tensor, _Update] = {}
        self._sends: list = []  # (work, buffer) of the gathers' sends, waited by wait()
        self._hooks: list = []
        self._model = model  # add_param_group hooks each group's parameters on it
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, ns_steps=ns_steps, scale=scale, ns_dtype=ns_dtype,
        )
        check_ordered(params)  # a set's order differs between ranks: so would the owners
        super().__init__(params, defaults)
        if model is not None:
            self._hooks.append(model.register_state_dict_pre_hook(lambda *args: self.wait()))
            self._hooks.append(model.register_load_state_dict_pre_hook(lambda *args: self.wait()))

    # -- construction --------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        """Validates the group (as Muon does), then assigns each of its owned matrices to the
        least-loaded rank of its mesh, largest first (module docstring). With `model`, its
        parameters must be the model's (ValueError naming model) and its owned matrices get
        their forward pre-hooks, whether the group is the constructor's or added later."""
        group = {**self.defaults, **param_group}
        check_hyperparameters(group)
        check_ordered(group["params"])
        params, names = split_names(group["params"])
        for p in params:
            if not isinstance(p, torch.Tensor) or p.ndim < 2:
                raise ValueError(f"params: Muon takes matrices (ndim >= 2), got {getattr(p, 'shape', type(p).__name__)}; give it to AdamW")
            if not p.is_floating_point():  # as Muon: a complex gradient's imaginary part was dropped
                raise ValueError(f"params: expected floating-point parameters, got {p.dtype} (a parameter of shape {tuple(p.shape)})")
            if isinstance(p, DTensor) and any(pl.is_partial() for pl in p.placements):
                raise ValueError(f"params: a parameter cannot be a Partial DTensor, got placements {p.placements}")
            if p in self._owner or sum(q is p for q in params) > 1:
                raise ValueError(f"params: a parameter of shape {tuple(p.shape)} appears twice")
        managers = self._managers(params) if self._model is not None else {}  # before the load tables change
        owners = {}
        for p in sorted((p for p in params if not _is_local(p)), key=lambda p: -p.numel()):  # stable: ties keep group order
            ranks = tuple(_mesh_ranks(p))
            load = self._load.setdefault(ranks, {})
            owner = ranks[min(range(len(ranks)), key=lambda i: (load.get(ranks[i], 0), i))]
            load[owner] = load.get(owner, 0) + p.numel()
            owners[p] = owner
        plans = {p: _plan(p, owner, len(self._owner) + i) for i, (p, owner) in enumerate(owners.items()) if isinstance(p, DTensor)}
        super().add_param_group(with_names(param_group, params, names))
        self._owner.update({p: owners.get(p) for p in params})
        self._plans.update(plans)
        params_of: dict[nn.Module, list[torch.Tensor]] = {}
        for p, modules in managers.items():
            if owners.get(p) is not None:  # local parameters are written in step()
                for module in modules:
                    params_of.setdefault(module, []).append(p)
        for module, owned in params_of.items():
            self._hooks.append(module.register_forward_pre_hook(self._pre_forward_hook(owned), prepend=True))

    def _managers(self, params: list[torch.Tensor]) -> dict[torch.Tensor, list[nn.Module]]:
        """param -> the modules of self._model whose forward pre-hooks write its update: for
        each module holding it (a tied parameter has several, and the first to run need not be
        the first registered), its nearest FSDPModule ancestor, itself included, else itself."""
        modules = dict(self._model.named_modules(remove_duplicate=False))

        def manager(path: str) -> Optional[nn.Module]:  # the nearest FSDPModule ancestor, itself included
            while not isinstance(modules[path], FSDPModule) and path:
                path = path.rpartition(".")[0]
            return modules[path] if isinstance(modules[path], FSDPModule) else None

        wanted = {id(p) for p in params}
        manager_of = {}
        for name, module in modules.items():
            for p in module.parameters(recurse=False):
                if id(p) not in wanted:
                    continue
                holder, holders = manager(name) or module, manager_of.setdefault(p, [])
                if not any(m is holder for m in holders):
                    holders.append(holder)
        missing = [tuple(p.shape) for p in params if p not in manager_of]
        if missing:
            raise ValueError(f"model: parameters of shapes {missing} are not parameters of the model")
        return manager_of

    def _pre_forward_hook(self, params: list[torch.Tensor]) -> Callable:
        def hook(module, args):
            self.wait(params)

        return hook

    def remove_hooks(self) -> None:
        """Remove the hooks registered on `model` (pending updates then wait for wait());
        groups added later get none either."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._model = None

    # -- ownership -----------------------------------------------------------------------

    def owner_of(self, param: torch.Tensor) -> Optional[int]:
        """The global rank that runs NS for `param`, or None for a local parameter (each rank
        updates its own whole matrices)."""
        if param not in self._owner:
            raise ValueError(f"param: a tensor of shape {tuple(param.shape)} is not a parameter of this optimizer")
        return self._owner[param]

    @property
    def load_per_rank(self) -> dict[int, int]:
        """Global rank -> total numel of the matrices it owns among this rank's parameters
        (ranks owning none of them absent)."""
        load = {}
        for p, owner in self._owner.items():
            if owner is not None:
                load[owner] = load.get(owner, 0) + p.numel()
        return load

    @property
    def pending(self) -> list[torch.Tensor]:
        """The parameters whose update is in flight (written by wait() or a hook)."""
        return list(self._pending)

    # -- the step ------------------------------------------------------------------------

    @torch.no_grad()
    def wait(self, params: Optional[Iterable[torch.Tensor]] = None) -> None:
        """Complete the pending updates (all, or those of `params`) and write them into the
        parameters. Local work only: every message was posted by step()."""
        todo = list(self._pending) if params is None else [p for p in params if p in self._pending]
        for p in todo:
            self._pending.pop(p).apply(p)
        if params is None:
            for work, _ in self._sends:
                work.wait()
            self._sends = []

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        """Update every parameter with a gradient: local ones now, owned ones when waited on.
        Every group's hyperparameters are checked first (fmoe.optim.muon.check_hyperparameters),
        before the closure runs or anything changes. A sparse gradient: RuntimeError, as in
        Muon, before any parameter or momentum changes (the previous step's pending updates
        aside, written first)."""
        for group in self.param_groups:
            check_hyperparameters(group)
        self.wait()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if any(p.grad is not None and p.grad.is_sparse for group in self.param_groups for p in group["params"]):
            raise RuntimeError("Muon does not support sparse gradients")
        rank = dist.get_rank() if _distributed() else 0
        owned, local = [], []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                direction = self._direction(p, group)
                if self._owner[p] is None:
                    local.append((p, group, direction))
                else:  # 1. gather: post every message before waiting for any
                    owned.append((p, group, self._gather(p, direction, rank)))
        for p, group, direction in local:  # whole local matrices, while the gathers are in flight
            _Update(self._newton_schulz(direction, group), *self._hyper(p, group)).apply(p)
        for p, group, gathered in owned:
            # 2. NS on the owner only; 3. scatter O's blocks back (async)
            self._pending[p] = self._scatter(p, group, gathered, rank)
        return loss

    def _direction(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """Update p's momentum buffer and return the local shard of its direction."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)  # a DTensor laid out like p.grad
        return momentum_direction(_local(state["momentum_buffer"]), _local(p.grad), group["momentum"], group["nesterov"])

    def _gather(self, p: torch.Tensor, direction: torch.Tensor, rank: int):
        """Post the gather of p's direction: on the owner, (full D, [(work, buffer, block)]);
        elsewhere None (this rank's block, if it is a source, is sent)."""
        if not isinstance(p, DTensor):  # replicated: the owner already holds D
            return (direction, []) if self._owner[p] == rank else None
        plan = self._plans[p]
        if rank != plan.owner:
            if rank in plan.sources:
                buffer = direction.contiguous()
                self._sends.append((dist.isend(buffer, dst=plan.owner, tag=2 * plan.tag), buffer))
            return None
        full = direction.new_empty(p.shape)
        receives = []
        for source, block in plan.sources.items():
            if source == rank:
                full[block] = direction
            else:
                buffer = direction.new_empty([s.stop - s.start for s in block])
                receives.append((dist.irecv(buffer, src=source, tag=2 * plan.tag), buffer, block))
        return full, receives

    def _scatter(self, p: torch.Tensor, group: dict, gathered, rank: int) -> _Update:
        """NS on the owner, then post the messages that bring each rank its block of O."""
        hyper = self._hyper(p, group)
        owner = self._owner[p]
        if rank == owner:
            full, receives = gathered
            for work, buffer, block in receives:
                work.wait()
                full[block] = buffer
            update = self._newton_schulz(full, group)
        if not isinstance(p, DTensor):
            if rank != owner:
                update = _local(p.grad).new_empty(p.shape)
            return _Update(update, *hyper, works=[dist.broadcast(update, src=owner, async_op=True)])
        plan = self._plans[p]
        if rank != owner:
            buffer = _local(p.grad).new_empty([s.stop - s.start for s in plan.blocks[rank]])
            works = [dist.irecv(buffer, src=owner, tag=2 * plan.tag + 1)] if buffer.numel() else []
            return _Update(buffer, *hyper, works=works)
        works, keep = [], []
        for dst, block in plan.blocks.items():
            if dst != rank and _numel(block):
                keep.append(update[block].contiguous())
                works.append(dist.isend(keep[-1], dst=dst, tag=2 * plan.tag + 1))
        return _Update(update[plan.blocks[rank]], *hyper, works=works, keep=keep)

    def _newton_schulz(self, direction: torch.Tensor, group: dict) -> torch.Tensor:
        return newton_schulz(direction, steps=group["ns_steps"], dtype=group["ns_dtype"])

    @staticmethod
    def _hyper(p: torch.Tensor, group: dict) -> tuple[float, float, float]:
        return group["lr"], group["weight_decay"], shape_scale(p.shape, group["scale"])

    # -- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Completes the pending updates, then torch's state dict (momentum buffers are
        DTensors laid out like their parameters)."""
        self.wait()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Completes the pending updates (so they cannot land on loaded values), then loads.
        A momentum buffer of another shape than its parameter (global shape for DTensors) is
        a ValueError naming the parameter's index, as in Muon, and so is a saved group that
        step() would refuse (check_hyperparameters)."""
        self.wait()
        check_saved_groups(state_dict, check_hyperparameters)
        check_state_shapes(self.param_groups, state_dict, {"momentum_buffer": lambda p: p.shape})
        super().load_state_dict(state_dict)
        own_buffers(self.state)
