"""Pure functional layers built from fmoe.ops: parameters and config in, (output, stats) out.

    moe(x[T,H], params, cfg) -> (y[T,H], stats)
    attention(x[T,H], params, cfg, positions[T], cu_seqlens[n+1]) -> (y[T,H], stats)

## moe

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

## attention

Grouped-query causal self-attention over packed documents (SPEC.md 4-5): q, k, v projections,
RoPE or YaRN on the first rot_dim channels of q and k at the given positions (restarting at
0 in each document), softmax scale 1/sqrt(head_dim) or YaRN's mscale(s, mscale_all_dim)^2 /
sqrt(head_dim), and a mask that lets a token see the earlier tokens of its own document
only, so a document's outputs do not depend on what it is packed with. CUDA: FlexAttention
with a block mask built from cu_seqlens; CPU: scaled_dot_product_attention with the dense
mask (the reference). params: wq [H, n_heads*D], wk, wv [H, n_kv_heads*D], wo [n_heads*D, H].

Legend: T tokens, H hidden, E experts, K = k slots, F expert FFN size, Fs shared FFN size,
N query heads, G kv heads, D head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from tensordict import TensorDict

from fmoe.ops import aux_scores as _aux_scores
from fmoe.ops import drop_by_capacity, random_logits, route
from fmoe.ops.backend import IMPLS
from fmoe.ops.checks import check_cu_seqlens, check_index
from fmoe.ops.dispatch import permute, unpermute
from fmoe.ops.experts import grouped_mlp, swiglu
from fmoe.ops.packed import positions_from_cu_seqlens, sequence_ids
from fmoe.ops.rope import (
    apply_rope,
    rope_cos_sin,
    rope_inv_freq,
    yarn_cos_sin_scale,
    yarn_inv_freq,
    yarn_softmax_scale,
)


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


def check_expert_weights(x_TH, params, n_experts: int, *, experts: str = "experts") -> None:
    """ValueError unless params["w_gate"], ["w_up"] are [E, H, F] and ["w_down"] [E, F, H]
    in x's dtype (E = n_experts, H = x's hidden size); `experts` names what E counts in
    the message (e.g. "this rank's E/ep experts")."""
    H, E = x_TH.shape[1], n_experts
    w_gate = params.get("w_gate")
    if not isinstance(w_gate, torch.Tensor) or w_gate.ndim != 3 or w_gate.shape[:2] != (E, H):
        raise ValueError(f"params['w_gate']: expected [{E}, {H}, F] ({experts}, x's hidden size, FFN), got {getattr(w_gate, 'shape', None)}")
    F_ = w_gate.shape[2]
    for name, shape in (("w_gate", (E, H, F_)), ("w_up", (E, H, F_)), ("w_down", (E, F_, H))):
        w = params.get(name)
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != shape:
            raise ValueError(f"params['{name}']: expected {list(shape)} ({experts}, hidden, FFN), got {getattr(w, 'shape', None)}")
        if w.dtype != x_TH.dtype:
            raise ValueError(f"params['{name}']: dtype {w.dtype} differs from x's {x_TH.dtype}")


def _check_params(x_TH, params, cfg):
    if not isinstance(x_TH, torch.Tensor) or x_TH.ndim != 2 or not x_TH.is_floating_point():
        raise ValueError(f"x: expected a 2-D float tensor [T, H], got {getattr(x_TH, 'shape', type(x_TH).__name__)}")
    H, E = x_TH.shape[1], cfg.n_experts
    router = params.get("router")
    if router is None or router.shape != (E, H) or router.dtype != torch.float32:
        got = f"{tuple(router.shape)} {router.dtype}" if router is not None else "nothing"
        raise ValueError(f"params['router']: expected float32 [{E}, {H}] (E = cfg.n_experts, H = x's hidden size), got {got}")
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


def local_experts(x_TH: torch.Tensor, routes, params, cfg: MoEConfig):
    """The routed experts on this process: permute -> grouped_mlp -> unpermute.

    x [T, H], routes (weights, experts [T, k]) over cfg.n_experts experts whose stacked
    weights are params["w_gate"], ["w_up"] [E, H, F], ["w_down"] [E, F, H]. Returns
    (y [T, H], counts [E] int64 slots each expert received). This is moe()'s default
    `dispatcher`; fmoe.parallel.ExpertParallel is the expert-parallel one.
    """
    check_expert_weights(x_TH, params, cfg.n_experts)
    x_perm, plan = permute(x_TH, routes.experts, cfg.n_experts, align=cfg.align, impl=cfg.impl)
    # offsets come from our own plan: skip grouped_mlp's value check (a host sync)
    y_perm = grouped_mlp(x_perm, params["w_gate"], params["w_up"], params["w_down"], plan.offsets, check_offsets=False, impl=cfg.impl)
    return unpermute(y_perm, plan, routes.weights, impl=cfg.impl), plan.counts


def moe(x: torch.Tensor, params, cfg: MoEConfig, *, dispatcher=None):
    """A mixture-of-experts block as a pure function.

    Args:
        x: [T, H] tokens (float32 / bfloat16 / float16).
        params: dict or TensorDict, see the module docstring.
        cfg: MoEConfig.
        dispatcher: computes the routed experts, dispatcher(x, routes, params, cfg) ->
            (y [T, H], counts [E] of the slots it computed); None: local_experts (all
            experts here). fmoe.parallel.ExpertParallel spreads them over ranks, and then
            params["w_*"] hold this rank's experts only. Whoever computes the experts checks
            their weights (check_expert_weights).
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

    y_TH, counts_E = (dispatcher or local_experts)(x, routes, params, cfg)
    if params.get("shared_w_gate") is not None:
        y_TH = y_TH + shared_expert(x, params, impl=cfg.impl)

    load_E = counts_E.float()
    stats = {
        "router_logits": logits_TE,
        "tokens_per_expert": counts_E,
        "load_max_over_mean": load_E.max() / load_E.mean().clamp(min=1e-9),
        "load_cv": load_E.std(correction=0) / load_E.mean().clamp(min=1e-9),
        "dropped_fraction": (routes.experts < 0).float().mean() if T else torch.zeros((), device=x.device),
    }
    if cfg.aux_scores:
        scores_TE, experts_TK, counts = _aux_scores(logits_TE, k, score=cfg.score, return_counts=True, impl=cfg.impl)
        stats.update(aux_scores=scores_TE, aux_experts=experts_TK, aux_counts=counts)
    return y_TH, TensorDict(stats, batch_size=[])


# ----------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Grouped-query attention with RoPE or YaRN.

    n_heads, n_kv_heads, head_dim: N query heads sharing G = n_kv_heads key/value heads
    (N % G == 0) of D = head_dim. rope_base: RoPE base. rot_dim: channels of each head that
    are rotated (default all; multi-latent attention rotates a part). yarn_factor: YaRN
    context extension factor s (None: plain RoPE) over yarn_original_max_positions, with
    yarn_beta_fast / yarn_beta_slow and the mscale pair (the softmax scale uses
    yarn_mscale_all_dim). impl: "auto" (FlexAttention on CUDA, the SDPA reference on CPU),
    "flex", "torch"; the RoPE op follows "auto" / "torch".
    """

    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_base: float = 10000.0
    rot_dim: Optional[int] = None
    interleaved: bool = False
    yarn_factor: Optional[float] = None
    yarn_original_max_positions: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 1.0
    impl: str = "auto"


def rope_tables(positions: torch.Tensor, cfg: AttentionConfig):
    """(cos, sin) [T, rot_dim/2] for cfg's RoPE or YaRN at positions [T]."""
    rot = cfg.rot_dim or cfg.head_dim
    if cfg.yarn_factor is None:
        return rope_cos_sin(positions, rope_inv_freq(rot, base=cfg.rope_base).to(positions.device))
    inv_freq = yarn_inv_freq(
        rot, base=cfg.rope_base, factor=cfg.yarn_factor, original_max_positions=cfg.yarn_original_max_positions,
        beta_fast=cfg.yarn_beta_fast, beta_slow=cfg.yarn_beta_slow,
    ).to(positions.device)
    scale = yarn_cos_sin_scale(cfg.yarn_factor, mscale=cfg.yarn_mscale, mscale_all_dim=cfg.yarn_mscale_all_dim)
    return rope_cos_sin(positions, inv_freq, scale=scale)


def softmax_scale(cfg: AttentionConfig) -> float:
    """1/sqrt(D), or YaRN's mscale(s, mscale_all_dim)^2 / sqrt(D) (SPEC 4: mscale_all_dim,
    not mscale)."""
    if cfg.yarn_factor is None:
        return cfg.head_dim**-0.5
    return yarn_softmax_scale(cfg.head_dim, factor=cfg.yarn_factor, mscale_all_dim=cfg.yarn_mscale_all_dim)


_flex_compiled = None


def _flex(q_NTD, k_GTD, v_GTD, doc_T, scale):
    """FlexAttention with a causal, same-document block mask. Compiled on CUDA (the fused
    kernel); on CPU the eager path, which tests the mask against the reference."""
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def same_doc_causal(b, h, q_idx, kv_idx):
        return (doc_T[q_idx] == doc_T[kv_idx]) & (kv_idx <= q_idx)

    T = q_NTD.shape[1]
    block_mask = create_block_mask(same_doc_causal, None, None, T, T, device=q_NTD.device)
    fn = flex_attention
    if q_NTD.is_cuda:
        if _flex_compiled is None:  # compile once; a cache of the compiled kernel, not of results
            _flex_compiled = torch.compile(flex_attention)
        fn = _flex_compiled
    out = fn(q_NTD[None], k_GTD[None], v_GTD[None], block_mask=block_mask, scale=scale, enable_gqa=True)
    return out[0]


def _sdpa(q_NTD, k_GTD, v_GTD, doc_T, scale):
    T = q_NTD.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=q_NTD.device).tril()
    mask_TT = causal & (doc_T[:, None] == doc_T[None, :])
    return F.scaled_dot_product_attention(q_NTD, k_GTD, v_GTD, attn_mask=mask_TT, scale=scale, enable_gqa=True)


def _check_attention(x_TH, params, cfg, positions, cu_seqlens):
    if not isinstance(x_TH, torch.Tensor) or x_TH.ndim != 2 or not x_TH.is_floating_point():
        raise ValueError(f"x: expected a 2-D float tensor [T, H], got {getattr(x_TH, 'shape', type(x_TH).__name__)}")
    T, H = x_TH.shape
    N, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    if N < 1 or G < 1 or N % G:
        raise ValueError(f"cfg.n_kv_heads: the {N} query heads must split evenly over the kv heads, got n_kv_heads = {G}")
    rot = cfg.rot_dim or D
    if rot % 2 or rot > D:
        raise ValueError(f"cfg.rot_dim: expected an even number <= head_dim = {D}, got {rot}")
    if cfg.impl not in IMPLS + ("flex",):
        raise ValueError(f"cfg.impl: expected one of {IMPLS + ('flex',)}, got {cfg.impl!r}")
    for name, shape in (("wq", (H, N * D)), ("wk", (H, G * D)), ("wv", (H, G * D)), ("wo", (N * D, H))):
        w = params.get(name)
        if w is None or tuple(w.shape) != shape or w.dtype != x_TH.dtype:
            got = f"{w.dtype} {list(w.shape)}" if w is not None else "nothing"
            raise ValueError(f"params['{name}']: expected {x_TH.dtype} {list(shape)}, got {got}")
    check_cu_seqlens(cu_seqlens, T)
    if positions is not None:
        check_index("positions", positions, 1, "[T]")
        if positions.shape[0] != T:
            raise ValueError(f"positions: expected {T} entries (one per token), got {positions.shape[0]}")


def attention(x: torch.Tensor, params, cfg: AttentionConfig, positions: Optional[torch.Tensor], cu_seqlens: torch.Tensor):
    """Causal grouped-query self-attention over packed documents.

    Args:
        x: [T, H] packed tokens. params: wq, wk, wv, wo (module docstring).
        cfg: AttentionConfig.
        positions: [T] int positions for RoPE (None: restart at 0 in each document).
        cu_seqlens: [n + 1] int document boundaries, 0 ... T.
    Returns:
        (y [T, H] in x's dtype, stats): stats is an empty TensorDict (attention has no
        losses), kept for the layers' common (output, stats) form.
    """
    _check_attention(x, params, cfg, positions, cu_seqlens)
    T = x.shape[0]
    N, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    cu = cu_seqlens.to(x.device)
    if positions is None:
        positions = positions_from_cu_seqlens(cu)
    rope_impl = "torch" if cfg.impl == "torch" else "auto"
    cos, sin = rope_tables(positions.to(x.device), cfg)
    q_TND = apply_rope((x @ params["wq"]).view(T, N, D), cos, sin, interleaved=cfg.interleaved, impl=rope_impl)
    k_TGD = apply_rope((x @ params["wk"]).view(T, G, D), cos, sin, interleaved=cfg.interleaved, impl=rope_impl)
    v_TGD = (x @ params["wv"]).view(T, G, D)

    doc_T = sequence_ids(cu, T)
    use_flex = cfg.impl == "flex" or (cfg.impl == "auto" and x.is_cuda)
    if use_flex and not x.is_cuda and torch.is_grad_enabled() and (x.requires_grad or any(params[n].requires_grad for n in ("wq", "wk", "wv"))):
        raise ValueError("cfg.impl: FlexAttention has no backward on CPU; use impl='torch' (or 'auto') to train on CPU")
    attend = _flex if use_flex else _sdpa
    out_NTD = attend(q_TND.transpose(0, 1), k_TGD.transpose(0, 1), v_TGD.transpose(0, 1), doc_T, softmax_scale(cfg))
    y_TH = out_NTD.transpose(0, 1).reshape(T, N * D) @ params["wo"]
    return y_TH, TensorDict({}, batch_size=[])
