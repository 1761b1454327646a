"""Input validation shared by the ops: a ValueError that names the argument and says what
was expected.

Shape, dtype and device checks are free and always run. Checks of tensor VALUES (NaN
logits, expert ids in range, offsets order, labels below V, cu_seqlens order) read the
tensor on the host: one device->host sync each. One rule for every op:

- a public op that reads values to validate them takes a keyword-only `check: bool = True`;
- check=False skips exactly those value reads, nothing else;
- value checks never run while torch.compile traces (`checking()`): a read breaks the graph;
  nor on tensors that hold no values (the meta device, a model before it is materialized,
  a FakeTensor of torch's FakeTensorMode).

The ops with `check`: route (NaN logits), drop_by_capacity and permute (expert ids in
-1..E-1), grouped_mlp (offsets), cross_entropy and linear_cross_entropy (labels), and
seq_load_balancing_loss, roll_packed, positions_from_cu_seqlens and mtp_targets
(cu_seqlens), and sparse_attention (keys in range). Research code calling an op directly
keeps the default and gets a clear error; a model's forward passes check=False where the values are right by construction or
were checked once where the micro-batch was made (DESIGN.md "One micro-batch, one
context"). With check=False the forward and backward of these ops, and of every other op a
MoE transformer uses, read no tensor value on the host (tests/ops/test_checks.py).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch._subclasses.fake_tensor import is_fake

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class MissingExtra(ImportError):
    """A package of one of fmoe's extras (hf, data, plots, tensorboard) missing or too old; the
    message names its pip command. The scripts (fmoe.train.run.run_script) say it in one line."""
INDEX_DTYPES = (torch.int32, torch.int64)


def holds_values(t: torch.Tensor) -> bool:
    """Whether t's values can be read: False on the meta device and for a FakeTensor
    (torch's FakeTensorMode, shapes without values); True while torch.compile traces (the
    graph runs on tensors with values)."""
    return torch.compiler.is_compiling() or not (t.is_meta or is_fake(t))


def checking(check: bool = True, *tensors) -> bool:
    """Whether value checks that need a device->host sync run: asked for (an op's `check`),
    not while torch.compile traces, and every tensor to be read (None: left out) holds values
    (holds_values: not meta, not fake; shapes alone leave nothing to read) and is not mapped
    by torch.func.vmap (which reads no values: its "data-dependent control flow" error)."""
    return (check and not torch.compiler.is_compiling()
            and all(t is None or holds_values(t) and not _vmapped(t) for t in tensors))


def _vmapped(t: torch.Tensor) -> bool:
    """Whether t is batched by torch.func.vmap at any of its function-transform levels."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        if torch._C._functorch.is_batchedtensor(t):
            return True
        t = torch._C._functorch.get_unwrapped(t)
    return False


def check_distinct_memory(name: str, x: torch.Tensor, why: str) -> None:
    """A ValueError unless every element of x has its own memory (an in-place write to one
    element then changes no other): no expanded (stride 0) dim, no as_strided overlap. Free
    for the usual views (slices, steps, transposes: each stride past the span of the smaller
    ones); other layouts are checked element by element."""
    if x.numel() == 0:
        return
    dims = [(stride, size) for size, stride in zip(x.shape, x.stride()) if size > 1]
    # each dim's stride past the span of those below it in stride order (ties by position): no
    # sort, which torch.compile cannot trace over symbolic strides (dynamic=True)
    for i, (stride, _) in enumerate(dims):
        below = [(s, n) for j, (s, n) in enumerate(dims) if s < stride or (s == stride and j < i)]
        if stride <= sum((n - 1) * s for s, n in below):
            break
    else:
        return
    overlap = any(stride == 0 for stride, _ in dims)
    if not overlap:  # an interleaved layout: count the distinct element offsets
        offsets = torch.zeros((), dtype=torch.int64)
        for size, stride in zip(x.shape, x.stride()):
            offsets = offsets.unsqueeze(-1) + torch.arange(size) * stride
        overlap = offsets.unique().numel() < x.numel()
    if overlap:
        raise ValueError(f"{name}: {why}: elements of {name} share memory (strides {tuple(x.stride())}, shape {tuple(x.shape)}, "
                         f"e.g. an expand); pass {name}.contiguous() or a tensor of its own")


def check_device(name: str, t: torch.Tensor, device: torch.device, like: str = "") -> None:
    """t on `device` (like: the argument that sets it, named in the error), or a ValueError."""
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}{f' like {like}' if like else ''}, got {t.device}")


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
    if not checking(True, x):
        return
    bad = torch.isnan(x)
    if bad.any():
        rows = bad.reshape(x.shape[0], -1).any(dim=1).nonzero().flatten()
        raise ValueError(
            f"{name}: contains NaN in {rows.numel()} row(s), first at row {int(rows[0])}; "
            "NaN logits cannot be routed (pass check=False to skip this check: NaN rows "
            "then get NaN weights)"
        )


def largest(x: torch.Tensor) -> float:
    """x's largest value with its NaNs left out (-inf if every value is NaN): a NaN beside a
    value out of range hides nothing. One device->host sync."""
    return float(x.detach().nan_to_num(nan=float("-inf"), posinf=float("inf")).max())


def check_index(name: str, x: torch.Tensor, ndim: int, shape_doc: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor {shape_doc}, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor {shape_doc}, got shape {tuple(x.shape)}")
    if x.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name}: expected dtype int32 or int64, got {x.dtype}")


def check_rows_and_state(cu_seqlens, B: int, initial_state, shape: tuple, shape_doc: str, device) -> None:
    """The packed documents and the state a recurrence over documents starts from (the gated
    delta rule's, the selective scan's): cu_seqlens None or int [n_docs + 1] with one batch row
    (B = 1); initial_state None or a float tensor of `shape` (shape_doc: its letters) on device."""
    if cu_seqlens is not None:
        check_index("cu_seqlens", cu_seqlens, 1, "[n_docs + 1]")
        if cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens: expected at least 2 entries [0, ..., T], got {cu_seqlens.numel()}")
        if B != 1:
            raise ValueError(f"cu_seqlens: packed documents need one batch row (B = 1), got B = {B}")
    if initial_state is not None:
        check_float("initial_state", initial_state, len(shape), f"{shape_doc} = {list(shape)}")
        if tuple(initial_state.shape) != tuple(shape) or initial_state.device != device:
            raise ValueError(f"initial_state: expected {list(shape)} on {device}, got {list(initial_state.shape)} on {initial_state.device}")


def check_token_mask(name: str, mask, n_tokens: int) -> None:
    """mask: None, or a bool tensor [n_tokens] (True: a token that counts)."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != (n_tokens,):
        got = f"{mask.dtype} {list(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"{name}: expected None or a bool tensor [{n_tokens}] (True where a token counts), got {got}")


def check_cu_seqlens(cu_seqlens: torch.Tensor, n_tokens: int, name: str = "cu_seqlens", *, check: bool = True,
                     like: Optional[tuple[str, torch.Tensor]] = None) -> None:
    """cu_seqlens [n+1]: int32/int64 with n >= 1 (free), and with check (one device->host
    sync, skipped under torch.compile) starts at 0, non-decreasing, ends at n_tokens.
    like: (name, tensor) the offsets are copied to the device of (any device, the host's
    included): a ValueError where cu_seqlens is a meta tensor and that one holds values
    (there is nothing to copy)."""
    check_index(name, cu_seqlens, 1, "[n_seqs + 1]")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"{name}: expected at least 2 entries [0, ..., T], got {cu_seqlens.numel()}")
    if like is not None and cu_seqlens.is_meta and not like[1].is_meta:
        raise ValueError(f"{name}: a meta tensor holds no offsets to copy to the device of {like[0]} ({like[1].device}): pass them "
                         "there or on the host")
    if not checking(check, cu_seqlens):
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


def check_expert_ids(name: str, experts: torch.Tensor, n_experts: int) -> None:
    """Expert ids in -1..n_experts - 1 (-1: a dropped or skipped slot): a value check, one
    device->host read (their least and greatest); callers run it under checking(check)."""
    if not experts.numel():
        return
    lo, hi = torch.stack(torch.aminmax(experts)).tolist()
    if lo < -1 or hi >= n_experts:
        raise ValueError(f"{name}: ids must lie in -1..{n_experts - 1} (-1: a dropped or skipped slot), got {lo}..{hi}")


def check_experts(name: str, x: torch.Tensor) -> None:
    """x [T, E] has E >= 1: with no expert a top-k has nothing to choose, the switch loss is
    a sum over nothing, the sequence loss's counts have no column to scatter into, and z_loss
    is a logsumexp over nothing (-inf, squared to inf)."""
    if x.shape[1] == 0:
        raise ValueError(f"{name}: expected at least one expert (E >= 1), got shape {tuple(x.shape)}")


def check_bools(**flags) -> None:
    """Each flag a bool (a "False" read from a config is not one), named in the error."""
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise ValueError(f"{name}: expected a bool, got {flag!r}")


def check_path(name: str, path, what: str = "a path"):
    """path, a str or os.PathLike (a file or folder argument), or a ValueError naming it."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{name}: expected {what} (str or os.PathLike), got {type(path).__name__}")
    return path


def check_positive_int(name: str, value, low: int = 1, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an int, got {value!r}")
    if value < low or (high is not None and value > high):
        span = f"{low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name}: expected {span}, got {value}")
    return value
