"""Cross-replica consistency: do the ranks that should hold the same values still hold them?

    bad = replica_mismatches(model)                                   # [] when all agree
    bad = replica_mismatches(pipe.chunks, group=meshes.stage_mesh)    # pipeline: one stage's ranks

Data-parallel replicas (HSDP's dp_replicate), the tp ranks' copies of the norms and the
router, the expert_bias buffers every rank updates from the same all-reduced counts: all of
them are meant to stay bit for bit identical, and nothing in a training step checks it. A
rank that diverges (a missed collective, a non-deterministic kernel on one replica, silent
data corruption) trains on quietly until the losses drift. This check compares them.

Which ranks should agree on a tensor. Rank q's local values of a tensor are determined by
its coordinate on the mesh dims that split the tensor (Shard placements):

    DTensor       slot = q's coordinates on the mesh dims whose placement is not Replicate
                  (mixed radix); ranks with the same slot hold the same shard: along the
                  Replicate dims of the mesh, and in the other slices of the world when the
                  mesh is a slice of it (the norms of a tp run live on the dp_shard mesh of
                  each tp coordinate: the tp ranks hold identical shards), the rule of
                  fmoe.optim.grad_norm's `replicas`
    plain tensor  slot 0 on every rank of `group` (a replicated parameter or buffer)
    a rank outside a DTensor's mesh holds none of it (no slot)

Each rank hashes the bits of its local values of every parameter and floating-point buffer
(bits_hash); one all_gather over `group` brings every rank's (slot, hash) pairs to every
rank, and a tensor mismatches when two ranks with the same slot hold different hashes.
Every rank computes the answer from the same gathered table, so every rank returns the same
names (and all can stop together). The table is world x tensors x 2 int64 (16 MB for 1024
ranks and 1000 tensors): a check to run every few hundred steps, not every step.

The hash: the local values' bits read as integers (float32 as int32, bf16 as int16, ...)
x_i, sign-extended to int64, combined as sum_i w_i x_i modulo 2^64 (torch's int64 products
and sums wrap around in two's complement on CPU and CUDA), with odd position weights
w_i = (i * 0x9E3779B97F4A7C15 + c) | 1 (a Weyl sequence: distinct for distinct i, odd).
Any change of one element changes the hash for sure: its x changes by d != 0 with
|d| < 2^64, and w d != 0 modulo 2^64 for odd w (a flipped lowest bit is d = 1). Changes of
several elements collide with probability about 2^-64. Exact and deterministic: integer
arithmetic, no floating-point summation order.

Call it between steps (after optimizer.step(), with FSDP2's parameters resharded), with the
same modules on every rank of `group`: it is a collective.

Legend: W ranks of the group, n tensors checked.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fmoe.optim.grads import collective_device, process_group

# the integer dtype whose bits a float of each element size is read as
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# 2^64 / golden ratio, odd (0x9E3779B97F4A7C15), as a signed int64; and an offset so that
# position 0 does not get weight 1
_WEYL = 0x9E3779B97F4A7C15 - 2**64
_OFFSET = 0x632BE59BD9B4E019
# elements hashed per chunk: the int64 copies and weights of a chunk take 2 x 32 MiB
_CHUNK = 1 << 22


def bits_hash(t: torch.Tensor) -> torch.Tensor:
    """A 0-D int64 hash of t's bits (module docstring): equal for bit-identical tensors of
    one shape and dtype, different when any single element differs in any bit. A DTensor
    hashes its local shard. No host sync; chunks of 4M elements bound the extra memory.

    >>> a = torch.tensor([1.0, 2.0]); b = a.clone(); b.view(torch.int32)[1] ^= 1
    >>> bool(bits_hash(a) == bits_hash(a.clone())), bool(bits_hash(a) == bits_hash(b))
    (True, False)
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"t: expected a tensor, got {type(t).__name__}")
    local = t.to_local() if isinstance(t, DTensor) else t
    flat = local.detach().reshape(-1)
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    bits = flat.view(_INT_OF_SIZE[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), _CHUNK):
        x = bits[start : start + _CHUNK].to(torch.int64)
        position = torch.arange(start, start + x.numel(), dtype=torch.int64, device=flat.device)
        weights = (position * _WEYL + _OFFSET) | 1
        total = total + (x * weights).sum()
    return total


def _checked_tensors(modules) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter and floating-point buffer, in model order (module by
    module, each module's own parameters then buffers), each tensor once."""
    if isinstance(modules, nn.Module):
        modules = [modules]
    try:
        modules = list(modules)
    except TypeError:
        raise ValueError(f"modules: expected an nn.Module or an iterable of them, got {type(modules).__name__}") from None
    out, seen = [], set()
    for i, root in enumerate(modules):
        if not isinstance(root, nn.Module):
            raise ValueError(f"modules[{i}]: expected an nn.Module, got {type(root).__name__}")
        for prefix, module in root.named_modules():
            own = list(module.named_parameters(prefix=prefix, recurse=False))
            own += [(n, b) for n, b in module.named_buffers(prefix=prefix, recurse=False) if b.is_floating_point()]
            for name, t in own:
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append((name, t))
    return out


def _slot(name: str, t: torch.Tensor, world: int) -> int:
    """Which copy of t this rank holds (module docstring): -1 for none."""
    if not isinstance(t, DTensor):
        return 0
    mesh = t.device_mesh
    if any(p.is_partial() for p in t.placements):
        raise ValueError(f"modules: {name} has a Partial placement {t.placements}: its local values are not the tensor's")
    if mesh.size() > world or world % mesh.size():
        raise ValueError(f"group: {name}'s mesh has {mesh.size()} ranks, which does not divide the {world} ranks of the group")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return -1
    slot = 0
    for dim, placement in enumerate(t.placements):
        if not placement.is_replicate():
            slot = slot * mesh.size(dim) + coordinate[dim]
    return slot


def replica_mismatches(
    modules: Union[nn.Module, Iterable[nn.Module]],
    *,
    group=None,
    max_names: int = 8,
) -> list[str]:
    """The names of the parameters and floating-point buffers whose local values differ
    between ranks that should hold the same values (module docstring), in model order, at
    most max_names; [] when every replica agrees. Identical on every rank of the group.

    Args:
        modules: the model, or a list of modules (a pipeline rank's chunks); the same
            structure on every rank of `group`.
        group: a ProcessGroup or 1-D DeviceMesh of the ranks holding these modules
            (meshes.stage_mesh under pipeline parallelism); None: the world.
        max_names: the most names returned (>= 1).
    Returns: a list of names (str). One process (torch.distributed not initialised, or a
    group of one rank): [] without any communication. Otherwise one all_gather over the
    group and one host read of its result.

    Every rank of `group` must call it (a collective), between steps.
    """
    if isinstance(max_names, bool) or not isinstance(max_names, int) or max_names < 1:
        raise ValueError(f"max_names: expected an int >= 1, got {max_names!r}")
    tensors = _checked_tensors(modules)
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return []
        pg = dist.group.WORLD
    else:
        pg = process_group(group)
    world = dist.get_world_size(pg)
    if world == 1:
        return []
    slots = [_slot(name, t, world) for name, t in tensors]
    locals_ = [t.to_local() if isinstance(t, DTensor) else t for _, t in tensors]
    device = collective_device(pg, locals_)
    hashes = [bits_hash(t).to(device) for t in locals_]
    rows = torch.stack([torch.tensor(slots, dtype=torch.int64, device=device),
                        torch.stack(hashes) if hashes else torch.zeros(0, dtype=torch.int64, device=device)], dim=1)  # [n, 2]
    gathered = [torch.empty_like(rows) for _ in range(world)]
    dist.all_gather(gathered, rows, group=pg)
    table = torch.stack(gathered)  # [W, n, 2]: every rank's (slot, hash) of every tensor
    n = len(tensors)
    slot_Wn, hash_Wn = table[..., 0], table[..., 1]
    # one key per (tensor, slot); the smallest and largest hash under each key differ
    # exactly when two ranks holding that copy disagree
    width = int(world) + 1  # slots are < world (a mesh within the group), -1 is "none"
    key_Wn = torch.arange(n, device=device) * width + slot_Wn + 1
    held = slot_Wn >= 0
    keys, values = key_Wn[held], hash_Wn[held]
    lo = torch.full((n * width,), torch.iinfo(torch.int64).max, dtype=torch.int64, device=device)
    hi = torch.full((n * width,), torch.iinfo(torch.int64).min, dtype=torch.int64, device=device)
    lo = lo.scatter_reduce(0, keys, values, reduce="amin")
    hi = hi.scatter_reduce(0, keys, values, reduce="amax")
    differs = ((lo != hi) & (lo <= hi)).view(n, width).any(dim=1)  # lo > hi: a key no rank holds
    bad = differs.nonzero().flatten()[:max_names].tolist()  # the one host read
    return [tensors[i][0] for i in bad]
