"""The Triton/torch dispatch rule of every op, and small tensor helpers.

    use_triton(impl, *tensors)   "auto" | "triton" | "torch": which implementation runs
    interpreting()               Triton kernels run through the CPU interpreter
    next_pow2(n)                 Triton block sizes
    local_tensor(t)              the local shard of a DTensor (the tensor itself otherwise)
"""

from __future__ import annotations

import os

import torch

IMPLS = ("auto", "triton", "torch")


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (Triton block sizes must be powers of two)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(impl: str, *tensors: torch.Tensor) -> bool:
    """The dispatch rule of every op.

    "auto": Triton for CUDA tensors, the torch reference otherwise. "triton": the kernels,
    on CUDA tensors or, under TRITON_INTERPRET=1, on CPU tensors. "torch": the reference.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    on_cuda = all(t.is_cuda for t in tensors)
    if impl == "torch":
        return False
    if impl == "auto":
        return on_cuda
    if not on_cuda and not interpreting():
        raise ValueError(
            "impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is "
            "imported, to run the kernels on CPU through the interpreter)"
        )
    return True


def local_tensor(t):
    """The local shard of a DTensor (differentiable: DTensor.to_local), the tensor itself
    otherwise (None stays None). Layers and optimizers compute on plain local tensors of
    the DTensors that fmoe.parallel sets up."""
    from torch.distributed.tensor import DTensor  # torch.distributed only when a DTensor may exist

    return t.to_local() if isinstance(t, DTensor) else t
