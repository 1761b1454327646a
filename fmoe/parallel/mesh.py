"""Device meshes with MoE folding: the dense axes and the expert view over the same ranks.

    meshes = build_meshes(dp_shard=-1, tp=2, ep=4)   # under torchrun, after init_process_group

Ranks are laid out row-major, the last axis fastest. Three views of the same world:

    dense   (dp_replicate, dp_shard, cp, tp)   attention, dense MLPs, shared experts, router
    batch   (dp, cp, tp)                       dp = dp_replicate * dp_shard: the ranks that read
                                               different data (losses and logs sum over "dp")
    expert  (edp, ep, etp)                     routed experts; edp = world / (ep * etp)

MoE folding (Megatron-Core's "MoE parallel folding", torchtitan's expert mesh): expert
parallelism borrows its ranks from dp_shard x cp x tp, so ep * etp must divide
dp_shard * cp * tp, and expert TP (etp) is independent of the dense tp. A group of ep x etp
ranks then never crosses a dp_replicate boundary. The expert view is built only when the
model has experts. Axes of size 1 are kept (so code can name them) and cost nothing.

Pipeline parallelism adds the outermost axis pp: the world is pp stages of
dp_replicate * dp_shard * cp * tp ranks each, and the three views above are those of this
rank's stage (submeshes of (pp, ...) meshes over the whole world, so every rank creates
the same process groups); `pp_mesh` is the 1-D mesh of the ranks holding the other stages
with the same coordinates within theirs.

Legend: world = pp * dp_replicate * dp_shard * cp * tp; a stage's ranks = edp * ep * etp.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

DENSE_AXES = ("dp_replicate", "dp_shard", "cp", "tp")
EXPERT_AXES = ("edp", "ep", "etp")


def _positive(name: str, value, *, allow_fill: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not (value >= 1 or (allow_fill and value == -1)):
        extra = " or -1 (the rest of the world)" if allow_fill else ""
        raise ValueError(f"{name}: expected a positive int{extra}, got {value!r}")


def plan_sizes(
    world_size: int, *, dp_replicate: int = 1, dp_shard: int = -1, cp: int = 1, tp: int = 1, ep: int = 1, etp: int = 1,
    has_experts: bool = True, pp: int = 1,
) -> dict[str, int]:
    """The size of every axis for `world_size` ranks, checked; no process group needed.

    dp_shard=-1 takes what is left of the world after pp, dp_replicate, cp and tp. Raises
    a ValueError saying which product does not divide (or equal) which. edp, ep and etp
    divide one pipeline stage's ranks (world_size / pp).

    >>> plan_sizes(8, tp=2, ep=4)["edp"]
    2
    """
    _positive("world_size", world_size)
    for name, value in (("pp", pp), ("dp_replicate", dp_replicate), ("cp", cp), ("tp", tp), ("ep", ep), ("etp", etp)):
        _positive(name, value)
    _positive("dp_shard", dp_shard, allow_fill=True)
    if world_size % pp:
        raise ValueError(f"pp: {pp} pipeline stages do not divide the world size {world_size}")
    stage = world_size // pp
    others = dp_replicate * cp * tp
    if dp_shard == -1:
        if stage % others:
            raise ValueError(f"dp_shard=-1: dp_replicate * cp * tp = {others} does not divide the {stage} ranks of a pipeline stage "
                             f"(world size {world_size} / pp {pp})" if pp > 1 else
                             f"dp_shard=-1: dp_replicate * cp * tp = {others} does not divide the world size {world_size}")
        dp_shard = stage // others
    if others * dp_shard != stage:
        raise ValueError(f"pp * dp_replicate * dp_shard * cp * tp = {pp * others * dp_shard} does not equal the world size {world_size}"
                         if pp > 1 else f"dp_replicate * dp_shard * cp * tp = {others * dp_shard} does not equal the world size {world_size}")
    if not has_experts and ep * etp > 1:
        raise ValueError(f"ep / etp: expert parallelism ({ep} x {etp}) needs a model with experts")
    borrowed = dp_shard * cp * tp
    if borrowed % (ep * etp):
        raise ValueError(
            f"ep * etp = {ep * etp} does not divide dp_shard * cp * tp = {borrowed} "
            "(expert parallelism borrows its ranks from those axes)"
        )
    return dict(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, dp=dp_replicate * dp_shard,
                edp=stage // (ep * etp), ep=ep, etp=etp)


@dataclasses.dataclass(frozen=True)
class Meshes:
    """The three views of one world, or of this rank's pipeline stage (module docstring).
    `sizes` holds every axis size; `expert` is None for a model without experts; `pp_mesh`
    is the 1-D pipeline mesh (None without pipeline parallelism)."""

    dense: DeviceMesh
    batch: DeviceMesh
    expert: Optional[DeviceMesh]
    sizes: dict
    pp_mesh: Optional[DeviceMesh] = None

    def __getattr__(self, name):  # meshes.tp, meshes.ep, ... are the sizes
        sizes = self.__dict__.get("sizes", {})
        if name in sizes:
            return sizes[name]
        raise AttributeError(name)

    @functools.cached_property
    def dp_mesh(self) -> DeviceMesh:
        """(dp_replicate, dp_shard): FSDP2's mesh for dense parameters (HSDP when replicated)."""
        return self.dense["dp_replicate", "dp_shard"]

    @functools.cached_property
    def tp_mesh(self) -> DeviceMesh:
        return self.dense["tp"]

    @functools.cached_property
    def token_mesh(self) -> DeviceMesh:
        """(cp, tp) flattened to 1-D, "cp_tp": the ranks that split one micro-batch's tokens
        (the group of the sequence-level balancing loss and of the micro-batch's counts).
        Its local rank is cp_rank * tp + tp_rank. Built once, by build_meshes (slicing a mesh
        reads its rank table on the host)."""
        return self.dense["cp", "tp"]._flatten("cp_tp")

    @functools.cached_property
    def stage_mesh(self) -> DeviceMesh:
        """(dp, cp, tp) flattened to 1-D, "stage": every rank of this pipeline stage (the
        whole world without pipeline parallelism): the group over which the stage's
        parameters are sharded or replicated (e.g. the gradient norm's)."""
        return self.batch._flatten("stage")

    @property
    def pp_rank(self) -> int:
        """This rank's coordinate on the pipeline axis (0 without pipeline parallelism)."""
        return self.pp_mesh.get_local_rank() if self.pp_mesh is not None else 0

    def axis(self, name: str) -> DeviceMesh:
        """The 1-D mesh of one axis by name, from whichever view has it."""
        if name == "pp" and self.pp_mesh is not None:
            return self.pp_mesh
        for mesh in (self.dense, self.batch, self.expert):
            if mesh is not None and name in mesh.mesh_dim_names:
                return mesh[name]
        if name in EXPERT_AXES and self.expert is None:  # listed below as a name, which it is: say why it is missing here
            raise ValueError(f"name: {name!r} is an axis of the expert mesh, which these meshes lack (build_meshes(has_experts=False))")
        if name == "pp":
            raise ValueError("name: 'pp' is the pipeline mesh's axis, which these meshes lack (build_meshes(pp=1))")
        raise ValueError(f"name: expected one of {DENSE_AXES + ('dp',) + EXPERT_AXES + ('pp',)}, got {name!r}")

    def group(self, name: str) -> dist.ProcessGroup:
        """The process group of one axis (the ranks that differ only along it)."""
        return self.axis(name).get_group()


def build_meshes(
    *, dp_replicate: int = 1, dp_shard: int = -1, cp: int = 1, tp: int = 1, ep: int = 1, etp: int = 1,
    has_experts: bool = True, device_type: Optional[str] = None, pp: int = 1,
) -> Meshes:
    """The dense, batch and (with experts) expert meshes over the initialised world, or,
    with pp > 1, over this rank's pipeline stage (plus the pipeline mesh).

    Every rank must call it with the same arguments (it creates process groups).
    device_type: "cuda" or "cpu" (default: cuda when the backend is nccl, else cpu).
    """
    if device_type is not None:
        try:
            device = torch.device(device_type) if isinstance(device_type, str) else None
        except RuntimeError:
            device = None
        if device is None or device.index is not None or device.type == "meta":
            raise ValueError(f"device_type: expected a torch device type such as 'cuda' or 'cpu' (no index), got {device_type!r}")
    if not dist.is_initialized():
        raise ValueError("build_meshes: torch.distributed is not initialised (run under torchrun and call init_process_group)")
    backend = getattr(torch, device_type, None) if device_type not in (None, "cpu") else None
    if backend is not None and hasattr(backend, "is_available") and not backend.is_available():  # parallelize failed in torch's assert
        raise ValueError(f"device_type: {device_type!r} is not available in this process (torch.{device_type}.is_available() is False)")
    world = dist.get_world_size()
    sizes = plan_sizes(world, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep, etp=etp, has_experts=has_experts, pp=pp)
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    ranks = torch.arange(world)

    def view(names: tuple[str, ...], shape: tuple[int, ...]) -> DeviceMesh:
        # with pp > 1: a (pp, ...) mesh over the world, sliced to this rank's stage
        if pp == 1:
            return DeviceMesh(device_type, ranks.view(*shape), mesh_dim_names=names)
        return DeviceMesh(device_type, ranks.view(pp, *shape), mesh_dim_names=("pp", *names))[names]

    dense = view(DENSE_AXES, tuple(sizes[a] for a in DENSE_AXES))
    batch = view(("dp", "cp", "tp"), (sizes["dp"], sizes["cp"], sizes["tp"]))
    expert = view(EXPERT_AXES, tuple(sizes[a] for a in EXPERT_AXES)) if has_experts else None
    pp_mesh = DeviceMesh(device_type, ranks.view(pp, -1), mesh_dim_names=("pp", "stage_rank"))["pp"] if pp > 1 else None
    meshes = Meshes(dense=dense, batch=batch, expert=expert, sizes=sizes, pp_mesh=pp_mesh)
    # the flattened meshes' groups, made here by every rank in one order: a group's name counts the groups made before it,
    # so made later by some ranks only (the last pipeline stage's loss reads token_mesh), they would give every group made
    # after them another name on those ranks, and its first collective would wait forever
    meshes.token_mesh, meshes.stage_mesh
    return meshes


def leave_ranks(*, barrier: bool = True) -> None:
    """End this rank's process once its work is done and printed: wait for every rank
    (`barrier`), destroy every process group, flush stdout and stderr, and exit with status
    0 without the interpreter's teardown. Does not return.

    A gloo rank occasionally aborted in that teardown after a clean destroy_process_group
    ("terminate called without an active exception", SIGABRT), which torchrun and
    torch.multiprocessing report as the rank's failure. Call it on the success path only:
    an exception must still end the process with its traceback and a nonzero status.
    `barrier=False` for workers whose peers may have failed (a barrier would wait for them).
    """
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
