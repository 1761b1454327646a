"""Input validation shared by the ops: a ValueError that names the argument and says what
was expected.

Shape and dtype checks are free. Checks of tensor VALUES (NaN logits, cu_seqlens order, ids
in range, labels below V) read the tensor on the host: one device->host sync each. Every
public op that has one takes `check=True`; code on the hot path passes check=False where
the values are right by construction or were checked once where the batch was made
(DESIGN.md "One micro-batch, one context"). Value checks are skipped while torch.compile
traces (`checking()`), where a host read would break the graph.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


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
