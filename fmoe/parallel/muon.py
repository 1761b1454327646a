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
            weight, a TP shard, both on a 2-D mesh), a DTensor replicated over its whole
            mesh, or a plain tensor while torch.distributed is initialised (taken as
            replicated over the world, its gradient already identical on every rank):
            exactly one rank of the parameter's mesh, its OWNER, runs NS.
    local   a DTensor whose Shard placements (on mesh dims of size > 1) are all on leading
            (batch) dims: an expert stack [E, H, F] sharded over its experts by EP and/or
            FSDP over the expert data mesh (with etp = 1). Each local tensor holds whole matrices, so every rank runs Muon on its own
            experts ("experts over the expert data group"); no communication. Mesh dims on
            which such a stack is replicated compute the same update redundantly. A plain
            tensor without torch.distributed (one process) is local too.

Ownership (`owner_of`, `load_per_rank`): greedy by size, deterministic and identical on
every rank. The parameters of each param group, largest numel first (ties in group order),
each go to the least-loaded rank of their mesh (ties: the lowest global rank); loads are the
summed numel per global rank over all groups and meshes. The least-loaded rank grows by at
most the largest matrix each time, so over one mesh max load <= min load + largest matrix.

Communication of one step, for each owned matrix (all ranks issue the same collectives in
the same order, so a rank that owns nothing still takes part in every one):

    1. gather: the local direction shard becomes a DTensor laid out like the parameter and is
       redistributed to Replicate on every mesh dim (all-gather; async), for every owned
       matrix before any is waited on;
    2. the owner waits for its gathered direction and runs NS on the whole matrix; the other
       ranks wait too and hold zeros of the same shape;
    3. scatter back: a DTensor with Partial() on every mesh dim (O on the owner, zeros
       elsewhere) is redistributed to the parameter's placements (reduce-scatter, or
       all-reduce over replicated dims) with async_op=True; a plain tensor is broadcast
       from its owner with async_op=True. The sum of O and zeros is exactly O.

What overlaps with what: the gathers of all matrices are in flight while the local expert
updates run and while NS runs on earlier matrices; each matrix's scatter is issued as soon
as its NS is done and overlaps the NS of the following matrices and, after step() returns,
the caller's next forward up to the module that uses the matrix.

Asynchrony contract: `step()` returns with the scatters of step t in flight; the momentum
buffers and the local (expert) parameters are already updated, the owned parameters are not
yet. A pending update (O with the lr, weight decay and scale of step t) is completed and
written into the parameter by whichever comes first:

    - `wait()` (all) or `wait(params)`: the explicit call;
    - with `model=`: a forward pre-hook, registered with prepend=True on the module that
      FSDP manages the parameter with (its nearest ancestor, itself included, that is an
      FSDPModule; else the module that holds the parameter), so that the update lands just
      before FSDP's own pre-forward all-gathers the new shards; also model.state_dict() and
      model.load_state_dict() (pre-hooks), so DCP checkpoints see written parameters;
    - the next `step()`, `state_dict()` and `load_state_dict()` of this optimizer.

Without `model=`, call `wait()` before reading the parameters (forward, eval, checkpoint).
With FSDP2 explicit forward prefetch (set_modules_to_forward_prefetch) a module's shards can
be all-gathered before its own pre-hook runs: call `wait()` before the forward there.

The momentum buffer of a DTensor parameter is a DTensor with the parameter's mesh and
placements (a DCP checkpoint reshards it like the parameter); of a plain tensor, a plain
tensor. A parameter's .grad must be None on all ranks of its mesh or on none (a rank that
skips a matrix would skip its collectives: a hang).

Limitations: the gather is an all-gather, so every rank of the mesh receives the full
direction although only the owner needs it (a gather to the owner would save that
bandwidth and memory), and the scatter is a reduce-scatter of a matrix that is zero except
on the owner (a scatter from the owner would send less). A stack sharded over both a leading
dim and a matrix dim (experts with etp > 1) is gathered whole over its mesh and
orthogonalised whole by one owner, where gathering over etp only and one owner per expert
shard would do. The load of a
matrix is its numel, not NS's m n min(m, n) cost.

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
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Partial, Replicate

from fmoe.optim.muon import SCALES, newton_schulz, shape_scale


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def _ready(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind the result of an async collective, once it has arrived."""
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def _is_local(p: torch.Tensor) -> bool:
    """Whether every rank holds whole matrices of p and updates them itself (module docstring)."""
    if not isinstance(p, DTensor):
        return not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1
    if p.device_mesh.size() == 1:
        return True
    # a Shard on a mesh dim of size 1 (etp = 1 in shard_experts' layout) splits nothing
    shard_dims = [pl.dim % p.ndim for pl, size in zip(p.placements, p.device_mesh.shape) if size > 1 and getattr(pl, "dim", None) is not None]
    return bool(shard_dims) and all(d < p.ndim - 2 for d in shard_dims)


def _candidates(p: torch.Tensor) -> list[int]:
    """The global ranks that may own p: its mesh's, or the world's for a plain tensor."""
    if isinstance(p, DTensor):
        return p.device_mesh.mesh.flatten().tolist()
    return list(range(dist.get_world_size()))


@dataclasses.dataclass
class _Update:
    """O for one parameter with the hyperparameters of its step; pending while O (the result
    of an async collective) is in flight, written into the parameter by apply()."""

    update: torch.Tensor  # the local shard of O, possibly an AsyncCollectiveTensor
    work: Optional[dist.Work]  # a broadcast's handle (plain tensors), else None
    lr: float
    weight_decay: float
    scale: float  # shape_scale(param.shape, group["scale"])

    def apply(self, p: torch.Tensor) -> None:
        if self.work is not None:
            self.work.wait()
        update, w = _ready(self.update), _local(p)
        if self.weight_decay:
            w.mul_(1 - self.lr * self.weight_decay)
        w.add_(update.to(w.dtype), alpha=-self.lr * self.scale)


class DistributedMuon(torch.optim.Optimizer):
    """Muon over sharded and replicated matrices, NS on one owner rank per matrix.

    Args:
        params: tensors or param-group dicts (each group may override any keyword below):
            FSDP2/TP DTensors, expert stacks sharded over their leading dims, plain tensors.
        lr, momentum, nesterov, weight_decay, ns_steps, scale, ns_dtype: as fmoe.optim.Muon
            (the same update, per group; a schedule may change param_groups' lr between
            steps).
        model: the module the parameters belong to. When given, forward pre-hooks write
            each pending update just before its parameter's next use, and model.state_dict()
            / load_state_dict() complete all pending updates first (module docstring).

    Every rank must construct it with the same parameters in the same order, after the
    model is sharded (fully_shard, distribute_tensor): ownership and hooks are decided here.
    `step()` leaves the owned matrices' updates in flight: see `wait()` and the module
    docstring. `owner_of(param)`, `load_per_rank` and `pending` expose the ownership and
    the work in flight; `remove_hooks()` undoes what `model=` registered.
    """

    def __init__(
        self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True, weight_decay: float = 0.0,
        *, ns_steps: int = 5, scale: str = "moonlight", ns_dtype: torch.dtype = torch.bfloat16,
        model: Optional[nn.Module] = None,
    ):
        self._owner: dict[torch.Tensor, Optional[int]] = {}  # param -> global rank, None: local
        self._load: dict[int, int] = {}  # global rank -> numel owned
        self._pending: dict[torch.Tensor, _Update] = {}
        self._hooks: list = []
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, ns_steps=ns_steps, scale=scale, ns_dtype=ns_dtype,
        )
        super().__init__(params, defaults)
        if model is not None:
            self._register_hooks(model)

    # -- construction --------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        """Validates the group (as Muon does), then assigns each of its owned matrices to the
        least-loaded rank of its mesh, largest first."""
        group = {**self.defaults, **param_group}
        if group["lr"] < 0:
            raise ValueError(f"lr: expected >= 0, got {group['lr']}")
        if not 0 <= group["momentum"] < 1:
            raise ValueError(f"momentum: expected in [0, 1), got {group['momentum']}")
        if group["weight_decay"] < 0:
            raise ValueError(f"weight_decay: expected >= 0, got {group['weight_decay']}")
        if group["ns_steps"] < 1:
            raise ValueError(f"ns_steps: expected >= 1, got {group['ns_steps']}")
        if group["scale"] not in SCALES:
            raise ValueError(f"scale: expected one of {SCALES}, got {group['scale']!r}")
        params = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
        for p in params:
            if not isinstance(p, torch.Tensor) or p.ndim < 2:
                raise ValueError(f"params: Muon takes matrices (ndim >= 2), got {getattr(p, 'shape', type(p).__name__)}; give it to AdamW")
            if isinstance(p, DTensor) and any(pl.is_partial() for pl in p.placements):
                raise ValueError(f"params: a parameter cannot be a Partial DTensor, got placements {p.placements}")
            if p in self._owner or sum(q is p for q in params) > 1:
                raise ValueError(f"params: a parameter of shape {tuple(p.shape)} appears twice")
        super().add_param_group({**param_group, "params": params})
        owned = [p for p in params if not _is_local(p)]
        for p in params:
            self._owner[p] = None
        for p in sorted(owned, key=lambda p: -p.numel()):  # sorted() is stable: ties keep group order
            owner = min(_candidates(p), key=lambda r: (self._load.get(r, 0), r))
            self._owner[p] = owner
            self._load[owner] = self._load.get(owner, 0) + p.numel()

    def _register_hooks(self, model: nn.Module) -> None:
        modules = dict(model.named_modules(remove_duplicate=False))

        def manager(path: str) -> nn.Module:  # the nearest FSDPModule ancestor, itself included
            while not isinstance(modules[path], FSDPModule) and path:
                path = path.rpartition(".")[0]
            return modules[path] if isinstance(modules[path], FSDPModule) else None

        manager_of = {}  # param -> the module whose forward pre-hook writes its update
        for name, module in modules.items():
            for p in module.parameters(recurse=False):
                if p in self._owner and p not in manager_of:
                    manager_of[p] = manager(name) or module
        missing = [tuple(p.shape) for p in self._owner if p not in manager_of]
        if missing:
            raise ValueError(f"model: parameters of shapes {missing} are not parameters of the model")
        params_of: dict[nn.Module, list[torch.Tensor]] = {}
        for p, manager in manager_of.items():
            if self._owner[p] is not None:  # local parameters are written in step()
                params_of.setdefault(manager, []).append(p)
        for manager, params in params_of.items():
            self._hooks.append(manager.register_forward_pre_hook(self._pre_forward_hook(params), prepend=True))
        self._hooks.append(model.register_state_dict_pre_hook(lambda *args: self.wait()))
        self._hooks.append(model.register_load_state_dict_pre_hook(lambda *args: self.wait()))

    def _pre_forward_hook(self, params: list[torch.Tensor]) -> Callable:
        def hook(module, args):
            self.wait(params)

        return hook

    def remove_hooks(self) -> None:
        """Remove the hooks registered on `model` (pending updates then wait for wait())."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # -- ownership -----------------------------------------------------------------------

    def owner_of(self, param: torch.Tensor) -> Optional[int]:
        """The global rank that runs NS for `param`, or None for a local parameter (each rank
        updates its own whole matrices)."""
        if param not in self._owner:
            raise ValueError(f"param: a tensor of shape {tuple(param.shape)} is not a parameter of this optimizer")
        return self._owner[param]

    @property
    def load_per_rank(self) -> dict[int, int]:
        """Global rank -> total numel of the matrices it owns (ranks owning nothing absent)."""
        return dict(self._load)

    @property
    def pending(self) -> list[torch.Tensor]:
        """The parameters whose update is in flight (written by wait() or a hook)."""
        return list(self._pending)

    # -- the step ------------------------------------------------------------------------

    @torch.no_grad()
    def wait(self, params: Optional[Iterable[torch.Tensor]] = None) -> None:
        """Complete the pending updates (all, or those of `params`) and write them into the
        parameters. Local work only: every collective was issued by step()."""
        todo = list(self._pending) if params is None else [p for p in params if p in self._pending]
        for p in todo:
            self._pending.pop(p).apply(p)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        """Update every parameter with a gradient: local ones now, owned ones when waited on."""
        self.wait()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        gathered, local = [], []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                direction = self._direction(p, group)
                if self._owner[p] is None:
                    local.append((p, group, direction))
                elif isinstance(p, DTensor):  # 1. gather the whole direction (all-gather, async)
                    d = DTensor.from_local(direction, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
                    gathered.append((p, group, d.redistribute(p.device_mesh, [Replicate()] * p.device_mesh.ndim, async_op=True).to_local()))
                else:
                    gathered.append((p, group, direction))
        for p, group, direction in local:  # whole local matrices, while the gathers are in flight
            _Update(self._newton_schulz(direction, group), None, *self._hyper(p, group)).apply(p)
        for p, group, direction in gathered:
            direction = _ready(direction)
            owner = self._owner[p]
            # 2. NS on the owner only; 3. scatter O back to every rank's layout (async)
            update = self._newton_schulz(direction, group) if owner == rank else torch.zeros_like(direction)
            work = None
            if isinstance(p, DTensor):
                mesh = p.device_mesh
                partial = DTensor.from_local(update, mesh, [Partial()] * mesh.ndim, run_check=False, shape=p.shape, stride=p.stride())
                update = partial.redistribute(mesh, p.placements, async_op=True).to_local()
            else:
                work = dist.broadcast(update, src=owner, async_op=True)
            self._pending[p] = _Update(update, work, *self._hyper(p, group))
        return loss

    def _direction(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """Update p's momentum buffer and return the local shard of its direction."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)  # a DTensor laid out like p.grad
        g, buf, mu = _local(p.grad), _local(state["momentum_buffer"]), group["momentum"]
        buf.mul_(mu).add_(g)
        return g.add(buf, alpha=mu) if group["nesterov"] else buf

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
        """Completes the pending updates (so they cannot land on loaded values), then loads."""
        self.wait()
        super().load_state_dict(state_dict)
