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

Legend: world = dp_replicate * dp_shard * cp * tp = edp * ep * etp.
"""

from __future__ import annotations

import dataclasses
import functools
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
    has_experts: bool = True,
) -> dict[str, int]:
    """The size of every axis for `world_size` ranks, checked; no process group needed.

    dp_shard=-1 takes what is left of the world after dp_replicate, cp and tp. Raises a
    ValueError saying which product does not divide (or equal) which.

    >>> plan_sizes(8, tp=2, ep=4)["edp"]
    2
    """
    _positive("world_size", world_size)
    for name, value in (("dp_replicate", dp_replicate), ("cp", cp), ("tp", tp), ("ep", ep), ("etp", etp)):
        _positive(name, value)
    _positive("dp_shard", dp_shard, allow_fill=True)
    others = dp_replicate * cp * tp
    if dp_shard == -1:
        if world_size % others:
            raise ValueError(f"dp_shard=-1: dp_replicate * cp * tp = {others} does not divide the world size {world_size}")
        dp_shard = world_size // others
    if others * dp_shard != world_size:
        raise ValueError(f"dp_replicate * dp_shard * cp * tp = {others * dp_shard} does not equal the world size {world_size}")
    if not has_experts and ep * etp > 1:
        raise ValueError(f"ep / etp: expert parallelism ({ep} x {etp}) needs a model with experts")
    borrowed = dp_shard * cp * tp
    if borrowed % (ep * etp):
        raise ValueError(
            f"ep * etp = {ep * etp} does not divide dp_shard * cp * tp = {borrowed} "
            "(expert parallelism borrows its ranks from those axes)"
        )
    return dict(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, dp=dp_replicate * dp_shard,
                edp=world_size // (ep * etp), ep=ep, etp=etp)


@dataclasses.dataclass(frozen=True)
class Meshes:
    """The three views of one world (module docstring). `sizes` holds every axis size;
    `expert` is None for a model without experts."""

    dense: DeviceMesh
    batch: DeviceMesh
    expert: Optional[DeviceMesh]
    sizes: dict

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
        Its local rank is cp_rank * tp + tp_rank. Built once (slicing a mesh reads its rank
        table on the host)."""
        return self.dense["cp", "tp"]._flatten("cp_tp")

    def axis(self, name: str) -> DeviceMesh:
        """The 1-D mesh of one axis by name, from whichever view has it."""
        for mesh in (self.dense, self.batch, self.expert):
            if mesh is not None and name in mesh.mesh_dim_names:
                return mesh[name]
        raise ValueError(f"name: expected one of {DENSE_AXES + ('dp',) + EXPERT_AXES}, got {name!r}")

    def group(self, name: str) -> dist.ProcessGroup:
        """The process group of one axis (the ranks that differ only along it)."""
        return self.axis(name).get_group()


def build_meshes(
    *, dp_replicate: int = 1, dp_shard: int = -1, cp: int = 1, tp: int = 1, ep: int = 1, etp: int = 1,
    has_experts: bool = True, device_type: Optional[str] = None,
) -> Meshes:
    """The dense, batch and (with experts) expert meshes over the initialised world.

    Every rank must call it with the same arguments (it creates process groups).
    device_type: "cuda" or "cpu" (default: cuda when the backend is nccl, else cpu).
    """
    if not dist.is_initialized():
        raise ValueError("build_meshes: torch.distributed is not initialised (run under torchrun and call init_process_group)")
    world = dist.get_world_size()
    sizes = plan_sizes(world, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep, etp=etp, has_experts=has_experts)
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    ranks = torch.arange(world)
    dense = DeviceMesh(device_type, ranks.view(*(sizes[a] for a in DENSE_AXES)), mesh_dim_names=DENSE_AXES)
    batch = DeviceMesh(device_type, ranks.view(sizes["dp"], sizes["cp"], sizes["tp"]), mesh_dim_names=("dp", "cp", "tp"))
    expert = None
    if has_experts:
        expert = DeviceMesh(device_type, ranks.view(*(sizes[a] for a in EXPERT_AXES)), mesh_dim_names=EXPERT_AXES)
    return Meshes(dense=dense, batch=batch, expert=expert, sizes=sizes)
