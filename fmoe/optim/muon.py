"""Muon: momentum, then an orthogonalised update, for the matrix parameters of a model.

For each matrix parameter W [m, n] with gradient G (Keller Jordan 2024):

    M   <- mu M + G                               momentum buffer
    D    = G + mu M   (nesterov)  or  M           update direction
    O    = NS(D) ~ U V^T   where D = U S V^T      Newton-Schulz orthogonalisation
    W   <- W (1 - lr wd)                          decoupled weight decay
    W   <- W - lr s(m, n) O

NS runs 5 steps of the quintic X <- a X + (b A + c A^2) X, A = X X^T, with (a, b, c) =
(3.4445, -4.7750, 2.0315), on X = D / ||D||_F (so every singular value starts in (0, 1]),
in bfloat16, transposed first when m > n so that A is the smaller Gram matrix. The
coefficients maximise the slope at zero, not exact convergence: the singular values of a
well-conditioned D end in roughly [0.7, 1.2] rather than at 1, which trains as well as the
exact polar factor U V^T; directions of D with singular values far below its largest stay
small (a square Gaussian D's smallest end near 0.02-0.06, and a spectrum decaying as 0.9^i
over 64 leaves about a quarter of its directions below 0.7).

A matrix whose gradient is zero from some step on (an expert that gets no tokens) keeps
moving: its momentum decays as mu^k, but NS normalises it first, so the update stays full
size, in the last direction the momentum held, until mu^k ||M|| nears eps (about 300 steps at
mu = 0.95). Measured on a [32, 16] expert dead from step 5, lr 1e-3: an update RMS of 1.8e-4
a step, as the live expert's, and 1.59 moved over 395 steps (3.5x its norm), where AdamW's
update falls to 0 and it moves 0.08. This is Muon's own behaviour (the references do the
same); the expert load metrics show such experts.

The shape scale s(m, n) (argument `scale`):

    "moonlight"  0.2 sqrt(max(m, n))   Moonlight (Liu et al. 2025, arXiv 2502.16982, eq. 4):
                 the update RMS is about 0.2 lr, matching AdamW's (0.2 for the exact U V^T;
                 0.16-0.19 lr measured after the 5 steps above, by shape), so Muon can take AdamW's lr and
                 weight decay; symmetric in m and n, so it does not depend on the layout of W.
    "spectral"   sqrt(max(1, m / n))   Keller Jordan's modded-nanogpt scale, for nn.Linear's
                 [out, in] layout (m = fan-out); pairs with lr ~ 0.02. fmoe's own weights are
                 [in, out] (x @ w), for which this reads sqrt(max(1, fan_in / fan_out)).

A parameter with more than 2 dims is a batch of matrices over its leading dims: an expert
stack w_gate [E, H, F] is E matrices [H, F], each orthogonalised on its own. Parameters with
fewer than 2 dims (norms, biases) and those that act as lookups or a classifier (embeddings,
the output head, the router) belong to AdamW; `split_param_groups` splits a model by that
rule and `build_optimizers` returns the two optimizers.

Many ranks: the layer-wise distributed Muon (fmoe.parallel.muon.DistributedMuon) assigns
each matrix to one rank, gathers the matrix's shards to its owner, orthogonalises there and
sends each rank its block back; it shares this file's momentum_direction, newton_schulz and
apply_update.

DTensor parameters are updated through their local tensors, which is Muon only when each
local tensor holds whole matrices: replicated, or sharded over the leading (expert) dims of a
stack. A shard of a matrix dim is refused at construction. The momentum buffer is then a
plain tensor of the local shape.

References: Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (2024),
https://kellerjordan.github.io/posts/muon/ ; Liu et al., "Muon is Scalable for LLM
Training" (Moonlight), arXiv 2502.16982.

Legend: m rows, n cols of one matrix; E experts, H hidden, F expert FFN size.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, Iterable, Optional, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from fmoe.ops.backend import local_tensor as _local
from fmoe.ops.checks import check_bools
from fmoe.ops.experts import EXPERT_BIASES
from fmoe.optim.adamw import (
    check_number, check_ordered, check_params_once, check_saved_groups, check_state_shapes, split_names, with_names,
)

NS_COEFFS = (3.4445, -4.7750, 2.0315)
SCALES = ("moonlight", "spectral")
# conv_: a linear-attention layer's taps, per channel; _hc.: hyper-connections' weights (hc_head matches "head")
ADAMW_PATTERNS = ("embed", "lm_head", "head", "router", "norm", "bias", "attn.conv_", "_hc.")
# torch.nn's convolutions (their Lazy forms subclass these): a weight [out, in, *kernel] is filters, not matrices, for Muon
CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
EMBEDDING_PATTERNS = ("embed", "head")  # the weights decay_embeddings=False leaves undecayed
STACKED_BIASES = tuple(f"experts.{name}" for name in EXPERT_BIASES)  # [E, F] / [E, H]: a bias per expert, not a matrix
PER_CHANNEL = ("attn.A_log",)  # Mamba-1's log-decays [C, N]: a vector per channel, not a matrix (no decay, as Mamba's own)
# the q/k LayerNorms' weights and biases per head [heads, D] (qk_norm "head_layer": Cohere's, Chameleon's): a norm per head
PER_HEAD_NORMS = ("attn.q_norm", "attn.k_norm", "attn.q_norm_bias", "attn.k_norm_bias")


# -----------------------------------------------------------------------------
# Newton-Schulz orthogonalisation

def newton_schulz(G: torch.Tensor, steps: int = 5, eps: float = 1e-7, *, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The quintic Newton-Schulz approximation of U V^T for each matrix of G [..., m, n].

    Leading dims are a batch: each [m, n] slice is normalised and orthogonalised on its own.
    Computes in `dtype` (bfloat16 as in modded-nanogpt; torch.float32 for checks) and returns
    G's dtype. Singular values of the result lie near, not at, 1 (see the module docstring).
    G must be real floating point (ValueError otherwise); steps an int >= 1, eps a finite
    number > 0 (added to the norm: 0 made a zero matrix NaN), dtype a floating torch.dtype.

        O = newton_schulz(torch.randn(4, 32, 16))   # 4 matrices, each with O^T O ~ I
    """
    if not isinstance(G, torch.Tensor) or G.ndim < 2:
        raise ValueError(f"G: expected a tensor [..., m, n] with at least 2 dims, got {getattr(G, 'shape', type(G).__name__)}")
    if not G.is_floating_point():  # an int64 G came back as zeros, a complex one lost its imaginary part
        raise ValueError(f"G: expected a floating-point tensor, got {G.dtype}")
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"steps: expected an int >= 1, got {steps!r}")
    check_number("eps", eps, "a finite eps > 0", lambda v: v > 0.0)  # a negative one divided by ~0, 0 by a zero matrix's 0
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:  # an int32 failed inside torch's norm
        raise ValueError(f"dtype: expected a floating torch.dtype (torch.bfloat16, torch.float32), got {dtype!r}")
    a, b, c = NS_COEFFS
    X = G.to(dtype)
    tall = G.shape[-2] > G.shape[-1]
    if tall:
        X = X.mT  # iterate on the wide side: A = X X^T is then min(m, n) square
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if tall:
        X = X.mT
    return X.to(G.dtype)


def shape_scale(shape: torch.Size, scale: str) -> float:
    """s(m, n) for a parameter of `shape` [..., m, n] (see the module docstring)."""
    m, n = shape[-2], shape[-1]
    if scale == "moonlight":
        return 0.2 * math.sqrt(max(m, n))
    if scale == "spectral":
        return math.sqrt(max(1.0, m / n))
    raise ValueError(f"scale: expected one of {SCALES}, got {scale!r}")


# -----------------------------------------------------------------------------
# The optimizer

def momentum_direction(buf: torch.Tensor, g: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """M <- mu M + G in place on `buf`; returns the direction G + mu M (nesterov) or M.
    Elementwise, so it runs on local shards as well as on whole matrices."""
    buf.mul_(momentum).add_(g)
    return g.add(buf, alpha=momentum) if nesterov else buf


def apply_update(w: torch.Tensor, update: torch.Tensor, *, lr: float, weight_decay: float, scale: float) -> None:
    """W <- W (1 - lr wd) - lr s O, in place (w and update: the same block of a matrix)."""
    if weight_decay:
        w.mul_(1 - lr * weight_decay)
    w.add_(update.to(w.dtype), alpha=-lr * scale)


def check_hyperparameters(group: dict) -> None:
    """ValueError naming the first bad hyperparameter of a Muon param group: lr >= 0,
    momentum in [0, 1), weight_decay >= 0, each a finite number (NaN, inf, strings, bools
    and tensors fail); nesterov a bool, ns_steps an int >= 1, scale, ns_dtype. Plain
    Python: step() runs it on every group. Shared with fmoe.parallel's DistributedMuon."""
    check_number("lr", group["lr"], "a finite learning rate >= 0", lambda v: v >= 0.0)
    check_number("momentum", group["momentum"], "a finite momentum in [0, 1)", lambda v: 0.0 <= v < 1.0)
    if not isinstance(group["nesterov"], bool):  # "no" is truthy: it stepped as nesterov=True
        raise ValueError(f"nesterov: expected True or False, got {group['nesterov']!r}")
    check_number("weight_decay", group["weight_decay"], "a finite weight_decay >= 0", lambda v: v >= 0.0)
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"ns_steps: expected an int >= 1, got {steps!r}")
    if group["scale"] not in SCALES:
        raise ValueError(f"scale: expected one of {SCALES}, got {group['scale']!r}")
    dtype = group["ns_dtype"]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:  # an int32 failed at the first step
        raise ValueError(f"ns_dtype: expected a floating torch.dtype (torch.bfloat16, torch.float32), got {dtype!r}")


def own_buffers(state) -> None:
    """Give every loaded momentum buffer its own storage: torch's loader keeps a saved tensor
    of the parameter's dtype and device as it is, so an optimizer loaded from another's
    in-memory state_dict() stepped the other's buffers too (and the other its)."""
    for entry in state.values():
        if isinstance(entry.get("momentum_buffer"), torch.Tensor):
            entry["momentum_buffer"] = entry["momentum_buffer"].clone()


class Muon(torch.optim.Optimizer):
    """Muon for matrix parameters (ndim >= 2; leading dims of a stack are a batch of matrices;
    real floating point, each in the optimizer once).

    Args:
        params: tensors, (name, tensor) pairs (model.named_parameters()) or param-group
            dicts, in a list (a set is a TypeError); each group may override any keyword
            below.
        lr: learning rate. With scale="moonlight" the update RMS is about 0.2 lr (0.16-0.19
            after NS's 5 steps), as AdamW's, so
            pass AdamW's lr (Moonlight reuses it; the default is fmoe AdamW's, 1e-3); about
            0.02 is modded-nanogpt's lr for scale="spectral".
        momentum: mu in [0, 1). nesterov: step along G + mu M instead of M.
        weight_decay: decoupled, W *= 1 - lr wd before the update.
        ns_steps: Newton-Schulz steps. scale: "moonlight" (default: layout-free and on
            AdamW's lr scale) or "spectral". ns_dtype: the dtype NS computes in.
    """

    def __init__(
        self, params, lr: float = 1e-3, momentum: float = 0.95, nesterov: bool = True, weight_decay: float = 0.0,
        *, ns_steps: int = 5, scale: str = "moonlight", ns_dtype: torch.dtype = torch.bfloat16,
    ):
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, ns_steps=ns_steps, scale=scale, ns_dtype=ns_dtype,
        )
        check_ordered(params)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """Validates the group's hyperparameters and parameters (matrices, each once in the
        optimizer, as DistributedMuon requires; a list, not a set: check_ordered), then adds it."""
        group = {**self.defaults, **param_group}
        check_hyperparameters(group)
        check_ordered(group["params"])
        params, names = split_names(group["params"])
        check_params_once(params, self.param_groups)
        for i, p in enumerate(params):
            where = f"params[{i}]" + (f" ({names[i]})" if names and names[i] else "")
            if not isinstance(p, torch.Tensor):  # Muon([1.0]): an AttributeError below
                raise ValueError(f"params: expected tensors, got {type(p).__name__}")
            if not p.is_floating_point():  # a complex gradient's imaginary part was dropped, int64 failed at step
                raise ValueError(f"params: expected floating-point parameters, got {p.dtype} (a parameter of shape {tuple(p.shape)})")
            if p.ndim < 2:
                raise ValueError(f"params: Muon takes matrices (ndim >= 2), got shape {tuple(p.shape)}; give it to AdamW")
            if isinstance(p, DTensor) and any(isinstance(pl, Shard) and pl.dim % p.ndim >= p.ndim - 2 for pl in p.placements):
                raise ValueError(f"{where}: a DTensor of shape {tuple(p.shape)} sharded over a matrix dim ({p.placements}) is not whole "
                                 "locally; Muon orthogonalises whole matrices: fmoe.parallel.DistributedMuon gathers them under FSDP2")
        super().add_param_group(with_names(param_group, params, names))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader, with copies of the momentum buffers (own_buffers), after checking each saved momentum_buffer against its parameter's
        shape: ValueError naming the parameter's index and both shapes (torch's loader took
        it, and the next step failed inside torch), and for a saved group's hyperparameter
        that step() would refuse, or another optimizer's group (check_hyperparameters)."""
        check_saved_groups(state_dict, check_hyperparameters)
        check_state_shapes(self.param_groups, state_dict, {"momentum_buffer": lambda p: _local(p).shape})
        super().load_state_dict(state_dict)
        own_buffers(self.state)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        """One update of every parameter with a gradient (the others keep their values and
        momentum). closure: as for any torch optimizer, re-evaluates the model (with grad
        enabled) before the step; its loss is returned (None without one).

        Every group's hyperparameters are checked first, as add_param_group checks them (a
        value set on a group later included): a ValueError naming the first bad one, before
        the closure runs or anything changes. A sparse gradient: RuntimeError, before any
        parameter changes."""
        for group in self.param_groups:
            check_hyperparameters(group)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if any(p.grad is not None and p.grad.is_sparse for group in self.param_groups for p in group["params"]):
            raise RuntimeError("Muon does not support sparse gradients")
        for group in self.param_groups:
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                w, g = _local(p), _local(p.grad)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                direction = momentum_direction(state["momentum_buffer"], g, mu, group["nesterov"])
                update = newton_schulz(direction, steps=group["ns_steps"], dtype=group["ns_dtype"])
                apply_update(w, update, lr=lr, weight_decay=wd, scale=shape_scale(w.shape, group["scale"]))
        return loss


# -----------------------------------------------------------------------------
# Splitting a model between Muon and AdamW

def split_param_groups(
    model: nn.Module, *, muon_lr: float = 3e-4, adamw_lr: float = 3e-4, weight_decay: float = 0.0,
    adamw_patterns: Union[str, Iterable[str]] = ADAMW_PATTERNS, muon: bool = True, decay_embeddings: bool = True,
) -> tuple[list[dict], list[dict]]:
    """(muon_groups, adamw_groups): a model's trainable parameters split by name and shape;
    one helper for every optimizer choice. muon_lr defaults to adamw_lr's default: Muon's
    default scale ("moonlight") takes AdamW's lr; about 0.02 goes with scale="spectral".

    Which optimizer: a parameter with ndim >= 2 goes to Muon unless its name (as in
    named_parameters) contains one of `adamw_patterns` as a substring (embeddings, output
    head, router: lookups and classifiers, whose rows are not an operator to orthogonalise;
    a linear-attention layer's convolution taps, a filter per channel) or it is the weight of
    one of torch.nn's convolutions (nn.Conv1d/2d/3d and their transposes: [out, in, *kernel],
    which Muon would take as a batch of kernel-sized matrices, orthogonalising each 3 x 3
    slice on its own) or of a torch.nn.Embedding / EmbeddingBag (a lookup whatever its name:
    `wte`, `tok`); everything else goes to AdamW. adamw_patterns: strings, or one string
    as one pattern. The default patterns send a norm's own matrices to AdamW too (a gated
    norm's low-rank gate_down / gate_up, norm_gate_rank: "norm" is in their names), decayed.

    Weight decay, in either optimizer: the ndim < 2 tensors (norms, biases, gates), the
    experts' stacked biases (b_gate, b_up, b_down: one bias per expert) and every parameter
    whose own name holds "bias" whatever its shape (compressed attention's compress_bias [m,
    D], a bias per place in a run) get none (Megatron Core's default; none goes to Muon
    either), nor do Mamba-1's log-decays A_log [C, N] (a vector per channel) and the
    q/k norms' weights and biases per head [heads, D], nor, with decay_embeddings=False, the
    embeddings and output heads (names containing "embed" or "head", and torch.nn.Embedding's
    weights whatever their names); the rest get
    `weight_decay`. decay_embeddings changes only the decay, never the optimizer: a head
    matrix outside adamw_patterns stays in Muon, in a group of its own without decay.

    Buffers (an expert_bias) and frozen parameters are in neither. muon=False puts every
    matrix in AdamW (an AdamW-only run: muon_groups is []). Each side is [decayed,
    undecayed] groups, empty ones left out.

        muon_groups, adamw_groups = split_param_groups(model)
        opts = [Muon(muon_groups), torch.optim.AdamW(adamw_groups)]
        _, groups = split_param_groups(model, muon=False, weight_decay=0.1)   # AdamW only
    """
    if not isinstance(model, nn.Module):  # a list of parameters: "'list' object has no attribute 'modules'"
        raise ValueError(f"model: expected an nn.Module (its parameters' names decide the groups), got {type(model).__name__}")
    check_bools(muon=muon, decay_embeddings=decay_embeddings)  # "no" is truthy: matrices to Muon, the embeddings decayed
    try:
        patterns = (adamw_patterns,) if isinstance(adamw_patterns, str) else tuple(adamw_patterns)  # "embed": not "e", "m", ...
    except TypeError:
        patterns = None
    if patterns is None or not all(isinstance(pattern, str) for pattern in patterns):
        raise ValueError(f"adamw_patterns: expected a string or an iterable of strings (substrings of parameter names), got {adamw_patterns!r}")
    muon_params, adamw_params = ([], []), ([], [])  # (decayed, undecayed) each
    filters = {id(m.weight) for m in model.modules() if isinstance(m, CONVOLUTIONS)}  # [out, in, *kernel]: not a batch of matrices
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}  # by type: a `wte` went to Muon
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        not_a_matrix = (p.ndim < 2 or name.endswith(STACKED_BIASES + PER_CHANNEL + PER_HEAD_NORMS)
                        or "bias" in name.rsplit(".", 1)[-1])  # a bias of any shape (compressed attention's [m, D] by place)
        to_muon = muon and not not_a_matrix and id(p) not in filters | lookups and not any(pattern in name for pattern in patterns)
        undecayed = not_a_matrix or (not decay_embeddings and (id(p) in lookups or any(part in name for part in EMBEDDING_PATTERNS)))
        (muon_params if to_muon else adamw_params)[undecayed].append(p)

    def groups(lr: float, params: tuple[list, list]) -> list[dict]:
        return [dict(params=ps, lr=lr, weight_decay=wd) for ps, wd in zip(params, (weight_decay, 0.0)) if ps]

    return groups(muon_lr, muon_params), groups(adamw_lr, adamw_params)


def build_optimizers(
    model: nn.Module, *, muon_lr: float = 3e-4, adamw_lr: float = 3e-4, weight_decay: float = 0.0,
    adamw_patterns: Union[str, Iterable[str]] = ADAMW_PATTERNS, adamw_cls: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
    decay_embeddings: bool = True, muon_cls: Callable[..., torch.optim.Optimizer] = Muon, **muon_kwargs,
) -> list[torch.optim.Optimizer]:
    """[Muon, AdamW] over `model` as split by split_param_groups (either left out if empty:
    a model, or a pipeline stage, with nothing to train gets none).

    The train loop calls step() and zero_grad() on each. `adamw_cls` builds the AdamW from
    its param groups (e.g. functools.partial(torch.optim.AdamW, betas=(0.9, 0.95)), or
    fmoe's AdamW); `muon_cls` the Muon (e.g. functools.partial(fmoe.parallel.DistributedMuon,
    model=model) for a sharded model); `muon_kwargs` go to it (momentum, nesterov, ns_steps,
    scale, ns_dtype).
    """
    muon_groups, adamw_groups = split_param_groups(
        model, muon_lr=muon_lr, adamw_lr=adamw_lr, weight_decay=weight_decay, adamw_patterns=adamw_patterns,
        decay_embeddings=decay_embeddings,
    )
    optimizers = []
    if muon_groups:
        optimizers.append(muon_cls(muon_groups, lr=muon_lr, **muon_kwargs))
    if adamw_groups:
        optimizers.append(adamw_cls(adamw_groups, lr=adamw_lr))
    return optimizers
