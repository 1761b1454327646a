"""Tensor parallelism (Megatron-style, on DTensor) for attention, dense MLPs and shared experts.

    parallelize_module(model, meshes.tp_mesh, tensor_parallel_plan(model))

A block's matrices are split over the tp ranks so that each rank computes a slice of the
heads (attention) or of the FFN columns (SwiGLU) and the output is a sum over ranks
(Megatron-LM, Shoeybi et al. 2019, section 3):

    attention   wq, wk, wv [H, heads*D]  Shard(1)  (whole heads; n_heads and n_kv_heads % tp == 0)
                wo [heads*D, H]          Shard(0)
    SwiGLU      w_gate, w_up [H, F]      Shard(1)
                w_down [F, H]            Shard(0)

The parameters become DTensors over the tp mesh (so FSDP2 composes with them and DCP can
reshard them); the module computes on their local shards. Between blocks activations are
plain tensors, identical on every tp rank, with complete gradients. At the input of a
parallel region `copy_to_tp` is the identity forward and sums the partial input gradients
over tp backward (Megatron's f); at its output `reduce_from_tp` sums the partial outputs
forward and is the identity backward (Megatron's g). Both are DTensor redistributions
(Replicate <-> Partial), no hand-written collective. The router, norms, embedding and
head stay replicated: they see the same tokens on every tp rank and compute the same.

Routed experts are not split here: their tokens are split over tp ranks by
fmoe.parallel.ExpertParallel (tp_mesh=) and their weights over ep / etp.

Legend: T tokens, H hidden, D head dim, F FFN size.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from fmoe.model import Attention, DenseMLP


def copy_to_tp(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; backward sums the gradient over the tp ranks (Megatron's f)."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def reduce_from_tp(y: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sum of the partial outputs over the tp ranks forward; identity backward (Megatron's g)."""
    return DTensor.from_local(y, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()


class _ShardedRegion(ParallelStyle):
    """Shard the named parameters of a module over the tp mesh (dim per name) and wrap its
    forward in copy_to_tp (first positional input) / reduce_from_tp (output)."""

    shard_dims: dict[str, int] = {}

    def _check(self, module: nn.Module, tp: int) -> None:
        for name, dim in self.shard_dims.items():
            size = getattr(module, name).shape[dim]
            if size % tp:
                raise ValueError(f"tp: {type(module).__name__}.{name} has {size} rows/cols on dim {dim}, not divisible by tp = {tp}")

    def _configure(self, module: nn.Module, tp: int) -> None:
        """Adjust the module's per-rank configuration (head counts)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        self._check(module, tp)
        for name, dim in self.shard_dims.items():
            param = getattr(module, name)
            if isinstance(param, DTensor):
                raise ValueError(f"module: {type(module).__name__}.{name} is already a DTensor (tensor-parallelised twice?)")
            sharded = distribute_tensor(param.data, device_mesh, [Shard(dim)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        self._configure(module, tp)
        module.register_forward_pre_hook(lambda m, args: (copy_to_tp(args[0], device_mesh), *args[1:]))
        module.register_forward_hook(lambda m, args, out: reduce_from_tp(out, device_mesh))
        return module


class AttentionParallel(_ShardedRegion):
    """Attention heads split over tp (n_heads and n_kv_heads divisible by tp)."""

    shard_dims = {"wq": 1, "wk": 1, "wv": 1, "wo": 0}

    def _check(self, module, tp):
        cfg = module.cfg
        if cfg.n_heads % tp or cfg.n_kv_heads % tp:
            raise ValueError(f"tp: n_heads = {cfg.n_heads} and n_kv_heads = {cfg.n_kv_heads} must both be divisible by tp = {tp}")

    def _configure(self, module, tp):
        module.cfg = dataclasses.replace(module.cfg, n_heads=module.cfg.n_heads // tp, n_kv_heads=module.cfg.n_kv_heads // tp)


class SwiGLUParallel(_ShardedRegion):
    """A dense SwiGLU (dense MLP or shared experts) split over its FFN columns."""

    shard_dims = {"w_gate": 1, "w_up": 1, "w_down": 0}


def tensor_parallel_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The parallelize_module plan for fmoe's reference model (or any module tree built from
    fmoe.model's Attention, DenseMLP and MoE): every attention, every dense MLP, and the
    shared experts of every MoE block. Routers and routed experts are left alone."""
    plan = {}
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            plan[name] = AttentionParallel()
        elif isinstance(module, DenseMLP):  # dense blocks' MLPs and MoE blocks' shared experts
            plan[name] = SwiGLUParallel()
    return plan
