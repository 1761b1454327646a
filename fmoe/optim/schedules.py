"""Learning-rate and batch-size schedules (SPEC.md section 7).

Learning rate at optimizer step n (n = 0 is the first step), with W = warmup, D = total:

    n <= W (only when W > 0)   lr = init + (max - init) * n / W
    style = constant, n > W    lr = max          (after the warmup, also past D: min_lr unused)
    n >  D                     lr = min                                   (every other style)
    W < n <= D                 lr = min + c * (max - min),  r = (n - W) / (D - W)
        linear        c = 1 - r
        cosine        c = 0.5 * (cos(pi r) + 1)
        inverse_sqrt  lr = max(min, max * sqrt(max(W, 1)) / sqrt(max(n, 1)))   (no c, no r)
        wsd           c = 1 for n <= D - D_wsd, then with r_w = (n - (D - D_wsd)) / D_wsd:
            linear       c = 1 - r_w
            cosine       c = 0.5 * (cos(pi r_w) + 1)
            exponential  c = 2 * 0.5^r_w - 1
            minus_sqrt   c = 1 - sqrt(r_w)

Edges, all continuous except the last one:
  - step 0 is init_lr when W > 0, and the decay formula at r = 0 (max_lr; inverse_sqrt: max_lr)
    when W == 0: a zero warmup means no warmup, not a division by zero;
  - n == W is max_lr, reached by the warmup line and by every decay formula at r = 0;
  - the WSD decay starts at c = 1 and every wsd_style ends at c = 0, so lr reaches min_lr at D;
  - D == W (no decay phase) jumps from max_lr at W to min_lr at W + 1, and so does WSD with
    D_wsd == 0 at D; after D every style but constant, inverse_sqrt included, gives min_lr.
  - constant stays at max_lr after its warmup, past D too, whatever min_lr (as Megatron
    Core's "constant" decay style does).

Batch size: a string of THRESHOLD:BATCH pairs, e.g. "0:32 50M:64 200M:128", thresholds in
consumed tokens with K/M/B/T suffixes (1e3..1e12, decimals like 1.5M allowed); the batch at a
point is that of the last threshold <= tokens consumed. It replaces a linear batch ramp-up.
"""

from __future__ import annotations

import bisect
import math
import operator
import re
from decimal import Decimal, localcontext
from numbers import Real
from typing import Sequence, Union

import torch

STYLES = ("constant", "linear", "cosine", "inverse_sqrt", "wsd")
WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


def _index(value) -> int:
    """operator.index, refusing bools (True is 1 to operator.index): TypeError."""
    if isinstance(value, bool):
        raise TypeError(f"a bool is not an integer here: {value!r}")
    return operator.index(value)


def _check_count(name: str, value) -> int:
    """An integer >= 0 (numpy and torch integers pass; floats and bools do not)."""
    try:
        value = _index(value)
    except TypeError:
        raise ValueError(f"{name}: expected an integer >= 0, got {value!r}") from None
    if value < 0:
        raise ValueError(f"{name}: expected an integer >= 0, got {value}")
    return value


def _check_nonnegative(name: str, value) -> None:
    # a real number (numpy's too), not a bool, a tensor (a float32 tensor's step gave a tensor
    # lr, rounded to float32) or a Decimal (a TypeError inside)
    # inf: a schedule's end (min_lr, the last batch size) without a word; a huge int is finite (no float() of it)
    ok = isinstance(value, Real) and not isinstance(value, bool) and value >= 0 and value != math.inf  # False for NaN
    if not ok:
        raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")


def lr_at(
    step,
    *,
    max_lr: float,
    total: int,
    warmup: int = 0,
    min_lr: float = 0.0,
    init_lr: float = 0.0,
    style: str = "cosine",
    wsd_decay: int = 0,
    wsd_style: str = "linear",
) -> float:
    """Learning rate at optimizer step `step` (0-based), formulas in the module docstring.

    step:      the optimizer step, an integer >= 0 (a float works too)
    max_lr:    peak lr, > 0;  min_lr: floor, 0 <= min_lr <= max_lr;  init_lr: warmup start, >= 0
    total:     D, the step where the decay ends (>= warmup);  warmup: W, >= 0
    style:     constant | linear | cosine | inverse_sqrt | wsd  (constant: max_lr after the
               warmup, past total too; linear, cosine and wsd with wsd_decay > 0 reach min_lr
               by total and stay there, wsd with wsd_decay 0 at total + 1 (max_lr at total);
               inverse_sqrt decays as 1/sqrt(step), floored at min_lr, and gives min_lr past
               total)
    wsd_decay: D_wsd, the length of WSD's final decay, an integer >= 0; with style="wsd" (the
               only one that uses it) at most total - warmup;  wsd_style: linear | cosine |
               exponential | minus_sqrt

    >>> lr_at(0, max_lr=1.0, total=100, warmup=10)
    0.0
    >>> lr_at(10, max_lr=1.0, total=100, warmup=10)
    1.0
    >>> lr_at(102, max_lr=1.0, min_lr=0.1, total=100, style="constant")
    1.0
    >>> [lr_at(n, max_lr=1.0, min_lr=0.1, total=100, style="wsd") for n in (100, 101)]
    [1.0, 0.1]
    >>> round(lr_at(90, max_lr=1.0, min_lr=0.1, total=100, warmup=10, style="wsd",
    ...             wsd_decay=20, wsd_style="minus_sqrt"), 4)
    0.3636
    """
    _check_nonnegative("step", step)
    total = _check_count("total", total)
    warmup = _check_count("warmup", warmup)
    wsd_decay = _check_count("wsd_decay", wsd_decay)
    if warmup > total:
        raise ValueError(f"warmup: expected at most total={total}, got {warmup}")
    if style == "wsd" and wsd_decay > total - warmup:  # unused by the other styles: only its type is checked
        raise ValueError(f"wsd_decay: expected at most total - warmup = {total - warmup}, got {wsd_decay}")
    for name, value in (("max_lr", max_lr), ("min_lr", min_lr), ("init_lr", init_lr)):
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
            raise ValueError(f"{name}: expected a finite number, got {value!r}")
    if not max_lr > 0:
        raise ValueError(f"max_lr: expected a positive number, got {max_lr!r}")
    if not 0 <= min_lr <= max_lr:
        raise ValueError(f"min_lr: expected 0 <= min_lr <= max_lr={max_lr}, got {min_lr!r}")
    if not init_lr >= 0:
        raise ValueError(f"init_lr: expected a number >= 0, got {init_lr!r}")
    if style not in STYLES:
        raise ValueError(f"style: expected one of {', '.join(STYLES)}, got {style!r}")
    if wsd_style not in WSD_STYLES:
        raise ValueError(f"wsd_style: expected one of {', '.join(WSD_STYLES)}, got {wsd_style!r}")

    n = step
    if warmup > 0 and n <= warmup:
        t = n / warmup
        return float(init_lr * (1.0 - t) + max_lr * t)  # = init + (max - init) t, exact at both ends
    if style == "constant":  # no decay, so nothing ends at total
        return float(max_lr)  # a float whatever Real the lrs came as (an int's 1 -> 1.0)
    if n > total:
        return float(min_lr)
    if style == "inverse_sqrt":
        return float(max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1))))
    # here warmup <= n <= total, and n == warmup only when warmup == 0 (so r = 0, no division)
    r = (n - warmup) / (total - warmup) if total > warmup else 0.0
    if style == "linear":
        c = 1.0 - r
    elif style == "cosine":
        c = 0.5 * (math.cos(math.pi * r) + 1.0)
    else:  # wsd
        decay_start = total - wsd_decay
        if n <= decay_start:
            c = 1.0
        else:  # wsd_decay > 0 here, since decay_start < n <= total
            r_w = (n - decay_start) / wsd_decay
            if wsd_style == "linear":
                c = 1.0 - r_w
            elif wsd_style == "cosine":
                c = 0.5 * (math.cos(math.pi * r_w) + 1.0)
            elif wsd_style == "exponential":
                c = 2.0 * 0.5**r_w - 1.0
            else:  # minus_sqrt
                c = 1.0 - math.sqrt(r_w)
    return float(min_lr * (1.0 - c) + max_lr * c)  # = min + c (max - min), exactly max_lr at c = 1


class _ResumingLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR whose load_state_dict also sets the groups' lr to the loaded step's."""

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for group, lr in zip(self.optimizer.param_groups, self.get_last_lr()):
            group["lr"] = lr


def lr_scheduler(optimizer: torch.optim.Optimizer, **lr_at_kwargs) -> torch.optim.lr_scheduler.LambdaLR:
    """A torch LambdaLR that follows `lr_at(step, **lr_at_kwargs)`.

    LambdaLR sets each group's lr to (the group's lr at construction) * lambda(step); the
    lambda here is lr_at(step) / max_lr, so a group created with lr = max_lr follows lr_at
    (to rounding), and a group created with lr = s * max_lr follows s * lr_at: the way to
    give, say, embeddings half the lr on the same schedule. Call `scheduler.step()` after
    each `optimizer.step()`; the optimizer's first step then uses lr_at(0). The arguments are
    checked here, not at the first step. `load_state_dict` (a resume) also sets the groups'
    lr to the loaded step's, as torch's LambdaLR does not: an optimizer whose state was
    loaded without its lr (fmoe.train.checkpoint.load with knobs="held", train_moe's)
    otherwise took its first resumed step at the schedule's start.

    >>> model = torch.nn.Linear(2, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=3e-4)
    >>> sched = lr_scheduler(opt, max_lr=3e-4, total=100, warmup=10)
    >>> opt.param_groups[0]["lr"]   # lr_at(0): warmup starts at init_lr = 0
    0.0
    """
    lr_at(0, **lr_at_kwargs)  # raise the ValueError now, with the argument's name
    max_lr = lr_at_kwargs["max_lr"]
    return _ResumingLambdaLR(optimizer, lambda step: lr_at(step, **lr_at_kwargs) / max_lr)


# ---------------------------------------------------------------------------- batch size

_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
_THRESHOLD = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([KMBT]?)", re.ASCII)  # ASCII digits: Decimal and int take other scripts' too
_BATCH = re.compile(r"\d+", re.ASCII)

BatchSchedule = Union[str, Sequence[Sequence[int]]]


def _check_pairs(pairs: list[tuple[int, int]], text) -> list[tuple[int, int]]:
    if not pairs:
        raise ValueError(f"schedule: expected THRESHOLD:BATCH pairs like '0:32 50M:64', got {text!r}")
    if pairs[0][0] != 0:
        raise ValueError(f"schedule: the first threshold must be 0 tokens, got {pairs[0][0]} in {text!r}")
    for (prev, _), (cur, _) in zip(pairs, pairs[1:]):
        if cur <= prev:
            raise ValueError(f"schedule: thresholds must strictly increase, got {prev} then {cur} in {text!r}")
    for _, batch in pairs:
        if batch <= 0:
            raise ValueError(f"schedule: batch sizes must be positive integers, got {batch} in {text!r}")
    return pairs


def parse_batch_schedule(schedule: str) -> list[tuple[int, int]]:
    """Parse "THRESHOLD:BATCH ..." (whitespace-separated) into [(tokens, batch), ...].

    Thresholds take a K/M/B/T suffix (1e3, 1e6, 1e9, 1e12) and may be decimal as long as the
    token count is a whole number (1.5M yes, 1.0000005K no); batches are plain positive
    integers. The first threshold must be 0 and the rest strictly increase. Megatron's
    --step-batch-size-schedule has this form, but there the batch is the global batch in
    samples (train_moe reads micro-batches per step) and lower-case suffixes and commas pass.

    >>> parse_batch_schedule("0:32 1.5M:64 2B:128")
    [(0, 32), (1500000, 64), (2000000000, 128)]
    """
    if not isinstance(schedule, str):
        raise ValueError(f"schedule: expected a string like '0:32 50M:64', got {type(schedule).__name__}")
    pairs = []
    for item in schedule.split():
        threshold, sep, batch = item.partition(":")
        match = _THRESHOLD.fullmatch(threshold)
        if not sep or match is None or _BATCH.fullmatch(batch) is None:
            raise ValueError(
                f"schedule: cannot parse {item!r}, expected THRESHOLD:BATCH with THRESHOLD like 0, 500K, "
                f"1.5M (suffixes K M B T) and BATCH a positive integer"
            )
        with localcontext() as exact:  # the product exact (the default 28 digits rounded a long threshold)
            exact.prec = len(threshold) + 16
            tokens = Decimal(match[1]) * _SUFFIX[match[2]]
        if tokens != tokens.to_integral_value():
            raise ValueError(f"schedule: threshold {threshold!r} is not a whole number of tokens")
        pairs.append((int(tokens), int(batch)))
    return _check_pairs(pairs, schedule)


def batch_size_at(tokens_consumed: int, schedule: BatchSchedule) -> int:
    """Batch size once `tokens_consumed` tokens have been trained on.

    schedule: the string form ("0:32 50M:64 200M:128") or parse_batch_schedule's list of
    (threshold, batch) pairs, to parse a string once; either is checked on every call.

    >>> [batch_size_at(t, "0:32 50M:64 200M:128") for t in (0, 49_999_999, 50_000_000, 10**12)]
    [32, 32, 64, 128]
    """
    if isinstance(schedule, str):
        pairs = parse_batch_schedule(schedule)
    else:
        try:
            pairs = [(_index(t), _index(b)) for t, b in schedule]  # (0, True) gave a batch of 1
        except (TypeError, ValueError):
            raise ValueError(
                f"schedule: expected a string or a list of (threshold, batch) integer pairs, got {schedule!r}"
            ) from None
        _check_pairs(pairs, schedule)
    _check_nonnegative("tokens_consumed", tokens_consumed)
    index = bisect.bisect_right([t for t, _ in pairs], tokens_consumed) - 1
    return pairs[index][1]
