"""Helpers shared by the op families: input validation and the Triton/torch dispatch rule.

Every public op validates its inputs with these (a ValueError naming the argument and what
was expected), then asks `use_triton` which implementation to run.
"""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
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


def checking() -> bool:
    """Whether value checks that need a device->host sync may run (never while compiling)."""
    return not torch.compiler.is_compiling()


def check_float(name: str, x: torch.Tensor, ndim: int, shape_doc: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor {shape_doc}, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor {shape_doc}, got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{name}: expected dtype float32, bfloat16 or float16, got {x.dtype}"
        )


def check_no_nan(name: str, x: torch.Tensor) -> None:
    """Raise if x holds a NaN, naming the first offending row. One device->host sync."""
    if not checking():
        return
    bad = torch.isnan(x)
    if bad.any():
        rows = bad.reshape(x.shape[0], -1).any(dim=1).nonzero().flatten()
        raise ValueError(
            f"{name}: contains NaN in {rows.numel()} row(s), first at row {int(rows[0])}; "
            "NaN logits cannot be routed (pass check_nan=False to skip this check: NaN rows "
            "then get NaN weights)"
        )


def check_index(name: str, x: torch.Tensor, ndim: int, shape_doc: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor {shape_doc}, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor {shape_doc}, got shape {tuple(x.shape)}")
    if x.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name}: expected dtype int32 or int64, got {x.dtype}")


def check_cu_seqlens(cu_seqlens: torch.Tensor, n_tokens: int, name: str = "cu_seqlens") -> None:
    """cu_seqlens [n+1]: int32/int64, starts at 0, non-decreasing, ends at n_tokens."""
    check_index(name, cu_seqlens, 1, "[n_seqs + 1]")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"{name}: expected at least 2 entries [0, ..., T], got {cu_seqlens.numel()}")
    if not checking():
        return
    c = cu_seqlens.detach().cpu()
    if int(c[0]) != 0:
        raise ValueError(f"{name}: must start at 0, starts at {int(c[0])}")
    steps = c[1:] - c[:-1]
    if (steps < 0).any():
        i = int((steps < 0).nonzero()[0])
        raise ValueError(f"{name}: must be non-decreasing, but {name}[{i + 1}] = {int(c[i + 1])} < {name}[{i}] = {int(c[i])}")
    if int(c[-1]) != n_tokens:
        raise ValueError(f"{name}: must end at the token count {n_tokens}, ends at {int(c[-1])}")


def check_positive_int(name: str, value, low: int = 1, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an int, got {value!r}")
    if value < low or (high is not None and value > high):
        span = f"{low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name}: expected {span}, got {value}")
    return value


def local_tensor(t):
    """The local shard of a DTensor (differentiable: DTensor.to_local), the tensor itself
    otherwise (None stays None). Layers and optimizers compute on plain local tensors of
    the DTensors that fmoe.parallel sets up."""
    from torch.distributed.tensor import DTensor  # torch.distributed only when a DTensor may exist

    return t.to_local() if isinstance(t, DTensor) else t
