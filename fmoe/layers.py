"""Pure functional layers built from fmoe.ops: parameters and config in, (output, stats) out.

    moe(x[T,H], params, cfg) -> (y[T,H], stats)

route (optionally random or capacity-limited) -> permute -> grouped_mlp (SwiGLU experts)
-> unpermute (gate weights in float32), plus optional shared experts: a dense SwiGLU on
every token, optionally scaled by sigmoid(x . shared_gate) (Qwen-style). SPEC.md 1-3.

params (a dict or TensorDict; parameters are the caller's, nothing is kept here):
    router        [E, H] float32    router logits = x.float() @ router.T, in float32
    w_gate, w_up  [E, H, F]         routed experts, x's dtype
    w_down        [E, F, H]
    expert_bias   [E] float32       optional, sigmoid scoring: selection only
    shared_w_gate, shared_w_up [H, Fs], shared_w_down [Fs, H]   optional shared experts
    shared_gate   [H]               optional sigmoid gate on the shared output

stats (a TensorDict, batch_size []): what the losses and the bias update need and the load
numbers worth logging:
    router_logits      [T, E] float32, differentiable: z_loss(stats["router_logits"])
    aux_scores         [T, E] float32, differentiable, and aux_experts [T, k]: the inputs of
                       load_balancing_loss / seq_load_balancing_loss (when cfg.aux_scores)
    aux_counts         [E] counts of aux_experts
    tokens_per_expert  [E] int64 slots of the actual routing (after bias, groups, dropping):
                       update_expert_bias sums these over micro-batches and ranks
    load_max_over_mean, load_cv, dropped_fraction   0-D float32 (no host sync)

Legend: T tokens, H hidden, E experts, K = k slots, F expert FFN size, Fs shared FFN size.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from tensordict import TensorDict

from fmoe.ops import aux_scores as _aux_scores
from fmoe.ops import drop_by_capacity, random_logits, route
from fmoe.ops.dispatch import permute, unpermute
from fmoe.ops.experts import grouped_mlp, swiglu


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """How a MoE block routes and computes (the tensors live in params).

    n_experts, k: E experts, k per token. score, pre_softmax, n_groups, topk_groups, scale:
    as fmoe.ops.route. capacity_factor: drop slots past ceil(T k / E * factor) per expert
    (None: no dropping) with capacity_policy "probs" or "position". random_routing: route on
    N(0,1) noise instead of the logits (benchmarks). align: pad each expert's rows to a
    multiple (16/32 for fp8 grouped GEMMs). aux_scores: also compute the aux-loss scores.
    check_nan: route's NaN check (one host sync). impl: "auto" | "triton" | "torch" for
    every op.
    """

    n_experts: int
    k: int
    score: str = "softmax"
    pre_softmax: bool = False
    n_groups: Optional[int] = None
    topk_groups: Optional[int] = None
    scale: Optional[float] = None
    capacity_factor: Optional[float] = None
    capacity_policy: str = "probs"
    random_routing: bool = False
    align: int = 1
    aux_scores: bool = True
    check_nan: bool = False
    impl: str = "auto"


def _check_params(x_TH, params, cfg):
    if not isinstance(x_TH, torch.Tensor) or x_TH.ndim != 2 or not x_TH.is_floating_point():
        raise ValueError(f"x: expected a 2-D float tensor [T, H], got {getattr(x_TH, 'shape', type(x_TH).__name__)}")
    H, E = x_TH.shape[1], cfg.n_experts
    router = params.get("router")
    if router is None or router.shape != (E, H) or router.dtype != torch.float32:
        got = f"{tuple(router.shape)} {router.dtype}" if router is not None else "nothing"
        raise ValueError(f"params['router']: expected float32 [{E}, {H}] (E = cfg.n_experts, H = x's hidden size), got {got}")
    w_gate = params.get("w_gate")
    if w_gate is None or w_gate.ndim != 3 or w_gate.shape[:2] != (E, H):
        raise ValueError(f"params['w_gate']: expected [{E}, {H}, F] (E = cfg.n_experts, H = x's hidden size), got {getattr(w_gate, 'shape', None)}")
    if w_gate.dtype != x_TH.dtype:
        raise ValueError(f"params['w_gate']: dtype {w_gate.dtype} differs from x's {x_TH.dtype}")
    shared = [params.get(n) for n in ("shared_w_gate", "shared_w_up", "shared_w_down")]
    if any(s is not None for s in shared):
        if any(s is None for s in shared):
            raise ValueError("params: shared experts need all of shared_w_gate, shared_w_up, shared_w_down")
        Fs = shared[0].shape[-1]
        for name, s, shape in zip(("shared_w_gate", "shared_w_up", "shared_w_down"), shared, ((H, Fs), (H, Fs), (Fs, H))):
            if tuple(s.shape) != shape or s.dtype != x_TH.dtype:
                raise ValueError(f"params['{name}']: expected {x_TH.dtype} {list(shape)}, got {s.dtype} {list(s.shape)}")
    gate = params.get("shared_gate")
    if gate is not None and (shared[0] is None or tuple(gate.shape) != (H,)):
        raise ValueError(f"params['shared_gate']: expected [{H}] alongside the shared expert weights, got {tuple(gate.shape)}")


def shared_expert(x_TH: torch.Tensor, params, *, impl: str = "auto") -> torch.Tensor:
    """Dense SwiGLU of every token, times sigmoid(x . shared_gate) when that gate is given."""
    h_TF = swiglu(x_TH @ params["shared_w_gate"], x_TH @ params["shared_w_up"], impl=impl)
    y_TH = h_TF @ params["shared_w_down"]
    gate = params.get("shared_gate")
    if gate is not None:
        y_TH = y_TH * torch.sigmoid(x_TH @ gate)[:, None]
    return y_TH


def moe(x: torch.Tensor, params, cfg: MoEConfig):
    """A mixture-of-experts block as a pure function.

    Args:
        x: [T, H] tokens (float32 / bfloat16 / float16).
        params: dict or TensorDict, see the module docstring.
        cfg: MoEConfig.
    Returns:
        (y [T, H] in x's dtype, stats TensorDict): see the module docstring.
    """
    _check_params(x, params, cfg)
    T, E, k = x.shape[0], cfg.n_experts, cfg.k

    logits_TE = F.linear(x.float(), params["router"])  # router in float32
    routes = route(
        random_logits(logits_TE) if cfg.random_routing else logits_TE, k,
        score=cfg.score, pre_softmax=cfg.pre_softmax, n_groups=cfg.n_groups, topk_groups=cfg.topk_groups,
        expert_bias=params.get("expert_bias"), scale=cfg.scale, check_nan=cfg.check_nan, impl=cfg.impl,
    )
    if cfg.capacity_factor is not None:
        routes = drop_by_capacity(routes, E, cfg.capacity_factor, policy=cfg.capacity_policy)

    x_perm, plan = permute(x, routes.experts, E, align=cfg.align, impl=cfg.impl)
    # offsets come from our own plan: skip grouped_mlp's value check (a host sync)
    y_perm = grouped_mlp(x_perm, params["w_gate"], params["w_up"], params["w_down"], plan.offsets, check_offsets=False, impl=cfg.impl)
    y_TH = unpermute(y_perm, plan, routes.weights, impl=cfg.impl)
    if params.get("shared_w_gate") is not None:
        y_TH = y_TH + shared_expert(x, params, impl=cfg.impl)

    counts_E = plan.counts
    load_E = counts_E.float()
    stats = {
        "router_logits": logits_TE,
        "tokens_per_expert": counts_E,
        "load_max_over_mean": load_E.max() / load_E.mean().clamp(min=1e-9),
        "load_cv": load_E.std(correction=0) / load_E.mean().clamp(min=1e-9),
        "dropped_fraction": 1.0 - load_E.sum() / max(T * k, 1),
    }
    if cfg.aux_scores:
        scores_TE, experts_TK, counts = _aux_scores(logits_TE, k, score=cfg.score, return_counts=True, impl=cfg.impl)
        stats.update(aux_scores=scores_TE, aux_experts=experts_TK, aux_counts=counts)
    return y_TH, TensorDict(stats, batch_size=[])
