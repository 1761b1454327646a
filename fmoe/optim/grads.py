"""Gradient helpers: norm clipping and float32 accumulation of chosen bf16 gradients.

clip_grad_norm(parameters, max_norm) scales every .grad by min(1, max_norm / (norm + 1e-6)),
norm = ||concat of all grads||_p, and returns that pre-clip norm (torch's clip_grad_norm_).

Float32GradAccumulator: with bf16 parameters, autograd sums the micro-batch gradients into a
bf16 .grad, rounding after every micro-batch (8 significant bits: once the sum is 256 times
a micro-batch's contribution, that contribution is rounded away). For the parameters that
need it (the router, whose logits decide discrete choices) the accumulator moves each
micro-batch's bf16 gradient into a float32 sum as soon as autograd has produced it:

    main_grad[p] = sum_i float32(grad_i(p))      (one bf16 rounding per micro-batch, not per sum)
"""

from __future__ import annotations

import re
from typing import Iterable, Optional, Union

import torch


def clip_grad_norm(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
    max_norm: float,
    *,
    norm_type: float = 2.0,
    foreach: Optional[bool] = None,
) -> torch.Tensor:
    """Clip the gradients' total norm to `max_norm` in place; return the pre-clip norm.

    A thin wrapper over torch.nn.utils.clip_grad_norm_: parameters without a .grad are
    skipped (none at all gives a norm of 0), norm_type may be inf, foreach as in torch.
    Returns a float32 0-D tensor on the grads' device, whatever the grads' dtype. The norm
    is local to this process: sharded or expert-parallel gradients need the distributed one.

    >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([3.0, 4.0])
    >>> clip_grad_norm([w], 1.0)
    tensor(5.)
    >>> w.grad
    tensor([0.6000, 0.8000])
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm: expected a positive number, got {max_norm!r}")
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type, foreach=foreach)
    return norm.float()


class Float32GradAccumulator:
    """Accumulate the gradients of the parameters whose name matches a pattern in float32.

    model:    its named_parameters() (requires_grad ones) are matched against
    patterns: regular expressions, re.search on the full name, so "router" matches
              "layers.3.moe.router.weight" anywhere in the name and "^head\\." only at the
              start; one string is one pattern. ValueError when nothing matches.

    Hooks (register_post_accumulate_grad_hook) add each micro-batch's .grad into a float32
    buffer in `main_grads` (name -> tensor, created by the first gradient after zero_grad)
    and set the parameter's .grad back to None, so bf16 never holds a sum. Other parameters
    are untouched. One step:

        acc = Float32GradAccumulator(model, patterns=("router",))
        for micro_batch in micro_batches:
            loss_fn(model, micro_batch).backward()
        acc.copy_to_grad()                 # float32 sums -> .grad, cast to the param's dtype
        clip_grad_norm(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(); acc.zero_grad()
        ...
        acc.remove()                       # back to plain autograd accumulation

    Call zero_grad before the next backward: a .grad left by copy_to_grad would be summed
    in again by the first hook.
    """

    def __init__(self, model: torch.nn.Module, patterns: Union[str, Iterable[str]] = ("router",)):
        patterns = [patterns] if isinstance(patterns, str) else list(patterns)
        try:
            regexes = [re.compile(p) for p in patterns]
        except (re.error, TypeError) as e:
            raise ValueError(f"patterns: expected regular expressions, got {patterns!r} ({e})") from None
        self.params = {
            name: p
            for name, p in model.named_parameters()
            if p.requires_grad and any(r.search(name) for r in regexes)
        }
        if not self.params:
            raise ValueError(f"patterns: {patterns!r} match no trainable parameter name of the model")
        self.main_grads: dict[str, torch.Tensor] = {}
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(name)) for name, p in self.params.items()]

    def _hook(self, name: str):
        def accumulate(param: torch.Tensor) -> None:
            if name in self.main_grads:
                self.main_grads[name].add_(param.grad)  # bf16 -> float32 in the add, exactly
            else:
                self.main_grads[name] = param.grad.to(torch.float32, copy=True)
            param.grad = None

        return accumulate

    def copy_to_grad(self) -> None:
        """Set each matched parameter's .grad to its float32 sum cast to the parameter's dtype
        (torch requires a .grad of the parameter's dtype, and its optimizers expect it); an
        optimizer that can use the float32 sums reads `main_grads` instead. A parameter that
        got no gradient since zero_grad keeps .grad None, so the optimizer skips it as usual."""
        for name, grad in self.main_grads.items():
            param = self.params[name]
            param.grad = grad.to(param.dtype, copy=True)

    def zero_grad(self) -> None:
        """Drop the float32 sums and the matched parameters' .grad (set to None)."""
        self.main_grads.clear()
        for param in self.params.values():
            param.grad = None

    def remove(self) -> None:
        """Remove the hooks; the matched parameters accumulate in their own dtype again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def begin_step(closure, owned):
    """The common start of an fmoe optimizer's step.

    Runs the closure (with grad enabled) and returns (its loss or None, stepped), where
    stepped(p) says whether this step updates p: it has a gradient and, when `owned` is
    given, is one of the owned parameters (a rank of a distributed optimizer updates the
    parameters it owns; the others keep their values and state).
    """
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    owned_ids = None if owned is None else {id(p) for p in owned}
    return loss, lambda p: p.grad is not None and (owned_ids is None or id(p) in owned_ids)
