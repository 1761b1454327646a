"""Pure functional layers built from fmoe.ops: parameters and config in, (output, stats) out.

    moe(x[T,H], params, cfg, *, experts=None, shared=None, token_mask=None) -> (y[T,H], stats)
    attention_context(cu_seqlens[n+1], positions[T], cfg) -> AttentionContext  (once per micro-batch)
    attention_context(cu_seqlens[n+1], positions[T/cp], cfg, token_index=, kv_index=, gather_kv=)
                                              the same for this rank's tokens under context parallel
    attention(x[T,H], params, cfg, ctx) -> (y[T,H], stats)
    linear_attention(x[T,H], params, cfg, ctx) -> (y[T,H], stats)     Gated DeltaNet (section at the end), Kimi
                                              Delta Attention, LFM2's short convolution, lightning attention
    lightning_decay(n_heads, layer, n_layers) -> [n_heads]     lightning attention's constant log-decays
    alibi_slopes(n_heads, max_bias=8) -> [n_heads]             ALiBi's slope per head (attention's params["alibi"])
    dense_mlp(x[T,H], w_gate, w_up, w_down) -> y[T,H]     (w_gate None with act "relu2": no gate; optional biases)

Nothing here reads a tensor's values on the host: the forward and backward of every layer
run without a device->host sync (DESIGN.md "One micro-batch, one context"), but for the
routed experts' plain-torch reference (impl="torch", and "auto" without Triton: it reads each
expert's row offsets to slice its rows, fmoe.ops.experts; the Triton kernels do not). Values that
need checking (cu_seqlens, positions, labels) are checked once, where the batch is made
(fmoe.train.data.make_batch), and what depends only on the micro-batch (RoPE tables, the
attention mask) is built once by attention_context and passed to every attention call.

## moe

route (optionally random or capacity-limited) -> the routed experts (permute ->
grouped_mlp -> unpermute, gate weights in float32; or an expert-parallel callable) -> plus
the shared experts: a dense SwiGLU on every token, optionally scaled by
sigmoid(x . shared_gate) (Qwen-style). SPEC.md 1-3. With cfg.zero_experts = Z the router
scores E + Z choices, the last Z zero-computation experts: a slot routed to one adds its
token times the slot's weight, and only the other slots reach the routed experts (and the
capacity drop); below, the router's, the biases' and the stats' E then read E + Z.

params (a dict or TensorDict; parameters are the caller's, nothing is kept here):
    router        [E, H] float32    router logits = x.float() @ router.T, in float32
    router_bias   [E] float32       optional, added to the router logits (gpt-oss)
    router_norm   [H] float32       optional: the router reads rmsnorm(x) * router_norm / sqrt(H)
                                    (eps cfg.norm_eps; Gemma 4's router scale), not x
    expert_scale  [E] float32       optional: each slot's weight times its expert's scale, after
                                    the routing (Gemma 4's per_expert_scale)
    w_gate, w_up  [E, H, F]         routed experts, x's dtype (unless `experts` is given; no
    w_down        [E, F, H]         w_gate with cfg.glu_act "relu2": experts without a gate)
    b_gate, b_up  [E, F], b_down [E, H]   optional biases of the routed experts (gpt-oss)
    expert_bias   [E] float32       optional: selection only (added to sigmoids or probabilities)
    hash_table    [V, k] int        optional: hash routing (DeepSeek-V4's hash_moe layers): token t
                                    goes to the experts hash_table[token_ids[t]], the router's
                                    logits weighing them (fmoe.ops.hash_route; cfg.score and
                                    cfg.normalize, cfg.scale); needs moe's token_ids; not with
                                    expert_bias, sparsemixer, pre_softmax or zero experts
    shared_w_gate, shared_w_up [H, Fs], shared_w_down [Fs, H]   optional shared experts
                                    (unless `shared` is given; no shared_w_gate with "relu2")
    shared_gate   [H]               optional sigmoid gate on the shared output
    out_bias      [H]               optional bias added to the block's output (JetMoE's)
    latent_in [H, L], latent_out [L, H]   optional (both or neither): a latent MoE (Nemotron 3
                                    Super's): the routed experts read x latent_in [T, L] (their
                                    weights [E, L, F], [E, F, L]) and their sum leaves through
                                    latent_out; the router and the shared experts read x
    latent_norm   [L]               optional (with latent_in): the experts' input x latent_in
                                    RMS-normed, gain 1 + latent_norm (Muse Spark's pre_expert_norm;
                                    eps cfg.norm_eps)
    expert_out_norm [L] (or [H])    optional: each expert's output row y normed before its
                                    routing weight, y (1 + w) / rms(y (1 + w)) (Muse Spark's
                                    post_expert_norm; eps cfg.expert_out_norm_eps)

stats (a TensorDict, batch_size []): what the losses and the bias update consume:
    router_logits      [T, E] float32, differentiable: z_loss(stats["router_logits"])
    aux_scores         [T, E] float32, differentiable, and aux_experts [T, k]: the inputs of
                       load_balancing_loss / seq_load_balancing_loss (when cfg.aux_scores),
                       aux_counts [E] counts of aux_experts (the switch loss's counts)
    tokens_per_expert  [E] int64 slots of the actual routing (after bias, groups, dropping):
                       update_expert_bias sums these over micro-batches and ranks, and
                       fmoe.ops.load_stats turns them into max/mean, CV and dropped fraction

token_mask [T] bool (optional; False on padding, make_batch's token_mask): a token outside
it is not routed (every slot dropped before the capacity drop, so it takes no expert's
compute and no capacity; its output is the shared experts' alone), tokens_per_expert and
aux_counts do not count it, its aux_scores row is 0 and its aux_experts row -1
(fmoe.ops.balance.mask_tokens): load_balancing_loss(..., n_tokens=token_mask.sum()) and
seq_load_balancing_loss / z_loss(..., mask=token_mask) then leave it out exactly, as if
it were not in the batch (router_logits keep every row). The capacity stays
ceil(T k / E * capacity_factor) of all T tokens.

## attention

Grouped-query causal self-attention over packed documents (SPEC.md 4-5): q, k, v projections,
RoPE or YaRN on the first rot_dim channels of q and k at the given positions (restarting at
0 in each document), softmax scale 1/sqrt(head_dim) or YaRN's mscale(s, mscale_all_dim)^2 /
sqrt(head_dim), and a mask that lets a token see the earlier tokens of its own document
only, so a document's outputs do not depend on what it is packed with. CUDA: FlexAttention
with a block mask (built from each 128-token block's documents and indices, never the
[T, T] mask: document_mask); CPU: scaled_dot_product_attention with the dense mask (the reference).
params: wq [H, n_heads*D], wk [H, n_kv_heads*D], wv [H, n_kv_heads*Dv], wo [n_heads*Dv, H]
(Dv = AttentionConfig.v_dim, by default D); optional output
bias bo [H] and attention sinks [n_heads] (gpt-oss: a learned logit per head that joins each
query's softmax denominator and adds no value, so out = softmax-attention * sigmoid(lse -
sink), lse the log-sum-exp of the query's scores); optional ALiBi slopes alibi [n_heads]
(BLOOM's, MPT's, Falcon-RW's linear biases: head h's score of query i and key j, scaled,
gets m_h (j - i) added, i and j the tokens' indices in the context, so that in a document
key j lies i - j tokens back; alibi_slopes gives the usual m_h; with RoPE or without).

Context parallel (fmoe.parallel.context): x holds this rank's T/cp tokens, the global tokens
token_index [T/cp] of the micro-batch; after RoPE, the context's gather_kv returns the keys
and values of all T tokens, row j being global token kv_index[j]; query i sees key j iff
both lie in the same document (of the global cu_seqlens) and kv_index[j] <= token_index[i].
The mask is [T/cp, T] (a BlockMask with Q_LEN = T/cp, KV_LEN = T on the flex path). With no
CP arguments the context, the mask and the layer are the single-process ones. DeepSeek
sparse attention gathers its indexer's keys too (gather_kv), breaks its equal scores by the
keys' global order (AttentionContext.key_order) and returns this rank's share of its loss.

Legend: T tokens, H hidden, E experts, K = k slots, F expert FFN size, Fs shared FFN size,
N query heads, G kv heads, D head dim, R = rot_dim / 2 rotary frequencies.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from tensordict import TensorDict
from torch.utils.checkpoint import checkpoint

from fmoe.ops import aux_scores as _aux_scores
from fmoe.ops import drop_by_capacity, hash_route, load_balancing_loss, random_logits, route, sparsemixer_route
from fmoe.ops.backend import IMPLS, use_triton
from fmoe.ops.balance import mask_tokens, tokens_per_expert
from fmoe.ops.checks import check_bools, check_device, check_float, check_index, check_positive_int, check_token_mask
from fmoe.ops.delta import gated_delta_rule, gated_linear_attention
from fmoe.ops.dispatch import PermutePlan, permute, unpermute
from fmoe.ops.experts import EXPERT_BIASES, PLAIN_ACTS, XIELU, check_glu, grouped_matmul, grouped_mlp, plain_act, swiglu  # PLAIN_ACTS: no gate (relu2, xielu, gelu_new, gelu, relu)
from fmoe.ops.fp8 import check_fp8, check_fp8_fast_accum, matmul
from fmoe.ops.packed import roll_packed, sequence_ids
from fmoe.ops.rope import (
    apply_rope,
    llama3_inv_freq,
    longrope_inv_freq,
    rope_cos_sin,
    rope_inv_freq,
    yarn_cos_sin_scale,
    yarn_inv_freq,
    yarn_softmax_scale,
)
from fmoe.ops.routing import ROUTE_SCORES, Routes, check_sparsemixer_eps, keep_slots, split_zero_experts
from fmoe.ops.scan import selective_scan
from fmoe.ops.sparse import indexer_scores, sparse_attention, sparse_attention_probs


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """How a MoE block routes and computes (the tensors live in params).

    n_experts, k: E experts, k per token. score, pre_softmax, n_groups, topk_groups, scale,
    group_score_topk, normalize: as fmoe.ops.route (k = 1 with the default softmax over the
    chosen logits: every weight 1.0 and no gradient to the router from the output, as
    Switch-style top-1 checkpoints define it; pre_softmax=True trains the router through
    its weight; SPEC.md 1 called this a ValueError); score "sparsemixer": Phi-3.5-MoE's
    top-2 (fmoe.ops.sparsemixer_route; k = 2, none of route's other knobs) with its gap
    sparsemixer_eps, the aux scores softmax's. capacity_factor: drop slots past ceil(T k / E * factor) per expert,
    T the tokens of the micro-batch moe() is given (one data-parallel rank's, as in Megatron: a
    change of dp at a fixed global batch changes which slots drop; the whole micro-batch under
    sequence or context parallelism) (None: no dropping) with capacity_policy "probs" or "position". random_routing: route on
    N(0,1) noise instead of the logits (benchmarks). align: pad each expert's rows to a
    multiple (16/32 for fp8 grouped GEMMs). aux_scores: also compute the aux-loss scores.
    check_nan: route's NaN check (a host sync per call; off on the hot path). impl:
    "auto" | "triton" | "torch" for every op. swiglu_alpha, swiglu_limit, swiglu_offset: the
    routed experts' clamped SwiGLU (fmoe.ops.grouped_mlp's alpha, limit, offset; gpt-oss:
    1.702, 7.0, 1.0); the defaults are silu(gate) * up. shared_swiglu_limit: the shared
    experts' clamp (dense_mlp's limit; Step 3.7's share_expert; None: none);
    shared_swiglu_alpha, shared_swiglu_offset: their gate's sigmoid gain and up's offset
    (dense_mlp's alpha, offset; MiniMax-M3's 1.702, 1.0). weights_on_input: each slot's
    routing weight scales the token on its way into the expert, and the experts' outputs are
    summed unweighted: y = sum_j expert_j(w_j x) (Llama 4) instead of sum_j w_j expert_j(x).
    fp8: the routed and shared experts' forward and input-gradient GEMMs in fp8 (row-wise
    power-of-two scales, fmoe.ops.fp8_matmul; grouped_mlp's fp8). fp8_fast_accum: the
    routed experts' fp8 grouped GEMMs with the tensor cores' own accumulator on CUDA
    (grouped_mlp's fp8_fast_accum; needs fp8). logit_softcap: the router's logits l
    become c tanh(l / c) before routing, for c = logit_softcap (Laguna's
    moe_router_logit_softcapping; None: as they are); stats["router_logits"], the aux
    scores' and the z-loss's input, are the capped ones. shared_scale: the shared experts'
    output times this constant before it joins the routed one (Cohere 2 MoE's "average":
    0.5, beside a route scale of 0.5). zero_experts: Z zero-computation experts beside the
    E = n_experts computing ones (LongCat-Flash's identity experts): the router scores
    E + Z choices (n_choices), and a slot routed to a zero expert passes its token through
    times its weight, with no FLOPs (fmoe.ops.split_zero_experts); the capacity, the
    expert weights and expert parallelism count the E computing experts only.
    bias_on_logits: sigmoid scoring chooses on the logits + params["expert_bias"] instead of
    the sigmoids + it (fmoe.ops.route's bias_on_logits; Kolibri-1); the weights are the
    chosen sigmoids all the same. glu_act: the experts' gate activation, "silu" (SwiGLU)
    or "gelu_tanh" (GeGLU: GELU's tanh form, Gemma's) or "silu_cap" (the limits cap silu(gate)
    rather than gate: Step 3.7's), or one of experts without a gate (no w_gate, no
    shared_w_gate: act(x w_up) w_down): "relu2" (relu squared, Nemotron 3's), "gelu"
    (exact), "gelu_new" (GELU's tanh form) or "relu" (fmoe.ops.experts.PLAIN_ACTS), the routed and the
    shared experts' (fmoe.ops.grouped_mlp's act; not "xielu", a dense MLP's only). norm_eps:
    the router's RMSNorm's eps (params["router_norm"]), and the latent norm's
    (params["latent_norm"]). logit_scale: the router's logits times this constant before the
    cap and the routing (Muse Spark's output_multiplier); stats["router_logits"] are the
    scaled ones. expert_out_norm_eps: the eps of params["expert_out_norm"].
    """

    n_experts: int
    k: int
    score: str = "softmax"
    pre_softmax: bool = False
    n_groups: Optional[int] = None
    topk_groups: Optional[int] = None
    scale: Optional[float] = None
    group_score_topk: Optional[int] = None
    normalize: bool = True
    capacity_factor: Optional[float] = None
    capacity_policy: str = "probs"
    random_routing: bool = False
    align: int = 1
    aux_scores: bool = True
    check_nan: bool = False
    impl: str = "auto"
    swiglu_alpha: float = 1.0
    swiglu_limit: Optional[float] = None
    swiglu_offset: float = 0.0
    shared_swiglu_limit: Optional[float] = None
    shared_swiglu_alpha: float = 1.0
    shared_swiglu_offset: float = 0.0
    weights_on_input: bool = False
    fp8: bool = False
    fp8_fast_accum: bool = False
    logit_softcap: Optional[float] = None
    shared_scale: float = 1.0
    sparsemixer_eps: float = 0.01
    zero_experts: int = 0
    bias_on_logits: bool = False
    glu_act: str = "silu"
    norm_eps: float = 1e-6
    logit_scale: float = 1.0
    expert_out_norm_eps: float = 1e-6

    def __post_init__(self):
        check_positive_int("n_experts", self.n_experts)
        check_positive_int("zero_experts", self.zero_experts, 0)
        for prefix, experts in (("swiglu_", "routed"), ("shared_swiglu_", "shared")):
            alpha, limit, offset = (getattr(self, prefix + name) for name in ("alpha", "limit", "offset"))
            try:
                check_glu(alpha, limit, offset, self.glu_act)
            except ValueError as e:  # named as this config's fields
                whats = {"limit": "clamp", "alpha": "gate's sigmoid gain", "offset": "up's offset"}
                field, _, rest = str(e).partition(":")
                if field == "act":
                    raise ValueError(f"glu_act:{rest}") from None
                if field not in whats:  # a knob set where the activation has none: the first one set
                    knobs = (("limit", limit, None), ("alpha", alpha, 1.0), ("offset", offset, 0.0))
                    field = next((name for name, value, unset in knobs if value != unset), "limit")
                raise ValueError(f"{prefix}{field}: the {experts} experts' {whats[field]}, {e}") from None
        for name in ("norm_eps", "expert_out_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
        scale = self.logit_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
            raise ValueError(f"logit_scale: expected a positive finite number, got {scale!r}")
        check_sparsemixer_knobs(self.score, self.k, self.sparsemixer_eps, pre_softmax=self.pre_softmax, n_groups=self.n_groups,
                                topk_groups=self.topk_groups, scale=self.scale, group_score_topk=self.group_score_topk, normalize=self.normalize)
        if isinstance(self.shared_scale, bool) or not isinstance(self.shared_scale, (int, float)) or not 0 < self.shared_scale < math.inf:
            raise ValueError(f"shared_scale: expected a positive finite number, got {self.shared_scale!r}")
        cap = self.logit_softcap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf):
            raise ValueError(f"logit_softcap: expected None or a positive finite number, got {cap!r}")
        if self.capacity_factor is not None and (isinstance(self.capacity_factor, bool) or not isinstance(self.capacity_factor, (int, float))
                                                 or not 0 < self.capacity_factor < math.inf):
            raise ValueError(f"capacity_factor: expected None or a positive finite number, got {self.capacity_factor!r}")
        if self.capacity_policy not in ("probs", "position"):
            raise ValueError(f"capacity_policy: expected 'probs' or 'position', got {self.capacity_policy!r}")
        if self.capacity_policy != "probs" and self.capacity_factor is None:
            raise ValueError(f"capacity_policy: the slots the capacity drop keeps, needs capacity_factor (got capacity_policy="
                             f"{self.capacity_policy!r}, capacity_factor None)")
        for name in ("pre_softmax", "random_routing", "aux_scores", "check_nan"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        check_fp8(self.fp8)
        check_fp8_fast_accum(self.fp8_fast_accum, self.fp8)
        if not isinstance(self.weights_on_input, bool):
            raise ValueError(f"weights_on_input: expected a bool, got {self.weights_on_input!r}")
        if not isinstance(self.bias_on_logits, bool):
            raise ValueError(f"bias_on_logits: expected a bool, got {self.bias_on_logits!r}")
        if self.bias_on_logits and self.score != "sigmoid":
            raise ValueError(f"bias_on_logits: applies to score='sigmoid' only, got score={self.score!r}")
        # the knobs moe() would refuse at its first call, refused here (as TransformerConfig does)
        if self.impl not in IMPLS:
            raise ValueError(f"impl: expected one of {', '.join(IMPLS)}, got {self.impl!r}")
        if self.score not in (*ROUTE_SCORES, "sparsemixer"):
            raise ValueError(f"score: expected one of {', '.join((*ROUTE_SCORES, 'sparsemixer'))}, got {self.score!r}")
        check_positive_int("align", self.align)
        if self.score != "sparsemixer":  # route's knobs, checked by the op itself on no tokens (its names are these fields')
            route(torch.zeros(0, self.n_choices), self.k, score=self.score, pre_softmax=self.pre_softmax, n_groups=self.n_groups,
                  topk_groups=self.topk_groups, scale=self.scale, group_score_topk=self.group_score_topk, normalize=self.normalize,
                  check=False, impl="torch")
        elif self.n_choices < 2:  # sparsemixer_route refused it at moe()'s first call, naming its logits
            raise ValueError(f"n_experts: sparsemixer routing chooses 2 experts per token, expected n_experts + zero_experts >= 2, "
                             f"got {self.n_choices}")
        # grouped_mlp's refusal, the last check: fmoe.model.TransformerConfig, whose xIELU MLPs are dense ones, takes the rest
        if self.glu_act == "xielu":
            raise ValueError("glu_act: experts with xIELU (its learned scalars) are not built; xIELU is a dense MLP's (fmoe.layers.dense_mlp)")

    @property
    def n_choices(self) -> int:
        """The router's choices: n_experts computing experts and zero_experts after them."""
        return self.n_experts + self.zero_experts

    @property
    def glu(self) -> dict:
        """grouped_mlp's keyword arguments of the experts' SwiGLU (or GeGLU)."""
        return dict(alpha=self.swiglu_alpha, limit=self.swiglu_limit, offset=self.swiglu_offset, act=self.glu_act)


def check_sparsemixer_knobs(score: str, k: int, eps, **route_knobs) -> None:
    """ValueError naming the knob: sparsemixer routing (score "sparsemixer") chooses k = 2
    experts with none of route's other knobs (route_knobs at their defaults: pre_softmax
    False, normalize / route_normalize True, the rest None), eps >= 0; another score takes eps at its default
    0.01 (it reads no eps)."""
    if score != "sparsemixer":
        if eps != 0.01:
            raise ValueError(f"sparsemixer_eps: the gap of sparsemixer routing, needs score='sparsemixer' (got score={score!r})")
        return
    if k != 2:
        raise ValueError(f"k: sparsemixer routing chooses 2 experts per token, got k={k!r}")
    defaults = dict(pre_softmax=False, normalize=True, route_normalize=True)
    for name, value in route_knobs.items():
        if value != defaults.get(name):
            raise ValueError(f"{name}: a knob of route, not of sparsemixer routing (score='sparsemixer'), got {value!r}")
    try:
        check_sparsemixer_eps(eps)
    except ValueError as e:
        raise ValueError(f"sparsemixer_{e}") from None


def check_hash_routing(cfg: MoEConfig, table: str) -> None:
    """ValueError naming the knob: hash routing (the experts a table's, `table` naming it)
    takes none of cfg's sparsemixer score, pre_softmax and zero experts."""
    for name, bad in (("cfg.score", cfg.score == "sparsemixer"), ("cfg.pre_softmax", cfg.pre_softmax), ("cfg.zero_experts", cfg.zero_experts)):
        if bad:
            raise ValueError(f"{name}: hash routing's experts are its table's ({table}), not with {name}")


def expert_biases(params) -> dict:
    """grouped_mlp's keyword arguments of the experts' optional biases in params."""
    return {n: params[n] for n in EXPERT_BIASES if params.get(n) is not None}


def check_expert_weights(x_TH, params, n_experts: int, *, experts: str = "experts", gated: bool = True) -> None:
    """ValueError unless params["w_gate"], ["w_up"] are [E, H, F] and ["w_down"] [E, F, H]
    in x's dtype (E = n_experts, H = x's hidden size); without a gate (gated=False: act in
    PLAIN_ACTS) no w_gate. `experts` names what E counts in the message (e.g. "this rank's
    E/ep experts")."""
    H, E = x_TH.shape[1], n_experts
    first = "w_gate" if gated else "w_up"
    if not gated and params.get("w_gate") is not None:
        raise ValueError(f"params['w_gate']: experts without a gate (cfg.glu_act one of {sorted(PLAIN_ACTS)}) take none, got a tensor")
    w = params.get(first)
    if not isinstance(w, torch.Tensor) or w.ndim != 3 or w.shape[:2] != (E, H):
        raise ValueError(f"params['{first}']: expected [{E}, {H}, F] ({experts}, x's hidden size, FFN), got {getattr(w, 'shape', None)}")
    F_ = w.shape[2]
    layouts = {"w_gate": "hidden, FFN", "w_up": "hidden, FFN", "w_down": "FFN, hidden"}
    for name, shape in ((("w_gate", (E, H, F_)),) if gated else ()) + (("w_up", (E, H, F_)), ("w_down", (E, F_, H))):
        w = params.get(name)
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != shape:
            raise ValueError(f"params['{name}']: expected {list(shape)} ({experts}, {layouts[name]}; FFN {F_} as params['{first}']'s), "
                             f"got {getattr(w, 'shape', None)}")
        if w.dtype != x_TH.dtype:
            raise ValueError(f"params['{name}']: dtype {w.dtype} differs from x's {x_TH.dtype}")
    for name, shape in zip(EXPERT_BIASES, ((E, F_), (E, F_), (E, H))):
        b = params.get(name)
        if b is not None and (not isinstance(b, torch.Tensor) or tuple(b.shape) != shape or b.dtype != x_TH.dtype):
            got = f"{b.dtype} {list(b.shape)}" if isinstance(b, torch.Tensor) else type(b).__name__
            raise ValueError(f"params['{name}']: expected {x_TH.dtype} {list(shape)} ({experts}, FFN or hidden) or none, got {got}")


_SHARED = ("shared_w_gate", "shared_w_up", "shared_w_down")
# the params moe reads (its docstring); any other name is a typo that would leave its feature off
_MOE_PARAMS = frozenset({"router", "router_bias", "router_norm", "expert_scale", "expert_bias", "hash_table", "w_gate", "w_up", "w_down",
                         *EXPERT_BIASES, *_SHARED, "shared_gate", "latent_in", "latent_out", "latent_norm", "expert_out_norm", "out_bias"})


def _check_moe(x_TH, params, cfg, experts, shared, drop) -> None:
    if not isinstance(x_TH, torch.Tensor) or x_TH.ndim != 2 or not x_TH.is_floating_point():
        raise ValueError(f"x: expected a 2-D float tensor [T, H], got "
                         + (f"{x_TH.dtype} {list(x_TH.shape)}" if isinstance(x_TH, torch.Tensor) else type(x_TH).__name__))
    if not isinstance(cfg, MoEConfig):
        raise ValueError(f"cfg: expected a MoEConfig, got {type(cfg).__name__}")
    if not isinstance(params, Mapping):
        raise ValueError(f"params: expected a dict of tensors (router, w_gate, w_up, w_down, ...), got {type(params).__name__}")
    unknown = sorted(set(params) - _MOE_PARAMS)
    if unknown:
        raise ValueError(f"params: unknown MoE parameters {unknown}; expected names among {sorted(_MOE_PARAMS)}")
    for name, w in params.items():
        if w is not None and not isinstance(w, torch.Tensor):
            raise ValueError(f"params['{name}']: expected a tensor or None, got {type(w).__name__}")
    check_params_device(x_TH, params)
    H, E = x_TH.shape[1], cfg.n_choices
    what = "cfg.n_experts" if not cfg.zero_experts else "cfg.n_experts + cfg.zero_experts"
    router = params.get("router")
    if router is None or router.shape != (E, H) or router.dtype != torch.float32:
        got = f"{tuple(router.shape)} {router.dtype}" if router is not None else "nothing"
        raise ValueError(f"params['router']: expected float32 [{E}, {H}] ({what}, x's hidden size), got {got}")
    for name, shape in (("router_bias", (E,)), ("router_norm", (H,)), ("expert_scale", (E,))):
        w = params.get(name)
        if w is not None and (w.shape != shape or w.dtype != torch.float32):
            raise ValueError(f"params['{name}']: expected float32 [{shape[0]}] or none, got {w.dtype} {list(w.shape)}")
    for name, fn in (("experts", experts), ("shared", shared), ("drop", drop)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name}: expected a callable or None, got {type(fn).__name__}")
    weights = [params.get(n) for n in _SHARED]
    if shared is not None and any(w is not None for w in weights):
        raise ValueError("shared: given together with params['shared_w_*']; pass one or the other")
    if shared is None and any(w is not None for w in weights):
        gated = cfg.glu_act not in PLAIN_ACTS  # without a gate: no shared_w_gate either
        if gated and any(w is None for w in weights) or not gated and (weights[0] is not None or any(w is None for w in weights[1:])):
            raise ValueError("params: shared experts need all of " + ("shared_w_gate, " if gated else "") + "shared_w_up, shared_w_down"
                             + ("" if gated else f" (no shared_w_gate: cfg.glu_act {cfg.glu_act!r} has no gate)"))
        Fs = weights[1].shape[-1]
        for name, w, shape in zip(_SHARED, weights, ((H, Fs), (H, Fs), (Fs, H))):
            if w is not None and (tuple(w.shape) != shape or w.dtype != x_TH.dtype):
                raise ValueError(f"params['{name}']: expected {x_TH.dtype} {list(shape)}, got {w.dtype} {list(w.shape)}")
    latent = [params.get(n) for n in ("latent_in", "latent_out")]
    if any(w is not None for w in latent):
        L = latent[0].shape[-1] if latent[0] is not None else latent[1].shape[0]
        for name, w, shape in zip(("latent_in", "latent_out"), latent, ((H, L), (L, H))):
            if w is None or tuple(w.shape) != shape or w.dtype != x_TH.dtype:
                got = f"{w.dtype} {list(w.shape)}" if isinstance(w, torch.Tensor) else "none"
                raise ValueError(f"params['{name}']: a latent MoE needs latent_in [H, L] and latent_out [L, H] in x's dtype {x_TH.dtype}, "
                                 f"expected {list(shape)}, got {got}")
    L = latent[0].shape[-1] if latent[0] is not None else H  # the experts' width
    for name, width, what in (("latent_norm", None if latent[0] is None else L, "a latent MoE's (latent_in) experts' width"),
                              ("expert_out_norm", L, "the experts' output width")):
        w = params.get(name)
        if w is not None and (width is None or tuple(w.shape) != (width,)):
            raise ValueError(f"params['{name}']: expected [{width}] ({what}) or none, got {list(w.shape)}"
                             if width is not None else f"params['{name}']: the norm of a latent MoE's experts' input, needs params['latent_in']")
    gate = params.get("shared_gate")
    has_shared = shared is not None or weights[1] is not None
    if gate is not None and not has_shared:
        raise ValueError("params['shared_gate']: the gate of shared experts, needs them (params['shared_w_*'] or shared=)")
    if gate is not None and tuple(gate.shape) != (H,):
        raise ValueError(f"params['shared_gate']: expected [{H}], got {tuple(gate.shape)}")
    bias = params.get("out_bias")
    if bias is not None and (tuple(bias.shape) != (H,) or not bias.is_floating_point()):
        raise ValueError(f"params['out_bias']: expected a float [{H}] bias on the block's output or none, got {bias.dtype} {list(bias.shape)}")


def check_params_device(x: torch.Tensor, params: Mapping) -> None:
    """ValueError naming the first tensor of params (a layer's weights) on another device than
    x: a weight left on the meta device gave uninitialised memory with a CPU x (torch's
    matmul of the two), others a RuntimeError deep in torch."""
    for name, w in params.items():
        if isinstance(w, torch.Tensor) and w.device != x.device:
            raise ValueError(f"params['{name}']: expected device {x.device} like x, got {w.device}"
                             + (" (a weight never materialised: fmoe.parallel.materialize, or to_empty and reset_parameters)"
                                if w.is_meta else ""))


def _check_dense_weights(x_TH, w_gate_HF, w_up_HF, w_down_FH, *, gated: bool) -> None:
    """ValueError unless x is [T, H] and w_gate (when gated), w_up [H, F], w_down [F, H], all in x's dtype."""
    if not isinstance(x_TH, torch.Tensor) or x_TH.ndim != 2:
        raise ValueError(f"x: expected a tensor [T, H], got {list(x_TH.shape) if isinstance(x_TH, torch.Tensor) else type(x_TH).__name__}")
    H = x_TH.shape[1]
    if gated and w_gate_HF is None:
        raise ValueError("w_gate: a gated MLP's (act a GLU's) gate weight [H, F] is required, got None")
    w = w_up_HF
    if not isinstance(w, torch.Tensor) or w.ndim != 2 or w.shape[0] != H:
        raise ValueError(f"w_up: expected [{H}, F] (x's hidden size, FFN), got {list(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    F_ = w.shape[1]
    for name, w, shape in (("w_gate", w_gate_HF, (H, F_)),) * gated + (("w_up", w_up_HF, (H, F_)), ("w_down", w_down_FH, (F_, H))):
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != shape:
            raise ValueError(f"{name}: expected {list(shape)} (FFN {F_} as w_up's, H {H} as x's), "
                             f"got {list(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
        if w.dtype != x_TH.dtype:
            raise ValueError(f"{name}: dtype {w.dtype} differs from x's {x_TH.dtype}")
        check_device(name, w, x_TH.device, "x")


def dense_mlp(x_TH: torch.Tensor, w_gate_HF, w_up_HF, w_down_FH, *, impl: str = "auto", fp8: bool = False, act: str = "silu",
              act_params: Optional[tuple] = None, b_gate=None, b_up=None, b_down=None, limit: Optional[float] = None, alpha: float = 1.0,
              offset: float = 0.0) -> torch.Tensor:
    """SwiGLU (silu(x w_gate) * (x w_up)) w_down: x [T, H], w_gate / w_up [H, F],
    w_down [F, H] -> [T, H]. The dense blocks' MLP and the shared experts. fp8: the
    projections by fmoe.ops.fp8_matmul. act "gelu_tanh": GeGLU, GELU's tanh form of x w_gate
    in place of silu (fmoe.ops.swiglu's act); act "relu2" (PLAIN_ACTS): no gate (w_gate
    None), relu(x w_up)^2 w_down (Arcee's, Nemotron's); act "xielu": no gate either,
    xielu(x w_up, *act_params) w_down (Apertus's; act_params: (alpha_p, alpha_n, beta, eps),
    fmoe.ops.experts.xielu). b_gate, b_up [F], b_down [H]: optional biases added to each
    projection's output (Llama's mlp_bias, Jais 2's; b_gate None without a gate). limit: the
    SwiGLU's clamp (fmoe.ops.swiglu's limit: the gate at most limit, up within +-limit; with
    act "silu_cap" silu(gate) at most limit, Step 3.7's; None: none; not without a gate).
    alpha, offset: the gate's sigmoid gain and up's offset, g sigmoid(alpha g) (u + offset)
    (fmoe.ops.swiglu's; MiniMax-M3's dense MLPs: 1.702, 1.0; not without a gate)."""
    _check_dense_weights(x_TH, w_gate_HF, w_up_HF, w_down_FH, gated=act not in PLAIN_ACTS)
    for name, b, n in (("b_gate", b_gate, w_up_HF.shape[-1]), ("b_up", b_up, w_up_HF.shape[-1]), ("b_down", b_down, w_down_FH.shape[-1])):
        if b is not None and (not isinstance(b, torch.Tensor) or tuple(b.shape) != (n,)):
            raise ValueError(f"{name}: expected None or a tensor [{n}], got {list(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__}")
        if b is not None:
            check_device(name, b, x_TH.device, "x")

    def biased(y, b):
        return y if b is None else y + b.to(y.dtype)

    if act in PLAIN_ACTS:
        if w_gate_HF is not None or b_gate is not None:
            raise ValueError(f"{'w_gate' if w_gate_HF is not None else 'b_gate'}: act {act!r} is an MLP without a gate, expected None, got a tensor")
        if limit is not None:
            raise ValueError(f"limit: the SwiGLU's clamp, not of act {act!r} (an MLP without a gate), got {limit!r}")
        if (alpha, offset) != (1.0, 0.0):
            raise ValueError(f"{'alpha' if alpha != 1.0 else 'offset'}: the SwiGLU's, not of act {act!r} (an MLP without a gate)")
        up_TF = biased(matmul(x_TH, w_up_HF, fp8=fp8, impl=impl), b_up)
        return biased(matmul(plain_act(up_TF, act, act_params), w_down_FH, fp8=fp8, impl=impl), b_down)
    gate_TF, up_TF = (biased(matmul(x_TH, w, fp8=fp8, impl=impl), b) for w, b in ((w_gate_HF, b_gate), (w_up_HF, b_up)))
    return biased(matmul(swiglu(gate_TF, up_TF, impl=impl, act=act, limit=limit, alpha=alpha, offset=offset), w_down_FH, fp8=fp8, impl=impl), b_down)


def local_experts(x_TH: torch.Tensor, routes: Routes, params, cfg: MoEConfig, *, rows: Optional[Callable] = None):
    """The routed experts on this process: permute -> grouped_mlp -> unpermute; rows (None:
    none): a function of the experts' output rows [R, H] -> [R, H], each row on its own (a
    zero row to zero), applied before their weights (moe's expert_out_norm).

    x [T, H], routes (weights, experts [T, k]) over cfg.n_experts experts whose stacked
    weights are params["w_gate"], ["w_up"] [E, H, F], ["w_down"] [E, F, H] (optional biases
    params["b_gate"], ["b_up"] [E, F], ["b_down"] [E, H]; SwiGLU options cfg.glu). Returns
    (y [T, H], counts [E] int64 slots each expert received). No host sync: the expert ids
    come from route (valid by construction) and the offsets from permute's own plan, so
    neither op re-checks their values. fmoe.parallel.ExpertParallel is the expert-parallel
    counterpart, with the same call signature.
    """
    check_expert_weights(x_TH, params, cfg.n_experts, gated=cfg.glu_act not in PLAIN_ACTS)
    x_perm, plan = permute(x_TH, routes.experts, cfg.n_experts, align=cfg.align, check=False, impl=cfg.impl)
    x_perm, weights = weigh_rows(x_perm, plan, routes.weights, cfg)
    y_perm = grouped_mlp(x_perm, params.get("w_gate"), params["w_up"], params["w_down"], plan.offsets, check=False, impl=cfg.impl,
                         fp8=cfg.fp8, fp8_fast_accum=cfg.fp8_fast_accum, **expert_biases(params), **cfg.glu)
    return unpermute(y_perm if rows is None else rows(y_perm), plan, weights, impl=cfg.impl), plan.counts


def weigh_rows(x_perm: torch.Tensor, plan, weights_TK: torch.Tensor, cfg: MoEConfig):
    """(x_perm, the weights for unpermute): unchanged without cfg.weights_on_input; with it,
    each row of x_perm [R, H] times its slot's routing weight (padding rows times 0; the
    weights' gradient flows through the product) and None for unpermute (an unweighted sum)."""
    if not cfg.weights_on_input:
        return x_perm, weights_TK
    # a padding row's slot -1 reads the 0 appended after the T k weights (on no tokens, the only one)
    w_R = F.pad(weights_TK.reshape(-1), (0, 1))[plan.slot_of_row.long()]
    return (x_perm * w_R[:, None]).to(x_perm.dtype), None


def moe(
    x: torch.Tensor,
    params,
    cfg: MoEConfig,
    *,
    experts: Optional[Callable] = None,
    shared: Optional[Callable] = None,
    drop: Optional[Callable] = None,
    token_mask: Optional[torch.Tensor] = None,
    route_x: Optional[torch.Tensor] = None,
    token_ids: Optional[torch.Tensor] = None,
):
    """A mixture-of-experts block as a pure function; no host sync.

    Args:
        x: [T, H] tokens (float32 / bfloat16 / float16).
        params: dict or TensorDict, see the module docstring.
        cfg: MoEConfig.
        experts: the routed experts, experts(x [T, H], routes) -> (y [T, H], counts [E]
            int64 of the slots computed); with params["expert_out_norm"] called with rows=
            (local_experts' rows: each expert's output row normed before its weight) too.
            None: local_experts over params["w_*"] (every expert on this process). fmoe.model.MoE passes its GroupedExperts child (an FSDP
            unit, made expert-parallel by fmoe.parallel).
        shared: the shared experts, shared(x [T, H]) -> [T, H]. None: dense_mlp over
            params["shared_w_*"] when they are given, else no shared experts. fmoe.model.MoE
            passes its DenseMLP child (tensor parallelism hooks it). Either way the
            optional gate sigmoid(x . params["shared_gate"]) scales its output here.
        drop: the capacity drop when cfg.capacity_factor is set, drop(routes, E,
            capacity_factor, policy=cfg.capacity_policy) -> Routes of the same shapes.
            None: fmoe.ops.drop_by_capacity over x's T tokens. Under sequence parallelism x
            is one rank's share of a micro-batch and fmoe.model.MoE passes
            fmoe.parallel's SequenceShard.drop_by_capacity, which drops over all of it.
        token_mask: None, or [T] bool on x's device: False on tokens that are not routed
            (padding; module docstring). None routes every token.
        route_x: the router's input [T, H] where it is not x (Gemma 4 routes on the block's
            input, its experts read that input's own norm), x's dtype and shape. None: x.
        token_ids: [T] int32 / int64, the tokens' ids: with params["hash_table"] (hash
            routing) they pick the experts, and are needed; without it, expected None. Their
            values are checked against the table only with cfg.check_nan (a host read).
    Returns:
        (y [T, H] in x's dtype, stats TensorDict): see the module docstring.
    """
    _check_moe(x, params, cfg, experts, shared, drop)
    check_token_mask("token_mask", token_mask, x.shape[0])
    if token_mask is not None:
        check_device("token_mask", token_mask, x.device, "x")
    if route_x is not None and (not isinstance(route_x, torch.Tensor) or route_x.shape != x.shape or route_x.dtype != x.dtype):
        raise ValueError(f"route_x: expected None or a {x.dtype} tensor of x's shape {tuple(x.shape)}, got "
                         f"{getattr(route_x, 'dtype', type(route_x).__name__)} {tuple(getattr(route_x, 'shape', ()))}")
    E, k, n = cfg.n_experts, cfg.k, cfg.n_choices
    table = params.get("hash_table")
    if (table is None) != (token_ids is None):
        raise ValueError("token_ids: the tokens' ids of hash routing, expected them with params['hash_table'] and None without it, got "
                         + ("None" if token_ids is None else "ids without a table"))
    if table is not None:
        if not isinstance(table, torch.Tensor) or table.ndim != 2 or table.shape[1] != k or table.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"params['hash_table']: expected an int tensor [V, {k}] (cfg.k experts per token id), got "
                             f"{getattr(table, 'dtype', type(table).__name__)} {list(getattr(table, 'shape', ()))}")
        if params.get("expert_bias") is not None:
            raise ValueError("expert_bias: hash routing's experts are its table's (params['hash_table']), not with expert_bias")
        check_hash_routing(cfg, "params['hash_table']")

    r_TH = (x if route_x is None else route_x).float()
    if params.get("router_norm") is not None:  # Gemma 4's: rmsnorm(x) times a learned scale and 1 / sqrt(H)
        r_TH = _rms_norm(r_TH, params["router_norm"] * r_TH.shape[-1] ** -0.5, cfg.norm_eps)
    with torch.autocast(r_TH.device.type, enabled=False):  # router in float32, under torch.autocast too
        logits_TE = F.linear(r_TH, params["router"], params.get("router_bias"))
    if cfg.logit_scale != 1.0:  # Muse Spark's output_multiplier
        logits_TE = logits_TE * cfg.logit_scale
    if cfg.logit_softcap is not None:  # Laguna's tanh soft cap
        logits_TE = torch.tanh(logits_TE / cfg.logit_softcap) * cfg.logit_softcap
    if table is not None:  # DeepSeek-V4's hash layers: the table chooses, the router weighs
        routes = hash_route(random_logits(logits_TE) if cfg.random_routing else logits_TE, token_ids, table, score=cfg.score,
                            normalize=cfg.normalize, scale=cfg.scale, check=cfg.check_nan)
    elif cfg.score == "sparsemixer":
        if params.get("expert_bias") is not None:
            raise ValueError("params['expert_bias']: sparsemixer routing takes no expert bias")
        routes = sparsemixer_route(random_logits(logits_TE) if cfg.random_routing else logits_TE, eps=cfg.sparsemixer_eps, check=cfg.check_nan)
    else:
        routes = route(
            random_logits(logits_TE) if cfg.random_routing else logits_TE, k,
            score=cfg.score, pre_softmax=cfg.pre_softmax, n_groups=cfg.n_groups, topk_groups=cfg.topk_groups,
            expert_bias=params.get("expert_bias"), scale=cfg.scale, check=cfg.check_nan, impl=cfg.impl,
            group_score_topk=cfg.group_score_topk, normalize=cfg.normalize, bias_on_logits=cfg.bias_on_logits,
        )
    if params.get("expert_scale") is not None:  # Gemma 4's per-expert scale of the chosen (renormalised) weights
        routes = Routes(routes.weights * params["expert_scale"][routes.experts.clamp(min=0)], routes.experts)
    if token_mask is not None:  # padding is not routed: its slots are dropped before any capacity
        routes = keep_slots(routes, token_mask[:, None])
    if cfg.zero_experts:  # the zero experts' slots pass their tokens through; the rest go on to the computing experts
        counts_Z = tokens_per_expert(routes.experts, n)[E:]
        routes, identity_T = split_zero_experts(routes, E)
    if cfg.capacity_factor is not None and drop is not None:
        routes = drop(routes, E, cfg.capacity_factor, policy=cfg.capacity_policy)
    elif cfg.capacity_factor is not None:
        routes = drop_by_capacity(routes, E, cfg.capacity_factor, policy=cfg.capacity_policy, check=False)

    latent_in, latent_out = params.get("latent_in"), params.get("latent_out")
    x_e = x if latent_in is None else matmul(x, latent_in, fp8=cfg.fp8, impl=cfg.impl)  # the routed experts' input, [T, L] in a latent MoE
    if params.get("latent_norm") is not None:  # Muse Spark's pre_expert_norm (zero-centred)
        x_e = _rms_norm(x_e, params["latent_norm"], cfg.norm_eps, zero_centered=True)
    out_norm = params.get("expert_out_norm")
    rows = None if out_norm is None else functools.partial(prescaled_rms_norm, weight=out_norm, eps=cfg.expert_out_norm_eps)
    kw = {} if rows is None else dict(rows=rows)  # an experts callable of its own takes rows= only where the MoE has the norm
    if experts is None:
        y_TH, counts_E = local_experts(x_e, routes, params, cfg, **kw)
    else:
        y_TH, counts_E = _experts_output(experts(x_e, routes, **kw), x_e, E)
    if latent_out is not None:
        y_TH = matmul(y_TH, latent_out, fp8=cfg.fp8, impl=cfg.impl)
    if cfg.zero_experts:
        y_TH = y_TH + (x * identity_T[:, None]).to(x.dtype)
        counts_E = torch.cat([counts_E, counts_Z])
    own_shared = shared is None and params.get("shared_w_up") is not None
    if own_shared:
        shared = functools.partial(dense_mlp, w_gate_HF=params.get("shared_w_gate"), w_up_HF=params["shared_w_up"],
                                   w_down_FH=params["shared_w_down"], impl=cfg.impl, fp8=cfg.fp8, act=cfg.glu_act, limit=cfg.shared_swiglu_limit,
                                   alpha=cfg.shared_swiglu_alpha, offset=cfg.shared_swiglu_offset)
    if shared is not None:
        y_shared_TH = shared(x)
        if own_shared:  # under torch.autocast the shared experts' matmuls give its dtype: y in x's, as the routed experts' is
            y_shared_TH = y_shared_TH.to(x.dtype)
        if not isinstance(y_shared_TH, torch.Tensor) or y_shared_TH.shape != x.shape or y_shared_TH.dtype != x.dtype:
            raise ValueError(f"shared: expected shared(x) -> {x.dtype} {list(x.shape)} (x's), got {_described(y_shared_TH)}")
        gate = params.get("shared_gate")
        if gate is not None:  # on the complete shared output (after any tensor-parallel sum)
            y_shared_TH = y_shared_TH * torch.sigmoid(x @ gate.to(x.dtype))[:, None]
        if cfg.shared_scale != 1.0:
            y_shared_TH = y_shared_TH * cfg.shared_scale
        y_TH = y_TH + y_shared_TH
    if params.get("out_bias") is not None:  # JetMoE's bias on the block's output
        y_TH = y_TH + params["out_bias"].to(y_TH.dtype)

    stats = {"router_logits": logits_TE, "tokens_per_expert": counts_E}
    if cfg.aux_scores:
        aux = "softmax" if cfg.score == "sparsemixer" else cfg.score  # sparsemixer's probabilities: a softmax over E
        scores_TE, experts_TK, counts = _aux_scores(logits_TE, k, score=aux, return_counts=True, impl=cfg.impl)
        if token_mask is not None:
            scores_TE, experts_TK = mask_tokens(scores_TE, experts_TK, token_mask)
            counts = tokens_per_expert(experts_TK, n)
        stats.update(aux_scores=scores_TE, aux_experts=experts_TK, aux_counts=counts)
    return y_TH, TensorDict(stats, batch_size=[])


def _described(out) -> str:
    return f"{out.dtype} {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__


def _experts_output(out, x_e: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An experts callable's (y [T, H] in x's dtype, counts [E] int), or a ValueError naming
    `experts` (a wrong shape would broadcast or mislabel the load, silently)."""
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError(f"experts: expected experts(x, routes) -> (y, counts), got {type(out).__name__}"
                         + (f" of {len(out)}" if isinstance(out, tuple) else ""))
    y, counts = out
    if not isinstance(y, torch.Tensor) or y.shape != x_e.shape or y.dtype != x_e.dtype:
        raise ValueError(f"experts: expected y {x_e.dtype} {list(x_e.shape)} (its input's), got {_described(y)}")
    if not isinstance(counts, torch.Tensor) or counts.shape != (E,) or counts.is_floating_point() or counts.dtype == torch.bool:
        raise ValueError(f"experts: expected counts, an int tensor [{E}] (slots per expert), got {_described(counts)}")
    return y, counts


# ----------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------


GATE_ACTS = ("sigmoid", "softplus")  # gated attention's gate activations (AttentionConfig.gate_act)
QK_NORMS = (None, "head", "proj", "rms", "head_layer", "layer", "head_k")  # AttentionConfig.qk_norm
TEMPERATURE_KINDS = ("log", "power")  # AttentionConfig.temperature_kind


def check_clip_qkv(clip_qkv, kv_rank) -> None:
    """ValueError unless clip_qkv is None or a finite number > 0 for grouped-query attention
    (kv_rank None): the bound that q, k and v are clamped to."""
    if clip_qkv is None:
        return
    if isinstance(clip_qkv, bool) or not isinstance(clip_qkv, (int, float)) or not 0 < clip_qkv < math.inf:
        raise ValueError(f"clip_qkv: expected None or a finite number > 0, got {clip_qkv!r}")
    if kv_rank is not None:
        raise ValueError("clip_qkv: clamps grouped-query attention's q, k and v, not multi-latent attention's")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Grouped-query attention with RoPE or YaRN.

    n_heads, n_kv_heads, head_dim: N query heads sharing G = n_kv_heads key/value heads
    (N % G == 0) of D = head_dim. rope_base: RoPE base. rot_dim: channels of each head that
    are rotated (default all; multi-latent attention rotates a part). yarn_factor: YaRN
    context extension factor s (None: plain RoPE) over yarn_original_max_positions, with
    yarn_beta_fast / yarn_beta_slow, yarn_truncate (whole-index ramp bounds; False: gpt-oss)
    and the mscale pair (the softmax scale uses yarn_mscale_all_dim). qk_norm: RMSNorm of the queries and keys before RoPE, None, "head"
    (over each head's D channels, weights q_norm / k_norm [D]: Qwen3, GLM-4.5) or "proj"
    (over the whole projection, q_norm [N D], k_norm [G D]: OLMoE) or "rms" (over each
    head's D channels without weights: x / sqrt(mean(x^2) + eps), Llama 4's L2Norm) or
    "head_layer" (a LayerNorm without bias over each head's D channels, each head with its own
    weights: q_norm [N, D], k_norm [G, D]; Cohere's Command R+) or "layer" (a LayerNorm over
    each head's D channels, one weight [D] for every head: Persimmon's) or "head_k" (over each
    head's D channels, the keys' with weights k_norm [D], the queries' without: DeepSeek-V4's
    q_b_norm beside its kv_norm), with eps norm_eps;
    qk_norm_bias: the LayerNorms' biases too, q_norm_bias and k_norm_bias of their weights'
    shapes (Chameleon's per head, Persimmon's shared); qk_norm_after_rope: the per-head norms
    after RoPE instead (Hunyuan, Llama 4).
    impl: "auto" (FlexAttention on CUDA, the SDPA reference on CPU), "flex", "torch"; the
    RoPE op follows "auto" / "torch". window: sliding-window attention, a query attends to
    the `window` newest tokens of its document, itself included (key index > query index -
    window; Mistral's, Qwen's and transformers' sliding_window); None: every earlier token.
    chunk: chunked attention, a query attends to the earlier tokens of its own chunk of
    `chunk` tokens of its document (positions p // chunk equal; Llama 4's
    attention_chunk_size); not with a window. temperature_floor: the queries are scaled by
    1 + temperature_scale * log(1 + floor((p + temperature_offset) / temperature_floor)) at
    position p (None: not): Llama 4's attention temperature tuning (floor_scale and
    attn_scale, offset 1), Mistral 4's and Ministral 3's (original_max_position_embeddings
    and llama_4_scaling_beta, offset 0); with multi-latent attention on every query channel,
    after RoPE. temperature_kind "power": the scale is (1 + (p + temperature_offset) /
    temperature_floor) ** temperature_scale instead (Beam's scalable softmax in its NoPE
    layers: floor 2048, scale 0.1, offset 1).
    scale: the softmax scale (None: 1/sqrt(head_dim), or YaRN's; Granite's attention_multiplier).
    llama3_factor: Llama 3.1's frequency-dependent RoPE scaling (None: none; not with YaRN),
    with llama3_low_freq_factor, llama3_high_freq_factor, llama3_original_max_positions
    (fmoe.ops.rope.llama3_inv_freq). linear_factor: linear position interpolation (rope type
    "linear": every frequency divided by the factor, positions read as p / factor; Gemma 3's
    global layers); None: none; not with YaRN, Llama 3.1's scaling or LongRoPE.
    longrope_short_factors: LongRoPE (Phi-3's "longrope"; None: none; not with YaRN or
    Llama 3.1's scaling): rot_dim/2 factors dividing the frequencies
    (fmoe.ops.rope.longrope_inv_freq) in a document of at most
    longrope_original_max_positions positions, cos and sin times longrope_short_scale;
    longrope_long_factors and longrope_long_scale in a longer one (None: the short ones). A
    document's length is its largest position + 1, read on the device (no host sync);
    under context parallel, its span in the global cu_seqlens (attention_context). Decoding
    switches as the sequence grows past longrope_original_max_positions, its cached keys
    keep the short factors (transformers drops such a cache; fmoe does not).
    rope_last: grouped-query attention's RoPE on the last rot_dim channels of each head, the
    first head_dim - rot_dim passing through (DeepSeek-V4's [nope | rope] heads; the local
    layers' tables' channels with local_rot_dim); needs rot_dim < head_dim. Multi-latent
    attention's rope part is already each head's last channels.
    reversed: every pair turned the other way, the tables' sin negated (NanoChat's rotate_half
    is (x2, -x1)): a rotation by -p theta, the scores' dependence on m - n mirrored.
    rope: False leaves q and k unrotated (NoPE: position only through the causal mask;
    EXAONE's global layers), the context's RoPE tables unused; grouped-query attention only.
    local_rope_base: the RoPE base of a layer with a window or a chunk: plain RoPE at this
    base there (attention_context builds those tables too), rope_base and its scaling in the
    others (per-layer-type bases: Mellum's sliding layers at 10000 beside full ones at
    500000; OLMo 3's plain sliding layers beside YaRN in the full ones); None: one set of
    tables for every layer. Not beside YaRN with a yarn_mscale_all_dim (its softmax scale,
    every layer's). local_rot_dim: with local_rope_base, the channels of each head that the
    local layers rotate where they are not rot_dim's (Laguna's sliding layers rotate all
    128 beside its full layers' 64); None: rot_dim. local_head_dim: the local layers' head
    dim where it is not head_dim (a context's config: TransformerConfig.context_config; the
    local layers' own configs have it as head_dim), local_rot_dim's bound.
    gate_act, gate_per_head: gated attention's gate (params["wg"]): the heads' outputs
    times gate_act ("sigmoid": AFMoE, Qwen3-Next; "softplus": Laguna) of x wg before wo,
    channel by channel (wg [H, N Dv]) or, with gate_per_head, one gate per head over its
    Dv channels (wg [H, N]; Laguna's default); the gate computed in float32 for softplus.
    q_latent_raw: multi-latent attention's wq_b reads the q latent both normed and as it
    is, [q_a_norm(x wq_a) | x wq_a] ([2 q_rank, N D]; A.X-K2's), the indexer the normed half;
    gate_on_q: the gate reads wq_b's input instead of x (wg [q_in, N Dv], q_in = q_rank or
    2 q_rank: A.X-K2's gate, the other half of its q_b_proj's rows); both need q_rank.
    zero_centered_norms: the q/k norms' (and the latents' norms') gain is 1 + weight
    (Qwen3-Next's zero-centred norms), not the weight. fp8: the projections (q, k, v, o, the
    output gate's, multi-latent attention's) by fmoe.ops.fp8_matmul: their forward and
    input-gradient GEMMs in fp8; the decode path's absorbed latent products stay as they are.
    v_dim without kv_rank: grouped-query attention's value head dim Dv where it is not
    head_dim (MiMo-V2-Flash: q/k heads of 192, values of 128; wv [H, G Dv], wo [N Dv, H]);
    None: head_dim. v_scale: the values times this constant (MiMo-V2-Flash's
    attention_value_scale; grouped-query attention only). clip_qkv: q, k and v each clamped
    to [-clip_qkv, clip_qkv] right after their projections (biases included), before any
    norm or RoPE (DBRX's clip_qkv); None: not clamped; grouped-query attention only.
    v_norm: the values RMS-normed over each head's channels, without weights (Gemma 4's
    v_norm); out_norm: each head's attention output RMS-normed over its channels without
    weights, before the output gate and wo (Muse Spark's o_norm); k_eq_v: no wv, the values are the keys' projection x wk (with bk) as it comes,
    before the keys' norm and RoPE (Gemma 4's attention_k_eq_v in its global layers); both
    grouped-query attention only. rope_proportion p: proportional RoPE (Gemma 4's global
    layers): the frequencies base^(-2i / D) of a RoPE over every channel of each head (halves),
    only the first int(p D / 2) of them turning, the rest zero (those channel pairs stay as
    they are); None: all of them turn; not with YaRN, Llama 3.1's scaling, LongRoPE or a
    rot_dim (linear_factor divides them too). score_softcap c: each score (q . k times the softmax
    scale) becomes c tanh(score / c) before the softmax (Gemma 2's attn_logit_softcapping);
    None: as it is; not with DeepSeek sparse attention.

    A q latent on grouped-query attention (DeepSeek-V4's) when q_rank is set without kv_rank:
    the queries x wq_a [H, q_rank], RMS-normed with weights q_a_norm [q_rank] (eps
    latent_norm_eps), times wq_b [q_rank, N D] (params in place of wq); bq, clip_qkv and
    qk_norm act on wq_b's output as on wq's. Not with a mixture of attention heads.

    Multi-head latent attention (DeepSeek-V2/V3) when kv_rank is set: keys and values come
    from a kv_rank latent (RMSNorm'd, eps latent_norm_eps) expanded per head, plus one
    rotary key of rot_dim channels shared by every head; queries from a full projection or,
    with q_rank, a q_rank latent. head_dim is the q/k head dim (nope + rope: the softmax
    scale's), rot_dim the rope part (the last rot_dim channels of each query head), v_dim
    the value head dim; n_kv_heads must equal n_heads and qk_norm be None. latent_scales
    (with q_rank; None: none): (sq, skv), every query channel times sq before RoPE and the
    normed kv latent times skv (the keys' and the values' source, and what a cache of
    latents holds): LongCat-Flash's sqrt(hidden / q_rank), sqrt(hidden / kv_rank). rope=False (a NoPE
    block: Kimi Linear's) uses the rope part of the queries and of the shared key unrotated.

    DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5) when index_topk is set, on
    multi-latent attention with a q latent (q_rank): each query attends to the index_topk
    keys, among those its mask allows, that a lightning indexer scores highest (all of them
    when it allows fewer). The indexer has index_heads query heads of index_head_dim, made
    from the normed q latent (index_wq), one key per token (index_wk, then a LayerNorm of
    weight index_k_norm and bias index_k_bias, eps index_norm_eps: 1e-6, HY-V4's
    rms_norm_eps) and per-token head weights (index_w); RoPE on the first rot_dim channels
    of its queries and key (the last ones with index_rope_last: HY-V4's; on interleaved
    pairs with index_interleaved: GLM-5's; halves: DeepSeek-V3.2's). A key s's score for
    query t is sum_h w[t, h] / sqrt(index_heads) * relu(q[t, h] . k[s] / sqrt(index_head_dim)),
    in float32 (fmoe.layers.index_scores). The choice is discrete: the indexer's weights get
    no gradient from the attention output. DSA trains them with a loss of their own:
    with index_loss (and gradients on) attention returns it as stats["index_loss"]
    (fmoe.layers.index_loss: the KL divergence of the indexer's distribution over the chosen
    keys from the attention's, summed over heads), whose gradient reaches the indexer's
    weights only; add it to the loss (fmoe.model.Attention adds its gradient in the backward,
    attach_loss). index_shared: a layer without an indexer, which attends to the keys
    an earlier layer chose (attention's index_choice, that layer's stats["index_choice"]:
    GLM-5's "shared" layers). The
    choice is each query's slots of key indices ([T, index_topk], fmoe.layers.index_slots).
    Where Triton runs (impl "auto" on CUDA, "triton") a query attends to its chosen keys alone,
    in training and in decoding (its chosen rows of the cache): fmoe.ops.sparse_attention over
    the absorbed form (each head's query moved into the latent space, the latent and rotated
    key shared by every head), O(T index_topk) work. impl
    "torch" (and "auto" off CUDA) is the dense reference: SDPA under the choice as a [T, S]
    mask ("flex" is refused). The indexer scores every allowed key, as DeepSeek's does, for
    blocks of queries (never a [T, index_heads, S] product at once); its loss runs over the
    chosen keys alone, block by block, each block recomputed in the backward.

    Block-sparse attention (MiniMax-M3's) when index_topk_blocks is set, on grouped-query
    attention: the keys of a document are cut into blocks of index_block_size positions, and
    each query's heads of kv head g attend only to the keys (its mask allows) of the
    index_topk_blocks blocks that indexer head g scores highest, the index_local_blocks
    blocks ending at the query's own always among them. The indexer has index_heads =
    n_kv_heads heads of index_head_dim: queries x index_wq [H, index_heads index_head_dim]
    and one key per token x index_wk [H, index_head_dim], each RMS-normed (index_q_norm,
    index_k_norm [index_head_dim]; eps norm_eps, gain 1 + weight with zero_centered_norms)
    and rotated on its first rot_dim channels as the heads are; a block's score is the
    largest q . k of its keys the query may see (float32; block_index_choice). The choice is
    discrete: the indexer's weights get no gradient from the attention output; with index_loss
    (and gradients on) attention returns stats["index_loss"] (block_index_loss: for each query
    and kv head the KL divergence of the indexer's softmax over the chosen blocks' scores,
    over sqrt(index_head_dim), from the heads' attention mass on them), whose gradient reaches
    the indexer's weights alone, as DeepSeek sparse attention's does. Blocks are counted from
    each document's start (document_offsets: the same split in one process, under context
    parallel and in decoding); equal scores go to the earlier block. Where Triton runs (impl
    "auto" on CUDA, "triton") each query's heads attend to the keys of their chosen blocks
    alone (block_index_slots; fmoe.ops.sparse_attention kv head by kv head, its rows [v | k]:
    O(T index_topk_blocks index_block_size) work), the context keeping the mask as its rule
    (MaskRows); impl "torch" (and "auto" off CUDA) is the dense reference, SDPA under a
    [kv head, T, S] mask ("flex" refused). Not with a window, a chunk, a softcap, sinks or
    ALiBi.

    Mixture of attention heads (JetMoE's MoA) when moa_experts is set, on grouped-query
    attention: E = moa_experts attention experts, each owning a query projection wq[e]
    [H, G D] and an output projection wo[e] [G D, H] (params wq [E, H, G D], wo [E, G D, H]),
    and a router moa_router [H, E]. Each token's router logits x moa_router (float32) choose
    its moa_topk = k experts, weighted by the softmax over the k chosen logits
    (fmoe.ops.route's default); slot j's expert makes G query heads, which attend with the G
    shared kv heads (x wk, x wv), and its output projection maps their outputs back; the
    token's output is the weighted sum over its slots (plus bo). n_heads = k G: head g k + j
    is slot j's query head for kv head g (fmoe's grouped order). The projections run as
    routed linear layers (fmoe.ops.permute, grouped_matmul, unpermute: no host sync), so each
    token pays for k of the E experts. With gradients on attention returns
    stats["moa_aux_loss"], the router's switch load-balancing loss over x's tokens
    (fmoe.ops.load_balancing_loss of aux_scores; under context parallel, ctx.linear_cp, this
    rank's share of the loss over every rank's tokens: the counts summed over the cp ranks,
    the shares adding up to one process's loss); fmoe.model.Attention adds its gradient.
    Not with kv_rank, the indexers, fp8, qk_norm "proj" or "head_layer", query biases or the
    output gate.

    Grouped output projection (DeepSeek-V4's) when o_groups g and o_rank r are set: the heads'
    outputs [T, N Dv] split into g groups of N / g contiguous heads, each group projected to r
    channels by its own wo_a[i] [N Dv / g, r], and the g r channels to H by wo [g r, H]
    (params wo_a [g, N Dv / g, r] beside wo; out_shapes), in place of wo [N Dv, H]. Either
    attention kind; not with a mixture of attention heads or fp8.

    Shared key-value heads (DeepSeek-V4's) when kv_shared: no wv; each kv head's values are its
    keys as attention reads them, after their norm and RoPE (v = k), and each head's output is
    rotated back at its query's position (the layer's RoPE tables with the sine negated: the
    inverse rotation, with scaled tables, YaRN's or LongRoPE's, that scale once more, as
    DeepSeek-V4's code does), so what a key gives through its value turns with the distance
    from the query alone. Grouped-query attention only; not with k_eq_v, v_dim, v_norm, v_scale, a
    mixture of attention heads or block-sparse attention. With one kv head, a dense mask and
    a window or compressed entries (DeepSeek-V4's layers), where Triton runs (impl "auto" on
    CUDA, "triton") each query attends to the keys of its window and the entries it sees (or
    chose) alone: fmoe.ops.sparse_attention over the rows [keys, entries], every head reading
    the same, the sinks applied as sigmoid(lse - sink) (O(T (window + entries)) work, no
    [N, T, S] scores); the dense reference elsewhere, over blocks of queries with sinks.

    Heavily compressed attention (DeepSeek-V4's HCA) when compress_rate m is set, on shared
    key-value heads with one kv head: besides its keys (under the layer's own mask: its
    window), each query attends to compressed entries, one per complete run of m tokens of
    its document (tokens j m .. (j + 1) m - 1 of the document), the entry of run j seen by
    the queries at positions >= (j + 1) m - 1. Entry j is sum_i softmax_i(g_i + b_i) c_i over
    the run's tokens i, channel by channel (float32 weights), c = x compress_wkv and g = x
    compress_wg [H, D], b = compress_bias [m, D] (float32, by place in the run), RMS-normed
    with weight compress_norm [D] (eps norm_eps) and rotated as the keys are at position j m;
    it is its own value (kv_shared). The softmax spans the keys, the entries and the sinks.
    The run's slots are T // m (a bound known without reading the documents' lengths: no
    host sync), the unused ones masked. The context holds a dense mask; the sparse kernel
    attends where Triton runs (above), the dense reference elsewhere; in decoding the cache
    keeps the entries and the open run's inputs (ctx.compressed); under context parallel
    (ctx.gather_kv with the split's token_index and kv_index) every rank's compressor inputs
    are gathered and each rank makes the whole micro-batch's entries (compressed_entries);
    not with a softcap or ALiBi.

    Compressed sparse attention (DeepSeek-V4's CSA) when compress_topk is set beside
    compress_rate m: the entries overlap, entry j of a document a softmax over 2 m slots, the
    first half of the channels of the previous run's tokens (c_a, g_a: none for run 0) and the
    second half of run j's (c_b, g_b), c = x compress_wkv, g = x compress_wg [H, 2 D], b =
    compress_bias [m, 2 D] (its first D columns the previous run's, its last D run j's), then
    normed and rotated as above (at j m); each query attends to the compress_topk entries it
    sees of highest lightning-indexer score (fmoe.layers.index_scores: heads index_heads of
    index_head_dim from the normed q latent, index_wq [q_rank, index_heads index_head_dim],
    weighed by x index_w [H, index_heads]) against the indexer's own entries, made the same
    way by index_compress_wkv, index_compress_wg [H, 2 index_head_dim], index_compress_bias
    [m, 2 index_head_dim] (float32) and index_compress_norm [index_head_dim]; its queries and
    entries rotated on their last rot_dim channels with index_rope_last, in pairs with
    index_interleaved; equal scores go to the earlier entry. The choice is discrete: the
    indexer's weights get no gradient from the attention output; with index_loss (and
    gradients on) attention returns stats["index_loss"], DeepSeek sparse attention's loss
    over the chosen entries (fmoe.layers.index_loss: the KL divergence of the indexer's
    distribution over each query's chosen entries from the attention's, its heads'
    probabilities of them summed, the sinks' share in their softmax), whose gradient reaches
    the indexer's weights alone (its queries' index_wq, index_w, and its compressor's through
    its entries); without it the indexer's weights stay as loaded. Needs q_rank; not with
    index_topk or index_topk_blocks; in decoding the cache keeps both compressors' entries and
    the inputs of the last complete and the open run (ctx.compressed); under context parallel
    both compressors' inputs are gathered in one all-gather, as above.
    """

    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_base: float = 10000.0
    rot_dim: Optional[int] = None
    interleaved: bool = False
    rope_last: bool = False
    reversed: bool = False
    yarn_factor: Optional[float] = None
    yarn_original_max_positions: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 1.0
    yarn_truncate: bool = True
    qk_norm: Optional[str] = None
    qk_norm_bias: bool = False
    norm_eps: float = 1e-6
    impl: str = "auto"
    q_rank: Optional[int] = None
    kv_rank: Optional[int] = None
    v_dim: Optional[int] = None
    latent_scales: Optional[tuple[float, float]] = None
    latent_norm_eps: float = 1e-6
    q_latent_raw: bool = False
    gate_on_q: bool = False
    window: Optional[int] = None
    scale: Optional[float] = None
    qk_norm_after_rope: bool = False
    rope: bool = True
    llama3_factor: Optional[float] = None
    llama3_low_freq_factor: float = 1.0
    llama3_high_freq_factor: float = 4.0
    llama3_original_max_positions: int = 8192
    linear_factor: Optional[float] = None
    longrope_short_factors: Optional[tuple[float, ...]] = None
    longrope_long_factors: Optional[tuple[float, ...]] = None
    longrope_original_max_positions: int = 4096
    longrope_short_scale: float = 1.0
    longrope_long_scale: float = 1.0
    chunk: Optional[int] = None
    temperature_floor: Optional[int] = None
    temperature_scale: float = 0.1
    temperature_offset: int = 1
    temperature_kind: str = "log"
    local_rope_base: Optional[float] = None
    zero_centered_norms: bool = False
    v_scale: float = 1.0
    clip_qkv: Optional[float] = None
    v_norm: bool = False
    out_norm: bool = False
    k_eq_v: bool = False
    rope_proportion: Optional[float] = None
    score_softcap: Optional[float] = None
    local_rot_dim: Optional[int] = None
    local_head_dim: Optional[int] = None
    gate_act: str = "sigmoid"
    gate_per_head: bool = False
    fp8: bool = False
    index_topk: Optional[int] = None
    index_heads: int = 64
    index_head_dim: int = 128
    index_interleaved: bool = False
    index_rope_last: bool = False
    index_norm_eps: float = 1e-6
    index_loss: bool = False
    index_shared: bool = False
    index_topk_blocks: Optional[int] = None
    index_block_size: int = 128
    index_local_blocks: int = 1
    moa_experts: Optional[int] = None
    moa_topk: int = 1
    o_groups: Optional[int] = None
    o_rank: Optional[int] = None
    kv_shared: bool = False
    compress_rate: Optional[int] = None
    compress_topk: Optional[int] = None

    def __post_init__(self):
        for name in ("n_heads", "n_kv_heads", "head_dim"):
            check_positive_int(name, getattr(self, name))
        check_fp8(self.fp8)
        self._check_index_knobs()
        self._check_moa_knobs()
        self._check_out_groups()
        self._check_kv_shared()
        self._check_compress()
        # a "False" read from a config turned reversed and qk_norm_after_rope on; a NaN or negative eps made every norm NaN
        check_bools(zero_centered_norms=self.zero_centered_norms, interleaved=self.interleaved, reversed=self.reversed,
                    qk_norm_after_rope=self.qk_norm_after_rope)
        for name in ("norm_eps", "latent_norm_eps"):
            eps = getattr(self, name)
            if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
                raise ValueError(f"{name}: expected a positive finite number, got {eps!r}")
        if self.rot_dim is not None and (isinstance(self.rot_dim, bool) or not isinstance(self.rot_dim, int) or self.rot_dim < 2):
            raise ValueError(f"rot_dim: expected an even int >= 2, or None (every channel; rope=False rotates none), got {self.rot_dim!r}")
        # what attention() and attention_context() would refuse at their first call, refused here
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads: the {self.n_heads} query heads must split evenly over the kv heads, got n_kv_heads = {self.n_kv_heads}")
        if self.rot_dim is not None and self.rot_dim > self.head_dim:
            raise ValueError(f"rot_dim: expected an even number <= head_dim = {self.head_dim}, got {self.rot_dim}")
        if self.impl not in (*IMPLS, "flex"):
            raise ValueError(f"impl: expected one of {', '.join((*IMPLS, 'flex'))}, got {self.impl!r}")
        if self.local_rope_base is not None:
            if isinstance(self.local_rope_base, bool) or not isinstance(self.local_rope_base, (int, float)) or not 1 < self.local_rope_base < math.inf:
                raise ValueError(f"local_rope_base: expected None or a finite number > 1, got {self.local_rope_base!r}")
            if self.yarn_factor is not None and self.yarn_mscale_all_dim:
                raise ValueError("local_rope_base: plain RoPE in the local layers is not built beside YaRN with a yarn_mscale_all_dim "
                                 "(its softmax scale is every layer's)")
        if self.local_rot_dim is not None:
            if self.local_rope_base is None:
                raise ValueError("local_rot_dim: the channels the local layers' own RoPE rotates, needs local_rope_base")
            # at most the local layers' head dim: head_dim, or TransformerConfig.local_head_dim (checked there)
            top = self.head_dim if self.local_head_dim is None else self.local_head_dim
            if isinstance(self.local_rot_dim, bool) or not isinstance(self.local_rot_dim, int) or not 2 <= self.local_rot_dim <= top \
                    or self.local_rot_dim % 2:
                raise ValueError(f"local_rot_dim: expected an even int in 2..head_dim = {top}, or None, got {self.local_rot_dim!r}")
            if self.rope_last is True and not self.local_rot_dim < top:  # rope_last's rule for the local layers' tables (it failed at the first forward)
                raise ValueError(f"local_rot_dim: with rope_last the local layers turn the last {self.local_rot_dim} channels of each head, "
                                 f"which needs fewer than their head_dim = {top}")
        if self.gate_act not in GATE_ACTS:
            raise ValueError(f"gate_act: expected one of {', '.join(GATE_ACTS)}, got {self.gate_act!r}")
        if not isinstance(self.gate_per_head, bool):
            raise ValueError(f"gate_per_head: expected a bool, got {self.gate_per_head!r}")
        if self.llama3_factor is not None:
            if self.yarn_factor is not None:
                raise ValueError("llama3_factor: one RoPE scaling at a time, not with yarn_factor")
            try:  # the knobs, checked by the op and named as this config's fields
                llama3_inv_freq(2, base=self.rope_base, **self._llama3())
            except ValueError as e:
                name, rest = str(e).split(":", 1)
                raise ValueError(f"{'rope_base' if name == 'base' else 'llama3_' + name}:{rest}") from None
        self._check_longrope_knobs()
        if not isinstance(self.out_norm, bool) or (self.out_norm and self.kv_rank is not None):
            raise ValueError(f"out_norm: each grouped-query attention head's output normed (a bool; True needs kv_rank None), got {self.out_norm!r}")
        for name in ("v_norm", "k_eq_v"):
            if not isinstance(getattr(self, name), bool) or (getattr(self, name) and (self.kv_rank is not None or self.v_dim is not None)):
                raise ValueError(f"{name}: a knob of grouped-query attention's values (a bool; True needs kv_rank and v_dim None), "
                                 f"got {getattr(self, name)!r}")
        cap = self.score_softcap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf or self.index_topk is not None):
            raise ValueError(f"score_softcap: expected None or a positive finite number, without index_topk (the sparse kernel has no cap), "
                             f"got {cap!r}")
        p = self.rope_proportion
        if p is not None:
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
                raise ValueError(f"rope_proportion: expected None or a number in (0, 1] (the share of the frequencies that turn), got {p!r}")
            if self.yarn_factor is not None or self.llama3_factor is not None or self.longrope_short_factors is not None or self.rot_dim is not None:
                raise ValueError("rope_proportion: proportional RoPE over every channel of each head, not with yarn_factor, llama3_factor, "
                                 "longrope_short_factors or a rot_dim")
        if self.linear_factor is not None:
            f = self.linear_factor
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < math.inf:
                raise ValueError(f"linear_factor: expected None or a positive finite number (positions read as p / factor), got {f!r}")
            if self.yarn_factor is not None or self.llama3_factor is not None or self.longrope_short_factors is not None:
                raise ValueError("linear_factor: one RoPE scaling at a time, not with yarn_factor, llama3_factor or longrope_short_factors")
        if self.qk_norm_after_rope and self.qk_norm not in ("head", "rms", "head_k"):
            raise ValueError(f"qk_norm_after_rope: needs per-head norms (qk_norm 'head', 'rms' or 'head_k'), got qk_norm={self.qk_norm!r}")
        if self.scale is not None and (isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not 0 < self.scale < math.inf):
            raise ValueError(f"scale: expected None or a positive finite number, got {self.scale!r}")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm: expected None, 'head', 'proj', 'rms', 'head_layer', 'layer' or 'head_k', got {self.qk_norm!r}")
        if self.qk_norm in ("head_layer", "layer") and self.zero_centered_norms:
            raise ValueError(f"zero_centered_norms: a gain of 1 + weight in RMSNorms, not in the LayerNorms of qk_norm {self.qk_norm!r}")
        if not isinstance(self.qk_norm_bias, bool) or (self.qk_norm_bias and self.qk_norm not in ("head_layer", "layer")):
            raise ValueError(f"qk_norm_bias: the q/k LayerNorms' biases (a bool; True needs qk_norm 'head_layer' or 'layer'), got {self.qk_norm_bias!r} "
                             f"with qk_norm {self.qk_norm!r}")
        check_window(self.window)
        if self.chunk is not None:
            check_positive_int("chunk", self.chunk)
            if self.window is not None:
                raise ValueError(f"chunk: chunked attention or a sliding window, not both (window = {self.window})")
        if self.temperature_floor is not None:
            check_positive_int("temperature_floor", self.temperature_floor)
        scale = self.temperature_scale  # finite by comparisons: math.isfinite broke torch.compile(dynamic=True)'s graph (a symbolic float)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not -math.inf < scale < math.inf:
            raise ValueError(f"temperature_scale: expected a finite number, got {self.temperature_scale!r}")
        if self.temperature_offset not in (0, 1) or isinstance(self.temperature_offset, bool):
            raise ValueError(f"temperature_offset: expected 0 (Mistral 4) or 1 (Llama 4), got {self.temperature_offset!r}")
        if self.temperature_kind not in TEMPERATURE_KINDS:
            raise ValueError(f"temperature_kind: expected one of {', '.join(TEMPERATURE_KINDS)}, got {self.temperature_kind!r}")
        if not isinstance(self.rope, bool):
            raise ValueError(f"rope: expected a bool, got {self.rope!r}")
        if (self.rope or self.yarn_factor is not None) and self.llama3_factor is None and self.longrope_short_factors is None:
            _check_rope_knobs(self)  # without RoPE, YaRN's knobs still set the softmax scale
        if isinstance(self.v_scale, bool) or not isinstance(self.v_scale, (int, float)) or not 0 < self.v_scale < math.inf:
            raise ValueError(f"v_scale: expected a finite number > 0, got {self.v_scale!r}")
        check_clip_qkv(self.clip_qkv, self.kv_rank)
        if self.latent_scales is not None:
            scales = self.latent_scales
            if (not isinstance(scales, tuple) or len(scales) != 2
                    or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf for v in scales)):
                raise ValueError(f"latent_scales: expected None or two finite numbers > 0 (the queries', the kv latent's), got {scales!r}")
            if self.kv_rank is None or self.q_rank is None:
                raise ValueError("latent_scales: scales multi-latent attention's queries and kv latent, needs q_rank and kv_rank")
        for name in ("q_latent_raw", "gate_on_q"):
            if not isinstance(getattr(self, name), bool) or (getattr(self, name) and (self.q_rank is None or self.kv_rank is None)):
                raise ValueError(f"{name}: a knob of multi-latent attention's q latent, a bool, True needs q_rank and kv_rank (got {getattr(self, name)!r})")
        self._check_rope_last()
        if self.kv_rank is None:
            if self.q_rank is not None:  # grouped-query attention's q latent (DeepSeek-V4's)
                if isinstance(self.q_rank, bool) or not isinstance(self.q_rank, int) or self.q_rank < 1:
                    raise ValueError(f"q_rank: expected None or a positive int (the q latent's width), got {self.q_rank!r}")
                if self.moa_experts is not None:
                    raise ValueError("q_rank: not with a mixture of attention heads (moa_experts), whose queries are its experts' projections")
            if self.v_dim is not None and (isinstance(self.v_dim, bool) or not isinstance(self.v_dim, int) or self.v_dim < 1):
                raise ValueError(f"v_dim: expected None or a positive int (the value head dim), got {self.v_dim!r}")
            return
        if self.v_scale != 1.0:
            raise ValueError("v_scale: scales grouped-query attention's values, not multi-latent attention's")
        for name in ("kv_rank", "v_dim") + (("q_rank",) if self.q_rank is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int for multi-latent attention, got {value!r}")
        if self.n_kv_heads != self.n_heads:
            raise ValueError(f"n_kv_heads: multi-latent attention expands keys and values per head, needs n_kv_heads = n_heads = {self.n_heads}, got {self.n_kv_heads}")
        if self.rot_dim is None or not self.rot_dim < self.head_dim:
            raise ValueError(f"rot_dim: multi-latent attention rotates a part of each head, expected rot_dim < head_dim = {self.head_dim}, got {self.rot_dim}")
        if self.qk_norm is not None:
            raise ValueError("qk_norm: not with multi-latent attention (its latents have their own norms)")

    def _check_index_knobs(self) -> None:
        """DeepSeek sparse attention's knobs and block-sparse attention's (class docstring):
        ValueError naming the field."""
        if self.index_topk_blocks is not None:
            self._check_block_knobs()
            return
        if (self.index_block_size, self.index_local_blocks) != (128, 1):
            raise ValueError(f"{'index_block_size' if self.index_block_size != 128 else 'index_local_blocks'}: a knob of block-sparse attention, "
                             "needs index_topk_blocks")
        if self.index_topk is None and self.compress_topk is None:
            knobs = dict(index_heads=64, index_head_dim=128, index_interleaved=False, index_rope_last=False, index_norm_eps=1e-6, index_loss=False,
                         index_shared=False)
            changed = [name for name, default in knobs.items() if getattr(self, name) != default]
            if changed:
                raise ValueError(f"{changed[0]}: a knob of DeepSeek sparse attention's indexer, needs index_topk")
            return
        if self.index_topk is None:  # compressed sparse attention's indexer (compress_topk): its heads and their RoPE
            for name in ("index_heads", "index_head_dim"):
                check_positive_int(name, getattr(self, name))
            for name in ("index_interleaved", "index_rope_last", "index_loss"):
                if not isinstance(getattr(self, name), bool):
                    raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
            changed = [name for name, default in dict(index_norm_eps=1e-6, index_shared=False).items() if getattr(self, name) != default]
            if changed:
                raise ValueError(f"{changed[0]}: a knob of DeepSeek sparse attention's indexer, needs index_topk (compressed sparse attention's "
                                 "indexer has no key norm and no sharing)")
            return
        for name in ("index_topk", "index_heads", "index_head_dim"):
            check_positive_int(name, getattr(self, name))
        for name in ("index_interleaved", "index_rope_last", "index_loss", "index_shared"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        eps = self.index_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
            raise ValueError(f"index_norm_eps: expected a positive finite number, got {eps!r}")
        if self.index_shared and self.index_loss:
            raise ValueError("index_loss: a layer of index_shared has no indexer of its own to train")
        if self.kv_rank is None or self.q_rank is None:
            raise ValueError("index_topk: DeepSeek sparse attention's indexer reads the q latent of multi-latent attention, needs kv_rank and q_rank")
        if self.rot_dim is None or self.rot_dim > self.index_head_dim:
            raise ValueError(f"index_head_dim: the indexer rotates rot_dim = {self.rot_dim} of its channels, expected index_head_dim >= rot_dim, "
                             f"got {self.index_head_dim}")
        if self.impl == "flex":
            raise ValueError("impl: DeepSeek sparse attention's top-k mask is a dense mask, attended by the SDPA reference; use impl 'auto' or 'torch'")

    def _check_moa_knobs(self) -> None:
        """The mixture of attention heads' knobs (class docstring): ValueError naming the field."""
        k = self.moa_topk
        if self.moa_experts is None:
            if k != 1:
                raise ValueError(f"moa_topk: the attention experts per token of a mixture of attention heads, needs moa_experts (got {k!r})")
            return
        check_positive_int("moa_experts", self.moa_experts)
        check_positive_int("moa_topk", k, 1, self.moa_experts)
        if self.n_heads != k * self.n_kv_heads:
            raise ValueError(f"n_heads: a mixture of attention heads has moa_topk x n_kv_heads = {k * self.n_kv_heads} query heads "
                             f"(each chosen expert's query heads over the kv heads), got {self.n_heads}")
        taken = dict(kv_rank=self.kv_rank is not None, index_topk=self.index_topk is not None, index_topk_blocks=self.index_topk_blocks is not None,
                     fp8=bool(self.fp8), qk_norm=self.qk_norm in ("proj", "head_layer"))
        refused = [name for name, on in taken.items() if on] + (["o_groups"] if self.o_groups is not None else [])
        if refused:
            raise ValueError(f"{refused[0]}: not with a mixture of attention heads (moa_experts), whose query and output projections are "
                             "routed experts over grouped-query attention")

    @property
    def has_wv(self) -> bool:
        """Whether grouped-query attention has a value projection wv (not with k_eq_v or kv_shared)."""
        return not (self.k_eq_v or self.kv_shared)

    def _check_rope_last(self) -> None:
        """rope_last (class docstring): ValueError naming the field."""
        if not isinstance(self.rope_last, bool):
            raise ValueError(f"rope_last: expected a bool, got {self.rope_last!r}")
        if not self.rope_last:
            return
        if self.kv_rank is not None or self.index_topk_blocks is not None:
            raise ValueError("rope_last: RoPE on the last rot_dim channels of grouped-query attention's heads, not with kv_rank (multi-latent "
                             "attention's rope part is already its heads' last channels) or index_topk_blocks")
        if self.rot_dim is None or not self.rot_dim < self.head_dim:
            raise ValueError(f"rope_last: rotates the last rot_dim channels of each head, needs rot_dim < head_dim = {self.head_dim}, "
                             f"got rot_dim {self.rot_dim}")

    def _check_compress(self) -> None:
        """Heavily compressed attention's knob (class docstring): ValueError naming the field."""
        if self.compress_rate is None:
            if self.compress_topk is not None:
                raise ValueError("compress_topk: compressed sparse attention's entries are made every compress_rate tokens, needs compress_rate")
            return
        check_positive_int("compress_rate", self.compress_rate, 2)
        if not self.kv_shared or self.n_kv_heads != 1:
            raise ValueError(f"compress_rate: heavily compressed attention's entries are one shared key-value head's, needs kv_shared and "
                             f"n_kv_heads = 1, got kv_shared={self.kv_shared}, n_kv_heads={self.n_kv_heads}")
        if self.score_softcap is not None or self.impl == "flex":
            raise ValueError("compress_rate: heavily compressed attention runs the dense reference, not with score_softcap or impl 'flex'")
        if self.compress_topk is None:
            return
        check_positive_int("compress_topk", self.compress_topk)
        if self.q_rank is None:
            raise ValueError("compress_topk: compressed sparse attention's indexer reads the normed q latent, needs q_rank")
        rot = self.head_dim if self.rot_dim is None else self.rot_dim
        if self.rope and rot > self.index_head_dim:
            raise ValueError(f"index_head_dim: the indexer rotates rot_dim = {rot} of its channels, expected index_head_dim >= rot_dim, "
                             f"got {self.index_head_dim}")

    def _check_kv_shared(self) -> None:
        """Shared key-value heads' knob (class docstring): ValueError naming the field."""
        if not isinstance(self.kv_shared, bool):
            raise ValueError(f"kv_shared: expected a bool, got {self.kv_shared!r}")
        if not self.kv_shared:
            return
        taken = dict(k_eq_v=self.k_eq_v, v_dim=self.v_dim is not None, v_norm=self.v_norm, kv_rank=self.kv_rank is not None,
                     moa_experts=self.moa_experts is not None, index_topk_blocks=self.index_topk_blocks is not None,
                     v_scale=self.v_scale != 1.0)  # the cache, the compressed entries and the shared kernel read the keys unscaled
        refused = [name for name, on in taken.items() if on]
        if refused:
            raise ValueError(f"{refused[0]}: not with kv_shared (grouped-query attention whose values are its keys after their norm and RoPE)")

    def _check_out_groups(self) -> None:
        """The grouped output projection's knobs (class docstring): ValueError naming the field."""
        if (self.o_groups is None) != (self.o_rank is None):
            raise ValueError("o_groups and o_rank: the grouped output projection's groups and rank, give both or neither "
                             f"(got o_groups={self.o_groups!r}, o_rank={self.o_rank!r})")
        if self.o_groups is None:
            return
        check_positive_int("o_groups", self.o_groups)
        check_positive_int("o_rank", self.o_rank)
        if self.n_heads % self.o_groups:
            raise ValueError(f"o_groups: groups of whole heads, expected a divisor of n_heads = {self.n_heads}, got {self.o_groups}")
        if self.fp8:
            raise ValueError("fp8: the grouped output projection (o_groups) runs its group products in the model's dtype, not fp8")

    def _check_block_knobs(self) -> None:
        """Block-sparse attention's knobs (index_topk_blocks; class docstring)."""
        for name in ("index_topk_blocks", "index_block_size", "index_head_dim"):
            check_positive_int(name, getattr(self, name))
        local = self.index_local_blocks
        if isinstance(local, bool) or not isinstance(local, int) or not 0 <= local <= self.index_topk_blocks:
            raise ValueError(f"index_local_blocks: expected an int in [0, index_topk_blocks = {self.index_topk_blocks}] (the blocks ending at the "
                             f"query's own, always among the chosen), got {local!r}")
        if self.index_topk is not None:
            raise ValueError("index_topk_blocks: block-sparse attention, not with DeepSeek sparse attention (index_topk)")
        dsa = dict(index_interleaved=False, index_rope_last=False, index_norm_eps=1e-6, index_shared=False)
        changed = [name for name, default in dsa.items() if getattr(self, name) != default]
        if changed:
            raise ValueError(f"{changed[0]}: a knob of DeepSeek sparse attention's indexer, not of block-sparse attention (index_topk_blocks)")
        if self.kv_rank is not None:
            raise ValueError("index_topk_blocks: block-sparse attention chooses blocks per kv head of grouped-query attention, not with kv_rank")
        if self.index_heads != self.n_kv_heads:
            raise ValueError(f"index_heads: block-sparse attention's indexer has one head per kv head, expected n_kv_heads = {self.n_kv_heads}, "
                             f"got {self.index_heads}")
        rot = self.rot_dim or self.head_dim
        if rot > self.index_head_dim:
            raise ValueError(f"index_head_dim: the indexer rotates rot_dim = {rot} of its channels, expected index_head_dim >= {rot}, "
                             f"got {self.index_head_dim}")
        if not self.rope:
            raise ValueError("rope: block-sparse attention's indexer rotates its queries and keys as the heads are, not in a block without RoPE")
        if not isinstance(self.index_loss, bool):
            raise ValueError(f"index_loss: expected a bool, got {self.index_loss!r}")
        for name in ("window", "chunk", "score_softcap"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: not with block-sparse attention (index_topk_blocks), whose blocks are counted over the whole document")
        if self.impl == "flex":
            raise ValueError("impl: block-sparse attention's choice is a dense mask, attended by the SDPA reference; use impl 'auto' or 'torch'")

    def _check_longrope_knobs(self) -> None:
        """LongRoPE's knobs (class docstring): ValueError naming the field."""
        if self.longrope_short_factors is None:
            knobs = dict(longrope_long_factors=None, longrope_original_max_positions=4096, longrope_short_scale=1.0, longrope_long_scale=1.0)
            changed = [name for name, default in knobs.items() if getattr(self, name) != default]
            if changed:
                raise ValueError(f"{changed[0]}: a knob of LongRoPE, needs longrope_short_factors")
            return
        if self.yarn_factor is not None or self.llama3_factor is not None:
            other = "yarn_factor" if self.yarn_factor is not None else "llama3_factor"
            raise ValueError(f"longrope_short_factors: one RoPE scaling at a time, not with {other}")
        check_positive_int("longrope_original_max_positions", self.longrope_original_max_positions)
        for kind in ("short", "long"):
            factors = getattr(self, f"longrope_{kind}_factors")
            if factors is not None and not isinstance(factors, (tuple, list)):
                raise ValueError(f"longrope_{kind}_factors: expected a tuple of numbers, got {type(factors).__name__}")
            if isinstance(factors, list):  # a config read back from JSON: kept as a tuple (the config is hashed)
                factors = tuple(factors)
                object.__setattr__(self, f"longrope_{kind}_factors", factors)
            try:  # the factors and the base, checked by the op and named as this config's fields
                longrope_inv_freq(self.rot_dim or self.head_dim, base=self.rope_base, factors=factors or self.longrope_short_factors)
            except ValueError as e:
                name, rest = str(e).split(":", 1)
                raise ValueError(f"{'rope_base' if name == 'base' else f'longrope_{kind}_' + name}:{rest}") from None
            scale = getattr(self, f"longrope_{kind}_scale")
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
                raise ValueError(f"longrope_{kind}_scale: expected a finite number > 0, got {scale!r}")

    def _llama3(self) -> dict:
        """llama3_inv_freq's keyword arguments."""
        return dict(factor=self.llama3_factor, original_max_positions=self.llama3_original_max_positions,
                    low_freq_factor=self.llama3_low_freq_factor, high_freq_factor=self.llama3_high_freq_factor)


def check_window(window) -> None:
    """ValueError unless window is None or a positive int (a sliding window's width: the
    tokens a query attends to, itself included)."""
    if window is not None:
        check_positive_int("window", window)


@functools.lru_cache(maxsize=256)
def _check_rope_knobs(cfg: AttentionConfig) -> None:
    """The RoPE or YaRN knobs, checked by the ops on no positions and named as the config's
    fields (a layer without RoPE: YaRN's of the softmax scale alone); once per distinct config
    (each micro-batch's context and each decode step build an equal one)."""
    try:
        if cfg.rope:
            rope_tables(torch.zeros(0, dtype=torch.long), cfg)
        softmax_scale(cfg)
    except ValueError as e:
        name, rest = str(e).split(":", 1)
        field = {"base": "rope_base", "dim": "rot_dim"}.get(name, name if name.startswith("yarn_") else f"yarn_{name}")
        raise ValueError(f"{field}:{rest}") from None


def rope_tables(positions: torch.Tensor, cfg: AttentionConfig, lengths: Optional[torch.Tensor] = None):
    """(cos, sin) [T, rot_dim/2] float32 for cfg's RoPE (Llama 3.1's scaling, LongRoPE) or
    YaRN at positions [T]. lengths: LongRoPE's switch, [T] int, the length of each token's
    sequence (None: positions.max() + 1 for every token); a token of a sequence longer than
    cfg.longrope_original_max_positions gets the long factors and scale, chosen on the device.
    With cfg.reversed, sin negated."""
    cos, sin = _rope_tables(positions, cfg, lengths)
    return (cos, -sin) if cfg.reversed else (cos, sin)


def _rope_tables(positions: torch.Tensor, cfg: AttentionConfig, lengths: Optional[torch.Tensor]):
    rot = cfg.rot_dim or cfg.head_dim
    if cfg.longrope_short_factors is not None:
        short = longrope_inv_freq(rot, base=cfg.rope_base, factors=cfg.longrope_short_factors).to(positions.device)
        cos, sin = rope_cos_sin(positions, short, scale=cfg.longrope_short_scale)
        long = cfg.longrope_long_factors
        if positions.numel() == 0 or (long in (None, cfg.longrope_short_factors) and cfg.longrope_long_scale == cfg.longrope_short_scale):
            return cos, sin
        long = short if long is None else longrope_inv_freq(rot, base=cfg.rope_base, factors=long).to(positions.device)
        long_cos, long_sin = rope_cos_sin(positions, long, scale=cfg.longrope_long_scale)
        is_long = ((positions.max() + 1) if lengths is None else lengths[:, None]) > cfg.longrope_original_max_positions
        return torch.where(is_long, long_cos, cos), torch.where(is_long, long_sin, sin)
    if cfg.llama3_factor is not None:
        return rope_cos_sin(positions, llama3_inv_freq(rot, base=cfg.rope_base, **cfg._llama3()).to(positions.device))
    if cfg.yarn_factor is None:
        inv_freq = rope_inv_freq(rot, base=cfg.rope_base)
        if cfg.rope_proportion is not None:  # proportional RoPE: the first int(p D / 2) frequencies turn, the rest are zero
            inv_freq = torch.where(torch.arange(rot // 2) < int(cfg.rope_proportion * rot // 2), inv_freq, 0.0)
        return rope_cos_sin(positions, (inv_freq if cfg.linear_factor is None else inv_freq / cfg.linear_factor).to(positions.device))
    inv_freq = yarn_inv_freq(
        rot, base=cfg.rope_base, factor=cfg.yarn_factor, original_max_positions=cfg.yarn_original_max_positions,
        beta_fast=cfg.yarn_beta_fast, beta_slow=cfg.yarn_beta_slow, truncate=cfg.yarn_truncate,
    ).to(positions.device)
    scale = yarn_cos_sin_scale(cfg.yarn_factor, mscale=cfg.yarn_mscale, mscale_all_dim=cfg.yarn_mscale_all_dim)
    return rope_cos_sin(positions, inv_freq, scale=scale)


def softmax_scale(cfg: AttentionConfig) -> float:
    """cfg.scale when set, else 1/sqrt(D), or YaRN's mscale(s, mscale_all_dim)^2 / sqrt(D)
    (SPEC 4: mscale_all_dim, not mscale)."""
    if cfg.scale is not None:
        return float(cfg.scale)
    if cfg.yarn_factor is None:
        return cfg.head_dim**-0.5
    return yarn_softmax_scale(cfg.head_dim, factor=cfg.yarn_factor, mscale_all_dim=cfg.yarn_mscale_all_dim)


@dataclasses.dataclass(frozen=True)
class AttentionContext:
    """What attention needs from one micro-batch: built once by attention_context and
    shared by every attention call over the same tokens (every layer; the MTP depths share
    the mask and have their own positions, see attention_context's `mask=`).

    cos, sin: [T, R] float32 RoPE / YaRN tables at the tokens' positions.
    mask: which keys each query sees (the earlier tokens of its own document): a [T, T]
        bool tensor for the SDPA reference, or a FlexAttention BlockMask; under context
        parallel [T/cp, T] (this rank's queries, every rank's keys).
    gather_kv: keys and values from elsewhere (None: none): gather_kv(k, v) -> (k, v),
        applied to these tokens' keys [T', G, D] (after RoPE) and values, returning all the
        keys [T, G, D] the mask's columns index: under context parallel every rank's
        (fmoe.parallel.gather_kv over the cp mesh), in decoding the cached tokens' followed
        by these (fmoe.model.KVCache.write, one per layer).
    latents: multi-latent attention over a cache of latents (decoding; None: not): the keys
        and values gather_kv takes and returns are one shared head, keys [T, 1, kv_rank + R]
        (the normed latent, then the rotated key) and values [T, 1, kv_rank] (the latent).
        "absorbed": each query head is moved into the latent space by its slice of wkv_b,
        and the attention output back out by the value slice (the same function; few
        queries). "expanded": attention expands every returned latent by wkv_b into per-head
        keys and values for queries of the full head dim: the cheaper form for many queries
        at once (a prompt), and one FlexAttention can run (the absorbed keys are kv_rank + R
        wide).
    window, chunk, local_mask: the sliding window or the attention chunk the context was
        built for (attention_context's cfg.window, cfg.chunk; None: none) and its mask, of
        mask's shape and kind: what the layers whose cfg.window and cfg.chunk equal these
        use in place of mask.
    positions: [T] int, the tokens' positions (the queries' attention temperature,
        AttentionConfig.temperature_floor); None: a context built without them.
    local_rope_base, local_cos, local_sin: the local layers' RoPE base (the window's or
        chunk's layers, AttentionConfig.local_rope_base) and their [T, R] tables, which
        those layers use in place of cos and sin; None: they use cos and sin.
    cu_seqlens: [n + 1] the documents of the tokens (attention_context's), which the
        linear-attention layers restart at (linear_attention); None: a context without them.
    linear_states: decoding a linear-attention layer (LinearStates: the states its new
        tokens continue, bound per layer by fmoe.model.Transformer.decode); None otherwise.
    linear_cp: the linear-attention layers' exchange under context parallel
        (fmoe.parallel.ContextParallel: token_index(n, device), conv_halo(x, n) and
        gated_delta_rule(q, k, v, g, beta, cu_seqlens, ...)), and cp and sum_counts(counts)
        for a mixture of attention heads' balance loss; None: no split.
    index_choices: DeepSeek sparse attention (a context of a cfg with index_topk): an empty
        dict in which the layers with an indexer leave their choice of keys for the layers
        that reuse it (fmoe.model.Attention: keyed by layer, attention's index_choice); None
        otherwise.
    key_order: DeepSeek sparse attention over keys from gather_kv: [S] int64, the mask's
        columns in token order (argsort of attention_context's kv_index; the indexer's equal
        scores go to the earlier token, fmoe.layers.index_slots); None: no gather_kv.
    token_index, kv_index: attention_context's (the queries' [T] and the mask's columns' [S]
        indices, context parallel and decoding), which ALiBi's distances (attention's
        params["alibi"]) are taken between; None: 0 ... T - 1, the context's own tokens.
    rope: the RoPE knobs cos and sin were made from (attention_context's cfg: rope_base,
        YaRN's, Llama 3's, LongRoPE's, linear_factor, rope_proportion, reversed, as (name,
        value) pairs), which a global layer's must equal; None: not checked.
    compressed: decoding a heavily compressed attention layer (AttentionConfig.compress_rate):
        compressed(c [T, D], g [T, D], entries) -> (entries [S, D], keep [T, S]), the new
        tokens' compressor inputs (compressor_inputs) in, every cached entry and which query
        sees which out, entries(c [K, m, D], g [K, m, D], first positions [K]) -> [K, D] making
        the runs it completes (run_entries); bound per layer by fmoe.model.Transformer.decode
        (KVCache.compress); None otherwise. A compressed sparse attention layer's
        (AttentionConfig.compress_topk) takes c, g [T, W] (its compressor's inputs, then its
        indexer's: W = 2 D + 2 index_head_dim) and entries(c [K, 2 m, W], g [K, 2 m, W], first
        positions [K], has_prev [K] bool) -> [K, D + index_head_dim] (the previous run's tokens,
        then the run's; has_prev False for a document's first run), and gives back the
        entries [S, D + index_head_dim] (the attention's, then the indexer's).
    additive_masks: a cache, left to its default (and shared by the contexts
        dataclasses.replace makes of this one): mask and local_mask as the additive float
        masks (0 seen, -inf not) that the reference's SDPA calls take, one per dtype, made by
        the first layer that needs one. SDPA turns a bool mask into such a float copy of its
        own and keeps it for the backward: 4 T S bytes a layer (256 MiB at T = 8192), where
        every layer now shares one.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    mask: object
    gather_kv: Optional[Callable] = None
    latents: Optional[str] = None
    window: Optional[int] = None
    local_mask: object = None
    chunk: Optional[int] = None
    positions: Optional[torch.Tensor] = None
    local_rope_base: Optional[float] = None
    local_cos: Optional[torch.Tensor] = None
    local_sin: Optional[torch.Tensor] = None
    cu_seqlens: Optional[torch.Tensor] = None
    linear_states: Optional["LinearStates"] = None
    linear_cp: object = None
    index_choices: Optional[dict] = None
    key_order: Optional[torch.Tensor] = None
    token_index: Optional[torch.Tensor] = None
    kv_index: Optional[torch.Tensor] = None
    compressed: Optional[Callable] = None
    rope: Optional[tuple] = None
    additive_masks: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)


# the knobs cos and sin are made from (rope_tables), the width aside (checked by the tables' shape)
_ROPE_KNOBS = ("rope_base", "reversed", "rope_proportion", "linear_factor", "llama3_factor", "llama3_low_freq_factor",
               "llama3_high_freq_factor", "llama3_original_max_positions", "yarn_factor", "yarn_original_max_positions", "yarn_beta_fast",
               "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "yarn_truncate", "longrope_short_factors", "longrope_long_factors",
               "longrope_original_max_positions", "longrope_short_scale", "longrope_long_scale")


def _rope_knobs(cfg: AttentionConfig) -> tuple:
    return tuple((name, getattr(cfg, name)) for name in _ROPE_KNOBS)


def _use_flex(impl: str, device: torch.device) -> bool:
    return impl == "flex" or (impl == "auto" and device.type == "cuda")


@dataclasses.dataclass(frozen=True)
class MaskRows:
    """A document mask kept as its rule, not as its [T, S] values: query t sees key s iff
    q_doc[t] == kv_doc[s] and kv_pos[s] <= q_pos[t] (and q_pos[t] - kv_pos[s] < window);
    document_mask(rows=True) builds it. The contexts of the sparse kernels' paths: DeepSeek
    sparse attention's and block-sparse attention's indexers read the mask a block of
    queries at a time (rows); DeepSeek-V4's layers find each query's window of keys from
    the rule itself (and their compressed entries' visibility is one too), and the kernel
    never needs it whole. O(T + S) memory where the dense mask is T S bytes (16 GiB at
    T = S = 128K)."""

    q_doc: torch.Tensor
    q_pos: torch.Tensor
    kv_doc: torch.Tensor
    kv_pos: torch.Tensor
    window: Optional[int] = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q_doc.shape[0], self.kv_doc.shape[0])

    def rows(self, b: slice = slice(None)) -> torch.Tensor:
        """[len(b), S] bool: the mask's rows b (every row: the dense mask)."""
        return self.at(b, slice(None))

    def at(self, b, keys) -> torch.Tensor:
        """The mask at queries b and keys `keys`: keys a slice of the columns (-> [len(b), S'])
        or an int64 [T', J] tensor of key indices per query row (-> [T', J]; -1: False)."""
        if isinstance(keys, torch.Tensor):
            safe = keys.clamp(min=0)
            doc, pos, live = self.kv_doc[safe], self.kv_pos[safe], keys >= 0
        else:
            doc, pos, live = self.kv_doc[None, keys], self.kv_pos[None, keys], True
        q_doc, q_pos = self.q_doc[b, None], self.q_pos[b, None]
        allowed = (q_doc == doc) & (pos <= q_pos) & live
        return allowed if self.window is None else allowed & (q_pos - pos < self.window)


def document_mask(cu_seqlens: torch.Tensor, n_tokens: int, *, flex: bool, token_index=None, kv_index=None, block_size: int = 128,
                  window: Optional[int] = None, chunk: Optional[int] = None, rows: bool = False):
    """The causal, same-document mask of a packed micro-batch: a FlexAttention BlockMask
    (flex=True) or a [T, T] bool tensor, True where query t may attend to key s (s <= t
    and both in the same document; with a sliding window also t - s < window; with a
    chunk also in the same chunk of `chunk` tokens of that document: positions p // chunk
    equal, Llama 4's chunked attention). No host sync; built once per micro-batch.

    Chunked attention is the document mask over documents cut into their chunks: each token
    stands in the segment named by its chunk's first global index (non-decreasing in the
    index, as document ids are), so the same code builds both.

    Context parallel: token_index [Tq] (the queries' global token indices) and kv_index
    [Tk] (the keys', Tk = n_tokens) give the [Tq, Tk] mask of query i and key j: the
    global tokens token_index[i] and kv_index[j] under the rule above, the indices below
    cu_seqlens[-1] in any order. Both or neither.

    The BlockMask is built from each block's first and last document and token index
    (_document_block_mask): memory O((Tq / block_size) (Tk / block_size)), never the
    [Tq, Tk] mask that create_block_mask evaluates (4 GiB at T = 64K). block_size: its
    query and key block (FlexAttention's default 128). rows=True (with flex=False): the rule
    alone, a MaskRows, evaluated a block of queries at a time where needed."""
    if (token_index is None) != (kv_index is None):
        raise ValueError(f"{'kv_index' if kv_index is None else 'token_index'}: expected token_index and kv_index together (context parallel) or neither")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    check_window(window)
    if chunk is not None:
        check_positive_int("chunk", chunk)
    if token_index is None:  # queries and keys are the tokens themselves, in order
        doc_T = sequence_ids(cu_seqlens, n_tokens)
        q_pos = kv_pos = torch.arange(n_tokens, device=doc_T.device)
        if chunk is not None:
            doc_T = _chunk_segments(cu_seqlens, doc_T, q_pos, chunk)
        q_doc = kv_doc = doc_T

        def same_doc_causal(b, h, q_idx, kv_idx):  # the indices are the positions: no gather in the kernel
            return (doc_T[q_idx] == doc_T[kv_idx]) & (kv_idx <= q_idx)

        def in_window(q_idx, kv_idx):
            return q_idx - kv_idx < window
    else:
        # each index's document by a search of the bounds (any index below cu_seqlens[-1]; a
        # decode's ring rows carry indices beyond their count): nothing is read on the host
        q_pos, kv_pos = token_index.long(), kv_index.long()
        ends = cu_seqlens[1:].long()
        q_doc, kv_doc = (torch.searchsorted(ends, pos, right=True) for pos in (q_pos, kv_pos))
        if chunk is not None:
            q_doc, kv_doc = (_chunk_segments(cu_seqlens, doc, pos, chunk) for doc, pos in ((q_doc, q_pos), (kv_doc, kv_pos)))

        def same_doc_causal(b, h, q_idx, kv_idx):
            return (q_doc[q_idx] == kv_doc[kv_idx]) & (kv_pos[kv_idx] <= q_pos[q_idx])

        def in_window(q_idx, kv_idx):
            return q_pos[q_idx] - kv_pos[kv_idx] < window
    if window is None:
        mask_mod = same_doc_causal
    else:
        def mask_mod(b, h, q_idx, kv_idx):  # the sliding window on top
            return same_doc_causal(b, h, q_idx, kv_idx) & in_window(q_idx, kv_idx)
    if rows:
        if flex:
            raise ValueError("rows: the mask's rule (MaskRows) or FlexAttention's block mask (flex), not both")
        return MaskRows(q_doc, q_pos, kv_doc, kv_pos, window)
    if not flex:
        allowed = (q_doc[:, None] == kv_doc[None, :]) & (kv_pos[None, :] <= q_pos[:, None])
        # kv_pos > q_pos - window: q_pos - kv_pos < window without the int64 [T, S] of differences (10x the bool mask)
        return allowed if window is None else allowed & (kv_pos[None, :] > q_pos[:, None] - window)
    return _document_block_mask(q_doc, q_pos, kv_doc, kv_pos, mask_mod, block_size, window)


def _chunk_segments(cu_seqlens, doc, index, chunk: int):
    """The segment of each token (its document `doc`, global index `index`) when every
    document is cut into chunks of `chunk` tokens: the global index of its chunk's first
    token (tokens past cu_seqlens[-1] are chunked from there)."""
    start = cu_seqlens.long()[doc]
    return start + torch.div(index - start, chunk, rounding_mode="floor") * chunk


def _block_ranges(doc, pos, block_size: int):
    """Per block of block_size tokens: (first doc, last doc, smallest index, largest index),
    each [n_blocks]; a last, shorter block counts its real tokens only."""
    n = doc.shape[0]
    n_blocks = -(-n // block_size)
    rows = torch.arange(n_blocks * block_size, device=doc.device).clamp(max=n - 1)  # repeat the last token
    doc_B, pos_B = (t.index_select(0, rows).view(n_blocks, block_size) for t in (doc, pos))
    return doc_B.amin(1), doc_B.amax(1), pos_B.amin(1), pos_B.amax(1)


def _document_block_mask(q_doc, q_pos, kv_doc, kv_pos, mask_mod, block_size: int, window: Optional[int] = None):
    """The BlockMask of "same document and kv_pos <= q_pos" (and q_pos - kv_pos < window)
    for queries (q_doc, q_pos [Tq]) and keys (kv_doc, kv_pos [Tk]), document ids
    non-decreasing in the global index pos.

    A (query block, key block) pair is
      full (mask_mod skipped) iff every token of both blocks is in one document and the
        largest key index <= the smallest query index (and the largest query index minus
        the smallest key index < window), and neither block is a short last one: exactly
        the pairs whose every entry is allowed;
      visited iff the blocks' document ranges overlap and the smallest key index <= the
        largest query index (and the smallest query index minus the largest key index <
        window): every pair with an allowed entry, and exactly those without a window when
        each block's indices are contiguous (no context parallel, or cp chunks a multiple of
        block_size); otherwise a superset (a few more blocks that mask_mod then masks).
    Memory and work are O(n_q_blocks x n_kv_blocks)."""
    from torch.nn.attention.flex_attention import BlockMask

    q_first, q_last, q_lo, q_hi = _block_ranges(q_doc, q_pos, block_size)
    k_first, k_last, k_lo, k_hi = _block_ranges(kv_doc, kv_pos, block_size)
    visited = (k_lo[None, :] <= q_hi[:, None]) & (k_first[None, :] <= q_last[:, None]) & (k_last[None, :] >= q_first[:, None])
    whole_q = torch.arange(q_first.shape[0], device=q_doc.device) < q_doc.shape[0] // block_size
    whole_k = torch.arange(k_first.shape[0], device=kv_doc.device) < kv_doc.shape[0] // block_size
    one_doc = (q_first == q_last)[:, None] & (k_first == k_last)[None, :] & (q_first[:, None] == k_first[None, :])
    full = one_doc & (k_hi[None, :] <= q_lo[:, None]) & whole_q[:, None] & whole_k[None, :]
    if window is not None:
        visited = visited & (q_lo[:, None] - k_hi[None, :] < window)
        full = full & (q_hi[:, None] - k_lo[None, :] < window)

    def ordered(blocks_QK):  # per query block: how many key blocks, then their indices in order
        blocks = blocks_QK.to(torch.int32)[None, None]
        return blocks.sum(-1, dtype=torch.int32), torch.argsort(blocks, dim=-1, descending=True, stable=True).to(torch.int32)

    return BlockMask.from_kv_blocks(*ordered(visited & ~full), *ordered(full), BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                    seq_lengths=(q_doc.shape[0], kv_doc.shape[0]))


def _check_cp(positions, token_index, kv_index, gather_kv) -> None:
    given = [name for name, a in (("token_index", token_index), ("kv_index", kv_index), ("gather_kv", gather_kv)) if a is not None]
    if given and len(given) < 3:
        missing = sorted({"token_index", "kv_index", "gather_kv"} - set(given))
        raise ValueError(f"{missing[0]}: context parallel needs token_index, kv_index and gather_kv together, got only {given}")
    if not given:
        return
    check_index("token_index", token_index, 1, "[T/cp]")
    check_index("kv_index", kv_index, 1, "[T]")
    if token_index.shape != positions.shape:
        raise ValueError(f"token_index: expected one global index per local token, shape {tuple(positions.shape)} like positions, got {tuple(token_index.shape)}")
    for name, t in (("token_index", token_index), ("kv_index", kv_index)):
        if t.device != positions.device:
            raise ValueError(f"{name}: expected positions' device {positions.device}, got {t.device}")
    if not callable(gather_kv):
        raise ValueError(f"gather_kv: expected a callable (k, v) -> (k, v), got {type(gather_kv).__name__}")


def attention_context(
    cu_seqlens: torch.Tensor, positions: torch.Tensor, cfg: AttentionConfig, *, mask=None,
    token_index: Optional[torch.Tensor] = None, kv_index: Optional[torch.Tensor] = None,
    gather_kv: Optional[Callable] = None, window_only: bool = False, linear_cp=None,
) -> AttentionContext:
    """The per-micro-batch inputs of attention, built once and passed to every layer.

    Args:
        cu_seqlens: [n + 1] int document bounds 0 ... T, on the device attention runs on.
            Its values are NOT read (no host sync): check them where the batch is made
            (fmoe.train.data.make_batch does, on the host).
        positions: [T] int positions for RoPE (restarting at 0 in each document); under
            context parallel this rank's [T/cp] (fmoe.parallel.split_batch's).
        cfg: AttentionConfig (its RoPE / YaRN knobs and impl pick the tables and the mask;
            with cfg.window or cfg.chunk the context also holds that sliding window's or
            chunk's mask, for the layers of that window or chunk, full-attention layers
            using the other).
        mask: an existing context's mask to share (the MTP depths: same documents, other
            positions); None builds it (document_mask).
        token_index, kv_index, gather_kv: context parallel (module docstring), all three or
            none. token_index [T/cp] int: the global indices of this rank's tokens
            (split_batch's "token_index"); kv_index [T] int: the global index of each row
            gather_kv returns (fmoe.parallel.cp_kv_index); gather_kv(k, v) -> (k, v): this
            rank's keys and values to every rank's (functools.partial(fmoe.parallel.gather_kv,
            cp_mesh=...)). Their values are not read either. Decoding with a KV cache uses
            the same form: token_index the new tokens' rows in the cache, kv_index 0 ... of
            the cache's rows, gather_kv the cache (fmoe.model.Transformer.decode).
        window_only: a context for the sliding-window (chunked) layers alone (cfg.window,
            cfg.chunk): only that mask is built, and it is `mask` too (decoding over a ring of
            keys that the full-attention layers never see).
        linear_cp: with the three above, what runs the linear-attention layers across the
            split (fmoe.parallel.ContextParallel, whose attention_kwargs give all four; see
            AttentionContext.linear_cp). A context-parallel context without it serves
            softmax attention only: linear_attention refuses it.
    Returns:
        AttentionContext(cos, sin [T, rot_dim/2] float32, mask, gather_kv): the mask is a
        FlexAttention BlockMask when cfg.impl is "flex", or "auto" on CUDA; its rule alone
        (MaskRows) where a sparse kernel runs (Triton: impl "triton", or "auto" on CUDA)
        for DeepSeek sparse attention, block-sparse attention or one kv head that is its
        values (cfg.kv_shared, DeepSeek-V4's layers); the dense [T, T] mask otherwise
        ([T/cp, T] under context parallel).
    """
    if not isinstance(cfg, AttentionConfig):
        raise ValueError(f"cfg: expected an AttentionConfig, got {type(cfg).__name__}")
    check_index("cu_seqlens", cu_seqlens, 1, "[n_seqs + 1]")
    check_index("positions", positions, 1, "[T]")
    if cu_seqlens.device != positions.device:
        raise ValueError(f"cu_seqlens: expected positions' device {positions.device}, got {cu_seqlens.device}")
    rot = cfg.rot_dim or cfg.head_dim
    if rot % 2 or rot > cfg.head_dim:
        raise ValueError(f"cfg.rot_dim: expected an even number <= head_dim = {cfg.head_dim}, got {rot}")
    _check_cp(positions, token_index, kv_index, gather_kv)
    if linear_cp is not None:
        if token_index is None:
            raise ValueError("linear_cp: the linear layers' context-parallel exchange needs the split's token_index, kv_index and gather_kv too")
        missing = [m for m in ("token_index", "conv_halo", "gated_delta_rule") if not callable(getattr(linear_cp, m, None))]
        if missing:
            raise ValueError(f"linear_cp: expected an object with token_index, conv_halo and gated_delta_rule (fmoe.parallel.ContextParallel), "
                             f"got {type(linear_cp).__name__} without {missing}")
    T = positions.shape[0]
    T_kv = T if kv_index is None else kv_index.shape[0]
    # one kv head that is its values (DeepSeek-V4's): its window and entries on the sparse kernel where Triton runs
    shared_kv = cfg.kv_shared and cfg.n_kv_heads == 1 and cfg.impl != "flex" and use_triton(cfg.impl, positions)
    flex = (_use_flex(cfg.impl, positions.device) and cfg.index_topk is None and cfg.index_topk_blocks is None  # a top-k mask is a dense one
            and not shared_kv)
    # ...or, on a sparse kernel's path, the mask's rule alone (MaskRows: never T x S values)
    rows = (cfg.index_topk is not None or cfg.index_topk_blocks is not None or shared_kv) and use_triton(cfg.impl, positions)
    if window_only and ((cfg.window is None and cfg.chunk is None) or mask is not None):
        raise ValueError(f"window_only: a context of the sliding window's (chunk's) layers alone needs cfg.window or cfg.chunk and no mask, "
                         f"got window {cfg.window}, chunk {cfg.chunk}{' and a mask' if mask is not None else ''}")
    local = None
    if cfg.window is not None or cfg.chunk is not None:  # the window's or chunk's mask too, for the layers that use it
        local = document_mask(cu_seqlens, T_kv, flex=flex, token_index=token_index, kv_index=kv_index, window=cfg.window, chunk=cfg.chunk,
                              rows=rows)
    if window_only:
        mask = local
    elif mask is None:
        mask = document_mask(cu_seqlens, T_kv, flex=flex, token_index=token_index, kv_index=kv_index, rows=rows)
    else:  # a shared mask: the kind this cfg builds
        if flex:
            fits = not isinstance(mask, (torch.Tensor, MaskRows))  # a BlockMask
        else:
            fits = isinstance(mask, MaskRows if rows else torch.Tensor) and tuple(mask.shape) == (T, T_kv)
        if not fits:
            expected = "a BlockMask" if flex else f"a [{T}, {T_kv}] {'MaskRows' if rows else 'bool tensor'}"
            raise ValueError(f"mask: expected {expected} (cfg.impl = {cfg.impl!r}), got {type(mask).__name__}")
    lengths = _sequence_lengths(cu_seqlens, positions, token_index, linear_cp) if cfg.longrope_short_factors is not None else None
    cos, sin = rope_tables(positions, cfg, lengths)
    local_base = cfg.local_rope_base if local is not None else None  # the local layers' own plain RoPE
    local_cos, local_sin = (None, None) if local_base is None else rope_tables(positions, dataclasses.replace(  # of the local layers' heads
        cfg, head_dim=cfg.local_head_dim or cfg.head_dim, local_head_dim=None,  # wider than head_dim: refused as rot_dim > head_dim
        rope_base=local_base, rot_dim=cfg.local_rot_dim or cfg.rot_dim, llama3_factor=None, yarn_factor=None, linear_factor=None,
        rope_proportion=None,
        longrope_short_factors=None, longrope_long_factors=None, longrope_original_max_positions=4096, longrope_short_scale=1.0,
        longrope_long_scale=1.0))
    return AttentionContext(cos, sin, mask, gather_kv, window=cfg.window, local_mask=local, chunk=cfg.chunk, positions=positions,
                            local_rope_base=local_base, local_cos=local_cos, local_sin=local_sin, cu_seqlens=cu_seqlens, linear_cp=linear_cp,
                            index_choices={} if cfg.index_topk is not None else None,
                            key_order=torch.argsort(kv_index) if (cfg.index_topk is not None or cfg.index_topk_blocks is not None)
                            and kv_index is not None else None,
                            token_index=token_index, kv_index=kv_index, rope=_rope_knobs(cfg))


def _sequence_lengths(cu_seqlens: torch.Tensor, positions: torch.Tensor, token_index: Optional[torch.Tensor], linear_cp) -> torch.Tensor:
    """[T] the length of each token's document, LongRoPE's switch (rope_tables): its largest
    position + 1 (a decoded sequence's length so far), or under context parallel (linear_cp:
    this rank's positions are a part of each document's) the global cu_seqlens' span. No host sync."""
    doc = sequence_ids(cu_seqlens, positions.shape[0], index=token_index)
    if linear_cp is not None:
        return cu_seqlens.diff()[doc]
    top = torch.zeros(cu_seqlens.shape[0] - 1, dtype=positions.dtype, device=positions.device)
    return top.scatter_reduce(0, doc, positions, "amax", include_self=False)[doc] + 1


_FLEX_MIN_DIM = 16  # the compiled FlexAttention kernel's smallest head dim (torch 2.11: "NYI ... at least 16")


@functools.cache
def _compiled_flex():
    """flex_attention compiled once per process (its fused kernel exists only compiled)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _rms_norm(x, weight, eps: float, ms=None, *, zero_centered: bool = False):
    """x / rms(x) * weight over the last dim, statistics in float32 (fmoe.model.RMSNorm's);
    weight None: no weight; zero_centered: times 1 + weight. ms: the mean square [..., 1] to
    use (None: x's own, over its last dim). A bf16 or float16 x with its own statistics goes
    through rms_norm_saving_input (defined below): the same values, and x alone in its dtype
    kept for the backward (this form's autograd keeps x and x / rms(x) in float32)."""
    if ms is None and x.dtype in (torch.bfloat16, torch.float16):
        return rms_norm_saving_input(x, weight, eps, zero_centered=zero_centered)
    x32 = x.float()
    if ms is None:
        ms = x32.square().mean(-1, keepdim=True)
    y = x32 * torch.rsqrt(ms + eps)
    if weight is None:
        return y.to(x.dtype)
    return (y * (weight.float() + 1.0 if zero_centered else weight.float())).to(x.dtype)


class _LowPrecisionRMSNorm(torch.autograd.Function):
    """rms_norm_saving_input's forward (the eager form's bits) and its backward in float32
    from x in its own dtype and the inverse rms [..., 1]: autograd on the eager form kept x
    and x / rms(x) in float32 for the backward, 4 x a bf16 x's bytes against 1 x here. Its
    backward is differentiable (a double backward recomputes the inverse rms from x, so its
    dependence on x is in the graph), it has a jvp (forward-mode AD) and torch.func takes it
    (grad, vjp, jacrev; vmap by torch's generated rule)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, eps, zero_centered):
        x32 = x.float()
        rstd = torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
        y = x32 * rstd
        if weight is not None:
            y = y * (weight.float() + 1.0 if zero_centered else weight.float())
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype), rstd

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, eps, zero_centered = inputs
        ctx.save_for_backward(x, weight, output[1])
        ctx.save_for_forward(x, weight, output[1])  # jvp's saved_tensors
        ctx.mark_non_differentiable(output[1])
        ctx.eps, ctx.zero_centered, ctx.bias_dtype = eps, zero_centered, None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx, grad_y, _grad_rstd):
        x, weight, rstd = ctx.saved_tensors
        if torch.is_grad_enabled():  # a double backward (create_graph): the saved rstd is a constant to autograd, x's own is not
            rstd = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + ctx.eps)
        g = grad_y.float()
        xhat = x.float() * rstd
        d_weight = d_bias = d_x = None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            d_bias = g.flatten(0, -2).sum(0).to(ctx.bias_dtype)
        if weight is not None:
            if ctx.needs_input_grad[1]:
                d_weight = (g * xhat).flatten(0, -2).sum(0).to(weight.dtype)
            g = g * (weight.float() + 1.0 if ctx.zero_centered else weight.float())
        if ctx.needs_input_grad[0]:  # d xhat / dx: (g - xhat mean(g xhat)) / rms
            d_x = (rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return d_x, d_weight, d_bias, None, None

    @staticmethod
    def jvp(ctx, dx, dweight, dbias, _deps, _dzero_centered):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        dy = torch.zeros_like(xhat)
        if dx is not None:  # d xhat = rstd (dx - xhat mean(xhat dx))
            dx32 = dx.float()
            dy = rstd * (dx32 - xhat * (xhat * dx32).mean(-1, keepdim=True))
        if weight is not None:
            dy = dy * (weight.float() + 1.0 if ctx.zero_centered else weight.float())
            if dweight is not None:
                dy = dy + xhat * dweight.float()
        if dbias is not None:
            dy = dy + dbias.float()
        return dy.to(x.dtype), None


def rms_norm_saving_input(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, *, zero_centered: bool = False,
                          bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x / rms(x) * weight (+ bias) over the last dim, statistics in float32, in x's dtype
    (weight None: none; zero_centered: times 1 + weight). The same values as the plain torch
    form; its backward keeps x in its own dtype and the inverse rms [..., 1] alone (the plain
    form's autograd keeps x and x / rms(x) in float32: 4 x a bf16 x's bytes), and computes in
    float32. fmoe.model.RMSNorm takes it for bf16 and float16 inputs; float32 ones keep the
    plain form (nothing to save there: its x is already float32)."""
    return _LowPrecisionRMSNorm.apply(x, weight, bias, eps, zero_centered)[0]


def prescaled_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The gain first, then the norm: y / rms(y) for y = x (1 + weight), over the last dim in
    float32, in x's dtype (Muse Spark's input-scaled RMSNorm; a zero row stays zero, with eps
    0 too, where its gradient is 0)."""
    y = x.float() * (weight.float() + 1.0)
    ms = y.square().mean(-1, keepdim=True) + eps
    # eps 0: a zero row's rsqrt(0) is inf and 0 * inf NaN, so its scale is 0; the inner where keeps
    # rsqrt's gradient there finite (0 * inf would be NaN again). eps > 0: rsqrt(ms + eps) itself
    positive = ms > 0
    return (y * torch.where(positive, torch.rsqrt(torch.where(positive, ms, 1.0)), 0.0)).to(x.dtype)


def out_shapes(H: int, cfg: AttentionConfig) -> dict:
    """The output projection's name -> shape: wo [N Dv, H], or with the grouped output
    projection (cfg.o_groups g, cfg.o_rank r) wo_a [g, N Dv / g, r] and wo [g r, H]."""
    o = cfg.n_heads * (cfg.v_dim or cfg.head_dim)
    if cfg.o_groups is None:
        return {"wo": (o, H)}
    return {"wo_a": (cfg.o_groups, o // cfg.o_groups, cfg.o_rank), "wo": (cfg.o_groups * cfg.o_rank, H)}


def out_projection(out_TQ: torch.Tensor, params, cfg: AttentionConfig) -> torch.Tensor:
    """The heads' outputs [T, N Dv] -> [T, H] (out_shapes): x wo, or each group of heads
    through its wo_a[i], then wo (the grouped output projection)."""
    if cfg.o_groups is None:
        return matmul(out_TQ, params["wo"], fp8=cfg.fp8, impl=cfg.impl)
    T, g = out_TQ.shape[0], cfg.o_groups
    low_TGR = torch.einsum("tgi,gir->tgr", out_TQ.reshape(T, g, -1), params["wo_a"])  # each group to its r channels
    return matmul(low_TGR.reshape(T, g * cfg.o_rank), params["wo"], fp8=False, impl=cfg.impl)


def mla_shapes(H: int, cfg: AttentionConfig) -> tuple[dict, dict]:
    """Multi-latent attention's (matrices, latent norms) name -> shape."""
    N, D, R = cfg.n_heads, cfg.head_dim, cfg.rot_dim
    mats = {"wkv_a": (H, cfg.kv_rank + R), "wkv_b": (cfg.kv_rank, N * (D - R + cfg.v_dim)), **out_shapes(H, cfg)}
    norms = {"kv_a_norm": (cfg.kv_rank,)}
    if cfg.q_rank is None:
        mats["wq"] = (H, N * D)
    else:
        mats.update(wq_a=(H, cfg.q_rank), wq_b=(q_in(cfg), N * D))
        norms["q_a_norm"] = (cfg.q_rank,)
    return mats, norms


def gqa_q_shapes(H: int, cfg: AttentionConfig) -> dict:
    """Grouped-query attention's query projection name -> shape: wq [H, N D], or with a q
    latent (cfg.q_rank) wq_a [H, q_rank] and wq_b [q_rank, N D] (its norm q_a_norm [q_rank]
    beside them)."""
    q = cfg.n_heads * cfg.head_dim
    return {"wq": (H, q)} if cfg.q_rank is None else {"wq_a": (H, cfg.q_rank), "wq_b": (cfg.q_rank, q)}


def compress_shapes(H: int, cfg: AttentionConfig) -> dict:
    """Heavily compressed attention's compressor (cfg.compress_rate m) name -> shape:
    compress_wkv, compress_wg [H, D], compress_bias [m, D] (float32), compress_norm [D]; {}
    without it. Compressed sparse attention's (cfg.compress_topk): compress_wkv, compress_wg
    [H, 2 D], compress_bias [m, 2 D], compress_norm [D], and its indexer's index_wq [q_rank,
    index_heads index_head_dim], index_w [H, index_heads], index_compress_wkv,
    index_compress_wg [H, 2 Di], index_compress_bias [m, 2 Di] (float32), index_compress_norm
    [Di], Di = index_head_dim."""
    if cfg.compress_rate is None:
        return {}
    D, m = cfg.head_dim, cfg.compress_rate
    if cfg.compress_topk is None:
        return {"compress_wkv": (H, D), "compress_wg": (H, D), "compress_bias": (m, D), "compress_norm": (D,)}
    Ni, Di = cfg.index_heads, cfg.index_head_dim
    return {"compress_wkv": (H, 2 * D), "compress_wg": (H, 2 * D), "compress_bias": (m, 2 * D), "compress_norm": (D,),
            "index_wq": (cfg.q_rank, Ni * Di), "index_w": (H, Ni), "index_compress_wkv": (H, 2 * Di), "index_compress_wg": (H, 2 * Di),
            "index_compress_bias": (m, 2 * Di), "index_compress_norm": (Di,)}


def compressed_entries(x_TH: torch.Tensor, params, cfg: AttentionConfig, ctx: "AttentionContext", *,
                       prefix: str = "compress_") -> tuple[torch.Tensor, torch.Tensor]:
    """Heavily compressed attention's entries (AttentionConfig.compress_rate m; DeepSeek-V4's
    HCA compressor) of the packed tokens x [T, H] over ctx's documents (ctx.cu_seqlens,
    ctx.positions; ctx.cos, ctx.sin the layer's RoPE tables): (entries [S, D] in x's dtype,
    keep [T, S] bool), S = T // m slots, slot s the run j of m tokens of its document (the
    documents' runs in order), its entry sum_i softmax_i(g_i + b_i) c_i over the run's tokens,
    RMS-normed with compress_norm and rotated at position j m; keep[t, s]: token t's document
    holds the complete run s and t is at position (j + 1) m - 1 or later. Unused slots (fewer
    complete runs than S) are kept from every query. No host sync. With cfg.compress_topk
    (compressed sparse attention) the entries overlap (AttentionConfig): the previous run's
    first halves beside run j's second halves. prefix "index_compress_": the indexer's
    entries [S, index_head_dim] (its weights, rotated as its queries). Under context
    parallel (ctx.gather_kv; ctx.token_index, ctx.kv_index, the documents global) every
    rank's compressor inputs are gathered (their gradients returning to each), the entries
    are made from the whole micro-batch's T tokens, S = T // m, and keep is this rank's
    queries' [T / cp, S]; the runs' RoPE tables are made at their positions."""
    (entries_SD,), keep_TS = _compressed_parts([(prefix, *compressor_inputs(x_TH, params, cfg, prefix=prefix))], params, cfg, ctx)
    return entries_SD, keep_TS


def _compressed_parts(parts, params, cfg: AttentionConfig, ctx: "AttentionContext", *, rows: bool = False) -> tuple[list, object]:
    """compressed_entries of several compressors over the same runs (compressed sparse
    attention's and its indexer's), parts [(prefix, c [T, E], g [T, E])] of each one's
    inputs (compressor_inputs): ([entries [S, D] of each], keep [T, S]), the runs'
    bookkeeping made once and, under context parallel, every part's inputs in one gather
    (each part's gradient returning through it; to the others' inputs, zeros). rows: keep
    as its rule (a MaskRows: entry j of a document, its position (j + 1) m - 1, seen by
    the document's queries from that position on; an entry past the documents' runs by
    none), never [T, S] values."""
    inputs = [(c, g) for _, c, g in parts]
    m, device = cfg.compress_rate, inputs[0][0].device
    cu, positions = ctx.cu_seqlens.long(), ctx.positions.long()
    q_index = torch.arange(inputs[0][0].shape[0], device=device)
    if ctx.gather_kv is not None:  # context parallel: every rank's inputs, in token order
        widths = [c.shape[1] for c, _ in inputs]
        order = torch.argsort(ctx.kv_index.long())
        c_TE, g_TE = (t[order, 0] for t in ctx.gather_kv(*(torch.cat([part[i] for part in inputs], dim=1)[:, None] for i in (0, 1))))
        inputs = list(zip(c_TE.split(widths, dim=1), g_TE.split(widths, dim=1)))
        q_index = ctx.token_index.long()
    T = inputs[0][0].shape[0]
    S = T // m
    lengths = cu[1:] - cu[:-1]
    runs = torch.cumsum(lengths // m, 0)  # complete runs up to each document's end
    slot = torch.arange(S, device=device)
    doc = torch.searchsorted(runs, slot, right=True).clamp(max=lengths.shape[0] - 1)  # the document of each slot
    valid = slot < runs[-1]
    j = slot - (runs[doc] - lengths[doc] // m)  # the run's index in its document
    first = torch.where(valid, cu[doc] + j * m, 0)  # its first token
    run_SM = first[:, None] + torch.arange(m, device=device)
    prev_SM = (run_SM - m).clamp(min=0)
    if ctx.gather_kv is None:  # the context's tables at each run's first token
        cos, sin = ctx.cos[first], ctx.sin[first]
    else:  # made at the runs' positions (their tokens on other ranks too), each document's length for LongRoPE's switch
        cos, sin = rope_tables(j * m, cfg, lengths[doc])
    entries = []
    for (prefix, _, _), (c_TW, g_TW) in zip(parts, inputs):
        bias_ME = params[prefix + "bias"]
        if cfg.compress_topk is None:
            c_SKD, logits_SKD = c_TW[run_SM], g_TW[run_SM].float() + bias_ME.float()
        else:  # overlapping runs: the previous run's first halves (none before run 0: weight 0), then run j's second halves
            c_SKD, logits_SKD = overlap_runs(c_TW[prev_SM], g_TW[prev_SM], c_TW[run_SM], g_TW[run_SM], valid & (j > 0), bias_ME)
        entries.append(run_entries(c_SKD, logits_SKD, cos, sin, params[prefix + "norm"], cfg, index=prefix != "compress_"))
    q_doc = torch.searchsorted(cu[1:], q_index, right=True)
    if rows:
        return entries, MaskRows(q_doc, positions, torch.where(valid, doc, -1), (j + 1) * m - 1)
    keep_TS = valid[None] & (doc[None] == q_doc[:, None]) & ((j[None] + 1) * m <= positions[:, None] + 1)
    return entries, keep_TS


def overlap_runs(c_prev_KME: torch.Tensor, g_prev_KME: torch.Tensor, c_KME: torch.Tensor, g_KME: torch.Tensor, has_prev_K: torch.Tensor,
                 bias_ME: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed sparse attention's overlapping runs (AttentionConfig.compress_topk): of K
    runs' compressor inputs c, g [K, m, E = 2 D] and their previous runs' (c_prev, g_prev),
    (c [K, 2 m, D], logits [K, 2 m, D] float32) for run_entries: the previous run's first
    halves (their gates plus bias[:, :D]; -inf where has_prev [K] is False, a document's
    first run) then the run's second halves (plus bias[:, D:])."""
    D = c_KME.shape[-1] // 2
    c_K2D = torch.cat([c_prev_KME[..., :D], c_KME[..., D:]], dim=1)
    logits_prev = (g_prev_KME[..., :D].float() + bias_ME[:, :D].float()).masked_fill(~has_prev_K[:, None, None], float("-inf"))
    return c_K2D, torch.cat([logits_prev, g_KME[..., D:].float() + bias_ME[:, D:].float()], dim=1)


def compressor_inputs(x_TH: torch.Tensor, params, cfg: AttentionConfig, *, prefix: str = "compress_") -> tuple[torch.Tensor, torch.Tensor]:
    """Heavily compressed attention's per-token inputs of x [T, H]: (c = x compress_wkv,
    g = x compress_wg), [T, D] each in x's dtype ([T, 2 D] with cfg.compress_topk; prefix
    "index_compress_": the indexer's)."""
    return tuple(matmul(x_TH, params[prefix + name], fp8=False, impl=cfg.impl) for name in ("wkv", "wg"))


def run_entries(c_KMD: torch.Tensor, logits_KMD: torch.Tensor, cos_KR: torch.Tensor, sin_KR: torch.Tensor, norm_D: torch.Tensor,
                cfg: AttentionConfig, *, index: bool = False) -> torch.Tensor:
    """The compressed entries [K, D] of K runs (c [K, M, D] of each run's tokens in order,
    logits [K, M, D] float32 their gates plus the bias by place, -inf for a slot left out;
    cos, sin [K, R/2] the RoPE tables at each run's first position): sum_i softmax_i(logits_i)
    c_i (float32 weights, channel by channel), RMS-normed with norm [D], rotated as the keys
    are (index: as the indexer's queries, _index_rope)."""
    w_KMD = logits_KMD.softmax(dim=1)  # over the run's slots, channel by channel
    entries_KD = _rms_norm((c_KMD * w_KMD.to(c_KMD.dtype)).sum(dim=1), norm_D, cfg.norm_eps)
    if cfg.rope:  # at the run's first position, as the keys are rotated
        entries_KD = (_index_rope if index else _gqa_rope)(entries_KD[:, None], cos_KR, sin_KR, cfg)[:, 0]
    return entries_KD


def compressed_choice(x_TH: torch.Tensor, q_lat_TC: torch.Tensor, keys_SD: torch.Tensor, params, cfg: AttentionConfig, ctx: "AttentionContext",
                      keep_TS: torch.Tensor) -> torch.Tensor:
    """Compressed sparse attention's choice (cfg.compress_topk; AttentionConfig) of the
    tokens x [T, H] (their normed q latents q_lat [T, q_rank]; ctx.cos, ctx.sin the tables at
    their positions): slots [T, J] int64 (index_slots'; J = min(compress_topk, S), -1 where a
    query sees fewer), of the entries each query sees (keep [T, S]), the compress_topk of
    highest indexer score against the indexer's entries keys [S, index_head_dim] (equal
    scores: the earlier entry, the lower column); slots_mask(slots, S) is the mask. No
    gradient."""
    with torch.no_grad():
        return _index_choice(x_TH.detach(), q_lat_TC.detach(), keys_SD.detach().float(), params, cfg, dataclasses.replace(ctx, key_order=None),
                             keep_TS, topk=cfg.compress_topk)


def _decode_sparse_entries(x_TH, params, cfg: AttentionConfig, ctx: "AttentionContext") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compressed sparse attention in a decode call (ctx.compressed, AttentionContext): the new
    tokens' compressor and indexer inputs into the cache, which makes the runs they complete
    (overlap_runs, run_entries, each part its own weights); (entries [S, D], the indexer's
    entries [S, index_head_dim], keep [T, S])."""
    D = cfg.head_dim
    inputs = [compressor_inputs(x_TH, params, cfg, prefix=prefix) for prefix in ("compress_", "index_compress_")]
    split = 2 * D  # the compressor's channels, then the indexer's

    def entries(c_K2MW, g_K2MW, first_K, has_prev_K):
        m = c_K2MW.shape[1] // 2
        cos, sin = rope_tables(first_K, cfg)
        out = []
        for prefix, part in (("compress_", slice(None, split)), ("index_compress_", slice(split, None))):
            c, g = c_K2MW[..., part], g_K2MW[..., part]
            c_K2D, logits_K2D = overlap_runs(c[:, :m], g[:, :m], c[:, m:], g[:, m:], has_prev_K, params[prefix + "bias"])
            out.append(run_entries(c_K2D, logits_K2D, cos, sin, params[prefix + "norm"], cfg, index=prefix != "compress_").to(c.dtype))
        return torch.cat(out, dim=-1)

    store_SE, keep_TS = ctx.compressed(*(torch.cat([a, b], dim=-1) for a, b in zip(*inputs)), entries)
    return store_SE[:, :D], store_SE[:, D:], keep_TS


def qk_norm_shapes(cfg: AttentionConfig) -> dict:
    """Grouped-query attention's q/k norm weights name -> shape for cfg.qk_norm: q_norm and
    k_norm [D] ("head", "layer"), [N D] and [G D] ("proj"), [N, D] and [G, D] ("head_layer"),
    k_norm [D] alone ("head_k"); none for None and "rms"."""
    N, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    return dict(head=dict(q_norm=(D,), k_norm=(D,)), proj=dict(q_norm=(N * D,), k_norm=(G * D,)), head_layer=dict(q_norm=(N, D), k_norm=(G, D)),
                layer=dict(q_norm=(D,), k_norm=(D,)), head_k=dict(k_norm=(D,))).get(cfg.qk_norm, {})


def q_in(cfg: AttentionConfig) -> int:
    """The width of multi-latent attention's wq_b input: q_rank, or 2 q_rank with cfg.q_latent_raw."""
    return 2 * cfg.q_rank if cfg.q_latent_raw else cfg.q_rank


def index_shapes(H: int, cfg: AttentionConfig) -> dict:
    """DeepSeek sparse attention's indexer (cfg.index_topk; AttentionConfig) name -> shape:
    index_wq [q_rank, index_heads index_head_dim], index_wk [H, index_head_dim], the key's
    LayerNorm index_k_norm and index_k_bias [index_head_dim], the head weights index_w
    [H, index_heads]; {} without index_topk. Block-sparse attention's (cfg.index_topk_blocks):
    index_wq [H, index_heads index_head_dim], index_wk [H, index_head_dim] and the RMSNorms'
    weights index_q_norm, index_k_norm [index_head_dim]."""
    if cfg.index_topk_blocks is not None:  # block-sparse attention's: queries and one key per token, RMS-normed
        Ni, Di = cfg.index_heads, cfg.index_head_dim
        return {"index_wq": (H, Ni * Di), "index_wk": (H, Di), "index_q_norm": (Di,), "index_k_norm": (Di,)}
    if cfg.index_topk is None or cfg.index_shared:
        return {}
    Ni, Di = cfg.index_heads, cfg.index_head_dim
    return {"index_wq": (cfg.q_rank, Ni * Di), "index_wk": (H, Di), "index_k_norm": (Di,), "index_k_bias": (Di,), "index_w": (H, Ni)}


def _check_attention(x_TH, params, cfg, ctx) -> None:
    check_float("x", x_TH, 2, "[T, H]")
    if not isinstance(cfg, AttentionConfig):
        raise ValueError(f"cfg: expected an AttentionConfig, got {type(cfg).__name__}")
    if not isinstance(params, Mapping):
        raise ValueError(f"params: expected a dict of tensors (wq, wk, wv, wo, ...), got {type(params).__name__}")
    check_params_device(x_TH, params)
    T, H = x_TH.shape
    N, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim  # N % G == 0: AttentionConfig checks it
    if cfg.kv_rank is not None:
        mats, norms = mla_shapes(H, cfg)
    else:
        Dv = cfg.v_dim or D
        mats, norms = {"wq": (H, N * D), "wk": (H, G * D), "wv": (H, G * Dv), **out_shapes(H, cfg)}, {}
        if cfg.q_rank is not None:  # the queries from a q latent (DeepSeek-V4's)
            mats, norms = gqa_q_shapes(H, cfg) | {k: v for k, v in mats.items() if k != "wq"}, {"q_a_norm": (cfg.q_rank,)}
        if not cfg.has_wv:  # the values are the keys' projection (k_eq_v) or the keys (kv_shared)
            del mats["wv"]
        if cfg.moa_experts is not None:  # a mixture of attention heads: each expert's query and output projections, and the router
            E = cfg.moa_experts
            mats.update(wq=(E, H, G * D), wo=(E, G * Dv, H))
    for name, shape in mats.items():
        w = params.get(name)
        if w is None or tuple(w.shape) != shape or w.dtype != x_TH.dtype:
            got = f"{w.dtype} {list(w.shape)}" if w is not None else "nothing"
            raise ValueError(f"params['{name}']: expected {x_TH.dtype} {list(shape)}, got {got}")
    for name, shape in norms.items():
        w = params.get(name)
        if w is None or tuple(w.shape) != shape:
            raise ValueError(f"params['{name}']: expected a {list(shape)} norm weight, got {list(w.shape) if w is not None else 'nothing'}")
    # an output bias, attention sinks and the output gate's weight, either kind
    extras = {"bo": (H,), "sinks": (N,), "wg": (q_in(cfg) if cfg.gate_on_q else H, N if cfg.gate_per_head else N * (cfg.v_dim or D)), "bg": (N,),
              "alibi": (N,)}
    for name, shape in extras.items():
        w = params.get(name)
        own = name in ("wg", "bo")  # in x's dtype: a float32 bo made y float32
        if w is not None and (tuple(w.shape) != shape or not w.is_floating_point() or (own and w.dtype != x_TH.dtype)):
            kind = x_TH.dtype if own else "a float"
            raise ValueError(f"params['{name}']: expected {kind} {list(shape)} tensor or none, got {w.dtype} {list(w.shape)}")
    if params.get("bg") is not None and params.get("wg") is None:
        raise ValueError("params['bg']: the output gate's bias per head, needs its weight wg")
    if params.get("alibi") is not None and cfg.kv_rank is not None:
        raise ValueError("params['alibi']: ALiBi's slopes bias grouped-query attention's scores, not multi-latent attention's (cfg.kv_rank)")
    if cfg.kv_rank is not None:
        index = index_shapes(H, cfg)
        for name, shape in index.items():
            w = params.get(name)
            if w is None or tuple(w.shape) != shape or not w.is_floating_point():
                raise ValueError(f"params['{name}']: expected a float {list(shape)} tensor (the indexer of cfg.index_topk), "
                                 f"got {f'{w.dtype} {list(w.shape)}' if w is not None else 'nothing'}")
        unknown = set(params) - set(mats) - set(norms) - set(extras) - set(index)
        if unknown:
            raise ValueError(f"params: unknown multi-latent attention parameters {sorted(unknown)} (expected {sorted(mats) + sorted(norms) + sorted(index)}, "
                             "optional bo, sinks, wg)")
        _check_ctx(ctx, T, cfg.rot_dim)
        return
    optional = {"bq": (N * D,), "bk": (G * D,), **({"bv": (G * (cfg.v_dim or D),)} if cfg.has_wv else {})}
    weights = qk_norm_shapes(cfg)  # "rms" has none, "head_k" the keys' alone
    optional.update(weights)
    if cfg.qk_norm_bias:  # the LayerNorms' biases, of their weights' shapes
        optional.update({name + "_bias": shape for name, shape in weights.items()})
    for name in ("q_norm", "k_norm"):
        if (params.get(name) is not None) != (name in weights):
            raise ValueError(f"params['{name}']: expected {'a weight' if name in weights else 'none'} with cfg.qk_norm = {cfg.qk_norm!r}")
        if (params.get(name + "_bias") is not None) != cfg.qk_norm_bias:
            raise ValueError(f"params['{name}_bias']: expected {'a bias' if cfg.qk_norm_bias else 'none'} with cfg.qk_norm_bias = {cfg.qk_norm_bias}")
    for name, shape in optional.items():
        w = params.get(name)
        if w is not None and tuple(w.shape) != shape:
            raise ValueError(f"params['{name}']: expected {list(shape)}, got {list(w.shape)}")
        if w is not None and name in ("bq", "bk", "bv") and w.dtype != x_TH.dtype:  # a float32 bq made the queries float32, which SDPA refused
            raise ValueError(f"params['{name}']: expected {x_TH.dtype} {list(shape)} tensor, got {w.dtype} {list(w.shape)}")
    compress = compress_shapes(H, cfg)  # heavily compressed attention's compressor
    if compress and params.get("alibi") is not None:
        raise ValueError("params['alibi']: ALiBi's distances are the keys', not heavily compressed attention's entries (cfg.compress_rate)")
    for name, shape in compress.items():
        w = params.get(name)
        if w is None or tuple(w.shape) != shape or not w.is_floating_point():
            raise ValueError(f"params['{name}']: expected a float {list(shape)} tensor (the compressor of cfg.compress_rate), "
                             f"got {f'{w.dtype} {list(w.shape)}' if w is not None else 'nothing'}")
    index = index_shapes(H, cfg)  # block-sparse attention's indexer
    for name, shape in index.items():
        w = params.get(name)
        if w is None or tuple(w.shape) != shape or w.dtype != x_TH.dtype:
            raise ValueError(f"params['{name}']: expected {x_TH.dtype} {list(shape)} (the indexer of cfg.index_topk_blocks), "
                             f"got {f'{w.dtype} {list(w.shape)}' if w is not None else 'nothing'}")
    router = {} if cfg.moa_experts is None else {"moa_router": (H, cfg.moa_experts)}
    if router:  # a mixture of attention heads: its router, float32 as a MoE's
        w = params.get("moa_router")
        if w is None or tuple(w.shape) != router["moa_router"] or w.dtype != torch.float32:
            raise ValueError(f"params['moa_router']: the attention experts' router, expected float32 {list(router['moa_router'])}, "
                             f"got {f'{w.dtype} {list(w.shape)}' if w is not None else 'nothing'}")
        for name in ("bq", "wg"):
            if params.get(name) is not None:
                raise ValueError(f"params['{name}']: not with a mixture of attention heads (cfg.moa_experts), whose queries are its experts'")
    unknown = set(params) - {*mats, *norms, *optional, *extras, *index, *router, *compress}
    if unknown:
        raise ValueError(f"params: unknown attention parameters {sorted(unknown)} (wq (or wq_a, q_a_norm, wq_b with cfg.q_rank), wk, wv, wo (and wo_a "
                         "with cfg.o_groups), optional bq, bk, bv, q_norm, k_norm, q_norm_bias, "
                         "k_norm_bias, bo, sinks, wg, bg, alibi; index_wq, index_wk, index_q_norm, index_k_norm with cfg.index_topk_blocks; compress_wkv, "
                         "compress_wg, compress_bias, compress_norm with cfg.compress_rate; index_wq, index_w, index_compress_wkv, index_compress_wg, "
                         "index_compress_bias, index_compress_norm with cfg.compress_topk)")
    if index and (params.get("sinks") is not None or params.get("alibi") is not None):
        raise ValueError(f"params['{'sinks' if params.get('sinks') is not None else 'alibi'}']: not with block-sparse attention (cfg.index_topk_blocks)")
    if (cfg.window is not None or cfg.chunk is not None) and getattr(ctx, "local_cos", None) is not None:
        return  # a local layer's own tables, which attention checks against it
    _check_ctx(ctx, T, cfg.rot_dim or D)


def _check_ctx(ctx, T: int, rot: int) -> None:
    if not isinstance(ctx, AttentionContext):
        raise ValueError(f"ctx: expected the AttentionContext of attention_context(...), got {type(ctx).__name__}")
    if ctx.cos.shape != (T, rot // 2):
        raise ValueError(f"ctx: RoPE tables of shape {tuple(ctx.cos.shape)} do not fit x's {T} tokens and rot_dim {rot} (expected ({T}, {rot // 2}))")


def _additive_mask(ctx: AttentionContext, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The context's bool mask (ctx.mask or ctx.local_mask, by identity) as SDPA's additive
    mask of `dtype`, made once per context (AttentionContext.additive_masks): the same bits
    SDPA's own conversion gives (0 where True, -inf where False). Any other mask (a
    layer's own: a top-k choice, compressed entries appended), and a mask seen while
    compiling, goes to SDPA as it is."""
    if torch.compiler.is_compiling() or mask.dtype != torch.bool or not (mask is ctx.mask or mask is ctx.local_mask):
        return mask
    key = (id(mask), dtype)
    made = ctx.additive_masks.get(key)
    if made is None or made[0] is not mask:  # the mask is kept with its copy: its id stays its own
        made = ctx.additive_masks[key] = (mask, torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf")))
    return made[1]


def attention(x: torch.Tensor, params, cfg: AttentionConfig, ctx: AttentionContext, *, heads_mean=None, index_choice=None):
    """Causal grouped-query self-attention over packed documents; no host sync.

    Args:
        x: [T, H] packed tokens. params: wq, wk, wv, wo (module docstring); optional biases
            bq [N D], bk [G D], bv [G Dv] added to the projections; q_norm, k_norm with cfg.qk_norm;
            optional output bias bo [H] (under tensor parallel: its 1/tp share, the ranks'
            outputs being summed), attention sinks [N] (module docstring; either kind) and
            an output gate wg [H, N Dv] ([H, N] with cfg.gate_per_head): the heads' outputs
            times cfg.gate_act(x wg), channel by channel (or head by head), before wo (gated
            attention, AFMoE's gate_proj, Laguna's g_proj; either kind), with an optional bias
            per head bg [N] added to the head's gate pre-activations (Beam's gate_bias).
            Grouped-query attention's optional ALiBi slopes alibi [N] float (alibi_slopes;
            constants, not weights): m_n (j - i) added to head n's scaled (and capped) score
            of query i and key j, i and j ctx's token_index and kv_index (by default the
            tokens' places in x), so that within a document a key d tokens back gets -m_n d.
            Multi-latent attention (cfg.kv_rank): wq [H, N D] or wq_a [H, q_rank],
            q_a_norm [q_rank], wq_b [q_rank, N D]; wkv_a [H, kv_rank + R] (latent, then
            the shared rotary key), kv_a_norm [kv_rank], wkv_b [kv_rank, N (D - R + v_dim)]
            (per head: key nope part, then value); wo [N v_dim, H].
        cfg: AttentionConfig.
        ctx: the micro-batch's AttentionContext (attention_context): RoPE tables and mask,
            and under context parallel its gather_kv (x then holds this rank's T/cp tokens;
            in decoding, the new tokens, the cache's gather_kv supplying the earlier keys).
        heads_mean: when cfg and params hold a slice of the heads (tensor parallel,
            fmoe.parallel.HeadShard.mean): averages per-token statistics [T, n] over the
            ranks holding the others, each the same number of heads, so that qk_norm="proj"
            normalises over the whole projection (one call for q's and k's: n = 2), and
            DeepSeek sparse attention's indexer loss sums every rank's heads (n = J). None:
            this process holds every head.
        index_choice: for a layer of cfg.index_shared (DeepSeek sparse attention without an
            indexer of its own), the keys it attends to: [T, J] int64 slots, an earlier
            layer's stats["index_choice"] over the same context; None otherwise.
    Returns:
        (y [T, H] in x's dtype, stats); under torch.autocast y is what its matmuls give, the
        autocast dtype (float32 where a float32 bo is added). stats is a TensorDict, empty but for DeepSeek sparse
        attention's "index_choice" ([T, J] int64, J = min(index_topk, S): the keys each query
        attended to, best first, -1 in an empty slot; index_slots; a layer
        with an indexer) and "index_loss" (a float32 scalar with the indexer's gradient, when
        cfg.index_loss and gradients are on: under context parallel this rank's share, under
        tensor parallel the whole loss on every rank; block-sparse attention's, block_index_loss,
        under tensor parallel this rank's heads' share), kept for the layers' common (output,
        stats) form.
    """
    _check_attention(x, params, cfg, ctx)
    if heads_mean is not None and not callable(heads_mean):
        raise ValueError(f"heads_mean: expected a function of a [T, n] tensor (fmoe.parallel.HeadShard.mean) or None, got {type(heads_mean).__name__}")
    local = cfg.window is not None or cfg.chunk is not None  # a sliding window's or a chunk's mask
    if local and (cfg.window, cfg.chunk) != (ctx.window, ctx.chunk):
        raise ValueError(f"ctx: built for the sliding window {ctx.window} and chunk {ctx.chunk}, this layer attends over window {cfg.window} "
                         f"and chunk {cfg.chunk} (build the context with an AttentionConfig of the layer's window or chunk)")
    if local and cfg.local_rope_base != ctx.local_rope_base:
        raise ValueError(f"ctx: built with the local layers' RoPE base {ctx.local_rope_base}, this layer's is {cfg.local_rope_base} "
                         "(build the context with the layer's AttentionConfig)")
    if local and ctx.local_cos is not None and cfg.compress_rate is None:  # the local layers' own RoPE tables (not a compressed layer's)
        rot = cfg.local_rot_dim or cfg.rot_dim or cfg.head_dim
        if ctx.local_cos.shape[-1] * 2 != rot:
            raise ValueError(f"ctx: built with the local layers' RoPE over {ctx.local_cos.shape[-1] * 2} channels, this layer rotates {rot} "
                             "(build the context with the layer's AttentionConfig)")
        ctx = dataclasses.replace(ctx, cos=ctx.local_cos, sin=ctx.local_sin)
        _check_ctx(ctx, x.shape[0], rot)
    if cfg.rope and not local and ctx.rope is not None and ctx.rope != _rope_knobs(cfg):  # the tables of other knobs rotated silently
        name, built = next((n, v) for (n, v), (_, own) in zip(ctx.rope, _rope_knobs(cfg)) if v != own)
        raise ValueError(f"ctx: built with {name} = {built!r}, this layer's is {getattr(cfg, name)!r} (build the context with the layer's "
                         "AttentionConfig)")
    if cfg.temperature_floor is not None and ctx.positions is None:
        raise ValueError("ctx: has no positions for cfg.temperature_floor's query scales (build it with attention_context)")
    if ctx.latents not in (None, "absorbed", "expanded"):
        raise ValueError(f"ctx.latents: expected None, 'absorbed' or 'expanded', got {ctx.latents!r}")
    if ctx.latents is not None and cfg.kv_rank is None:
        raise ValueError("ctx.latents: a cache of latents is multi-latent attention's (cfg.kv_rank), not grouped-query attention's")
    if ctx.latents == "expanded" and ctx.gather_kv is None:
        raise ValueError("ctx.latents: 'expanded' needs the cache's gather_kv (the latents of every key)")
    sparse = cfg.index_topk is not None  # DeepSeek sparse attention: the indexer's top-k keys
    shared = cfg.index_shared  # ... an earlier layer's choice of them (AttentionConfig: only with index_topk)
    # the indexer's loss: with gradients on, and some indexer weight to train
    blocks = cfg.index_topk_blocks is not None  # block-sparse attention: its indexer's choice of blocks
    csa = cfg.compress_topk is not None  # compressed sparse attention: the indexer's choice of compressed entries
    index_names = [n for n in compress_shapes(x.shape[1], cfg) if n.startswith("index_")] if csa else index_shapes(x.shape[1], cfg)
    train_index = ((sparse or blocks or csa) and not shared and cfg.index_loss and torch.is_grad_enabled() and ctx.compressed is None
                   and any(params[name].requires_grad for name in index_names))
    if shared != (index_choice is not None):
        raise ValueError("index_choice: expected the keys an earlier layer chose (its stats['index_choice']) for a layer of cfg.index_shared, and None "
                         f"otherwise; got {'None' if index_choice is None else 'a choice'} with index_shared = {cfg.index_shared}")
    # the sparse kernel (fmoe.ops.sparse_attention: each query over its chosen keys alone) on the
    # absorbed form where Triton runs (training, and decoding over a cache: a prompt's
    # "expanded" latents absorbed too); the dense reference otherwise
    kernel = sparse and use_triton(cfg.impl, x)
    block_kernel = blocks and use_triton(cfg.impl, x)  # block-sparse attention's likewise, over each query's chosen blocks' keys
    latents = "absorbed" if kernel and ctx.latents == "expanded" else ctx.latents
    # wq_b's input, made once where the indexer's queries (its normed q latent) or the gate (gate_on_q) read it too
    q_lat = _mla_q_latent(x, params, cfg) if (sparse and not shared) or cfg.gate_on_q or cfg.compress_topk is not None else None
    q_index = None if q_lat is None else q_lat[:, :cfg.q_rank]
    wv_CNV = None
    if latents == "absorbed" or kernel:
        q_TND, k_TGD, v_TGD, wv_CNV = _mla_latent_qkv(x, params, cfg, ctx, q_lat)
    elif latents == "expanded":
        q_nope_TNP, q_rope_TNR, latent_TC, k_rope_T1R = _mla_parts(x, params, cfg, ctx, q_lat)
        q_TND = torch.cat([q_nope_TNP, q_rope_TNR], dim=-1)
        k_TGD, v_TGD = torch.cat([latent_TC[:, None, :], k_rope_T1R], dim=-1), latent_TC[:, None, :]  # the cache's form
    elif cfg.kv_rank is not None:
        q_TND, k_TGD, v_TGD = _mla_qkv(x, params, cfg, ctx, q_lat)
    else:
        moa = _moa_route(x, params, cfg) if cfg.moa_experts is not None else None  # the attention experts' routing (MoaRouting)
        q_TND, k_TGD, v_TGD = _gqa_qkv(x, params, cfg, ctx, heads_mean, moa, q_lat)
    index_k_SD = None
    if blocks:  # the indexer's queries and keys, of the detached tokens: differentiable only for its loss
        with torch.set_grad_enabled(train_index):
            index_q_TND, index_k_SD = block_index_qk(x.detach(), params, cfg, ctx.cos, ctx.sin)
        if ctx.gather_kv is not None:  # its keys ride beside the kv heads' (every rank's, the loss's gradient returning; or the cache's)
            k_TGD = torch.cat([k_TGD, _spread_keys(index_k_SD, k_TGD.shape[1]).to(k_TGD.dtype)], dim=-1)
    if sparse:
        if shared:  # a layer without an indexer caches zeros in the indexer key's place
            index_k_SD = x.new_zeros(x.shape[0], cfg.index_head_dim, dtype=torch.float32)
        else:  # differentiable only for the indexer's loss, whose gradient reaches the indexer's weights alone
            with torch.set_grad_enabled(train_index):
                index_k_SD = index_keys(x.detach(), params, cfg, ctx.cos, ctx.sin)
        if ctx.latents is not None:  # decoding: the indexer's key is cached after the latent and the rotated key
            k_TGD = torch.cat([k_TGD, index_k_SD.detach()[:, None, :].to(k_TGD.dtype)], dim=-1)
        elif ctx.gather_kv is not None and not shared:  # context parallel: every rank's indexer keys (the loss's gradient returns to each)
            index_k_SD = ctx.gather_kv(index_k_SD[:, None, :], index_k_SD[:, None, :0])[0][:, 0]
    if ctx.gather_kv is not None and cfg.compress_rate is not None and ctx.compressed is None and ctx.token_index is None:
        raise ValueError("ctx: compressed attention (cfg.compress_rate) over gathered keys needs the entries' cache (decoding: ctx.compressed) or "
                         "the split's token_index and kv_index (context parallel)")
    if ctx.gather_kv is not None:  # every rank's keys and values (cp), or the cache's and these (decoding)
        k_TGD, v_TGD = ctx.gather_kv(k_TGD, v_TGD)
        n_keys = ctx.mask.shape[-1]
        if k_TGD.shape[0] != n_keys or v_TGD.shape[0] != n_keys:
            raise ValueError(f"ctx.gather_kv: returned {k_TGD.shape[0]} keys and {v_TGD.shape[0]} values, the mask has {n_keys} keys")
        if sparse and ctx.latents is not None:  # decoding: the cached indexer keys
            index_k_SD, k_TGD = k_TGD[:, 0, -cfg.index_head_dim:].float(), k_TGD[..., :-cfg.index_head_dim]
        if blocks:  # the indexer's keys back from their channels
            D = q_TND.shape[-1]
            index_k_SD, k_TGD = k_TGD[..., D:].reshape(n_keys, -1)[:, :cfg.index_head_dim], k_TGD[..., :D]
        if latents == "expanded":  # every key's latent and rotated key -> per-head keys and values
            k_TGD, v_TGD = _mla_expand(k_TGD[:, 0, :cfg.kv_rank], k_TGD[:, :, cfg.kv_rank:], params, cfg)
    q_NTD, k_GTD, v_GTD = (rearrange(t, "t h d -> h t d") for t in (q_TND, k_TGD, v_TGD))
    mask = ctx.local_mask if local else ctx.mask
    slots_TJ = None
    if sparse:
        if not isinstance(mask, (torch.Tensor, MaskRows)):
            raise ValueError("ctx: DeepSeek sparse attention (cfg.index_topk) needs the dense mask or its rows; build the context with this cfg "
                             "(attention_context)")
        if shared:
            J = min(cfg.index_topk, mask.shape[1])
            if not isinstance(index_choice, torch.Tensor) or index_choice.dtype != torch.int64 or index_choice.shape != (mask.shape[0], J):
                raise ValueError(f"index_choice: expected a [{mask.shape[0]}, {J}] int64 tensor of key slots (an earlier layer's over this context), "
                                 f"got {getattr(index_choice, 'dtype', type(index_choice).__name__)} {list(getattr(index_choice, 'shape', []))}")
            # the keys this layer's own mask allows too (the same, but for a local layer reusing a full one's)
            allowed = mask.at(slice(None), index_choice) if isinstance(mask, MaskRows) else mask.gather(1, index_choice.clamp(min=0))
            slots_TJ = torch.where((index_choice >= 0) & allowed, index_choice, -1)
        else:
            with torch.no_grad():
                slots_TJ = _index_choice(x, q_index, index_k_SD, params, cfg, ctx, mask)
        if not kernel:  # the dense reference attends under the choice's mask
            mask = slots_mask(slots_TJ, mask.shape[1])
    sinks, slopes_N = params.get("sinks"), params.get("alibi")
    # DeepSeek-V4's layers (one kv head that is its values; a window, compressed entries) where Triton runs: each query over
    # its window's keys and the entries it attends to alone, on the sparse kernel (O(T (window + entries)), never [N, T, S]);
    # the context's mask may be its rule (MaskRows: never [T, S] either)
    shared_kernel = (cfg.kv_shared and k_GTD.shape[0] == 1 and (cfg.window is not None or cfg.compress_rate is not None) and not sparse
                     and not blocks and (isinstance(mask, MaskRows) or (isinstance(mask, torch.Tensor) and mask.ndim == 2))
                     and cfg.score_softcap is None and slopes_N is None and cfg.impl != "flex" and use_triton(cfg.impl, x))
    # the reference with sinks, a cap, ALiBi's biases (or the probabilities the CSA indexer's loss reads): blocks of queries,
    # each reading its rows of a MaskRows alone
    with_sinks = sinks is not None or cfg.score_softcap is not None or slopes_N is not None or (csa and train_index)
    if isinstance(mask, MaskRows) and not (block_kernel or sparse or shared_kernel or with_sinks):  # no kernel, no blocks: the dense mask
        mask = mask.rows()
    if blocks and not isinstance(mask, (torch.Tensor, MaskRows)):
        raise ValueError("ctx: block-sparse attention (cfg.index_topk_blocks) needs the dense mask or its rows; build the context with this cfg "
                         "(attention_context)")
    keep_TS = None  # the compressed entries' mask (or rule) on the shared kernel's path; the dense path appends it to mask
    if cfg.compress_rate is not None:  # heavily compressed attention: the entries after the keys, each under its own rule
        if not isinstance(mask, (torch.Tensor, MaskRows)) or (ctx.compressed is None and (ctx.cu_seqlens is None or ctx.positions is None)):
            raise ValueError("ctx: heavily compressed attention (cfg.compress_rate) needs the dense mask or its rule (MaskRows), the documents "
                             "and the positions; build the context with attention_context and this cfg (not FlexAttention's block mask)")
        index_keys_SD = None
        if ctx.compressed is not None and cfg.compress_topk is not None:  # decoding: the cache's entries and the indexer's
            entries_SD, index_keys_SD, keep_TS = _decode_sparse_entries(x, params, cfg, ctx)
        elif ctx.compressed is not None:  # decoding: the cache's entries, the runs the new tokens complete added

            def entries(c_KMD, g_KMD, first_K):
                return run_entries(c_KMD, g_KMD.float() + params["compress_bias"].float(), *rope_tables(first_K, cfg), params["compress_norm"], cfg)

            entries_SD, keep_TS = ctx.compressed(*compressor_inputs(x, params, cfg), entries)
        else:  # the entries of the whole micro-batch (with the indexer's: one pass, one gather under context parallel)
            parts = [("compress_", *compressor_inputs(x, params, cfg))]
            if cfg.compress_topk is not None:  # the indexer's, of the detached tokens: differentiable only for its loss
                with torch.set_grad_enabled(train_index):
                    parts.append(("index_compress_", *compressor_inputs(x.detach(), params, cfg, prefix="index_compress_")))
            (entries_SD, *index_part), keep_TS = _compressed_parts(parts, params, cfg, ctx, rows=shared_kernel)
            index_keys_SD = index_part[0] if index_part else None
        if cfg.compress_topk is not None:  # compressed sparse attention: the indexer's choice of the entries each query sees
            slots_TJ = compressed_choice(x, q_index, index_keys_SD, params, cfg, ctx, keep_TS)
            keep_TS = None if shared_kernel else slots_mask(slots_TJ, keep_TS.shape[1])
        k_GTD = v_GTD = torch.cat([k_GTD, entries_SD[None].to(k_GTD.dtype)], dim=1)  # their own values (kv_shared)
        n_keys = mask.shape[1]  # the entries' columns follow the keys'
        if not shared_kernel:
            mask = torch.cat([_mask_rows(mask), _mask_rows(keep_TS)], dim=1)
    lse_TN = None
    if blocks:  # each kv head's queries under its own choice of blocks
        G, r = k_GTD.shape[0], q_NTD.shape[0] // k_GTD.shape[0]
        with torch.no_grad():
            q_pos, kv_pos = (document_offsets(ctx, index, n) for index, n in ((ctx.token_index, mask.shape[0]), (ctx.kv_index, mask.shape[1])))
            chosen_GTJ = block_index_choice(index_q_TND.detach(), index_k_SD.detach(), mask, q_pos, kv_pos, cfg)
        if block_kernel:  # kv head g's queries over the keys of their chosen blocks alone: the sparse kernel, values as the rows' first channels
            q_index = torch.arange(mask.shape[0], device=x.device) if ctx.token_index is None else ctx.token_index.long()
            with torch.no_grad():
                slots_GTJ = block_index_slots(chosen_GTJ, q_pos, q_index - q_pos, ctx.key_order, cfg)
            out_NTD, lse_TN = _blocks_by_kernel(q_NTD, k_GTD, v_GTD, slots_GTJ, cfg)
        else:  # the dense reference under the choice's mask
            keep_GTS = block_index_keep(chosen_GTJ, kv_pos, mask, cfg)
            q_GRTD = q_NTD.view(G, r, *q_NTD.shape[1:])
            k_GRSD, v_GRSD = (t[:, None].expand(G, r, *t.shape[1:]) for t in (k_GTD, v_GTD))
            out_NTD = F.scaled_dot_product_attention(q_GRTD, k_GRSD, v_GRSD, attn_mask=keep_GTS[:, None], scale=softmax_scale(cfg)).flatten(0, 1)
    elif shared_kernel:
        out_NTD, target_TJ = _shared_kv_by_kernel(q_NTD, k_GTD[0], mask, cfg, sinks, keep=keep_TS, chosen=slots_TJ if csa else None,
                                                  target=csa and train_index)
    elif kernel:  # every head over each query's chosen latents; the latent output to each head's values below
        o_TNC, lse_TN = sparse_attention(q_TND, k_TGD[:, 0], slots_TJ, v_dim=cfg.kv_rank, scale=softmax_scale(cfg), check=False, impl=cfg.impl)
        o_TNC = _with_sinks(o_TNC, lse_TN, sinks)  # HY-V4's
        out_NTD = rearrange(o_TNC, "t n c -> n t c")
    elif isinstance(mask, (torch.Tensor, MaskRows)) and with_sinks:
        alibi = None  # the reference, with sinks, a cap or ALiBi's biases (or the probabilities the CSA indexer's loss reads)
        if slopes_N is not None:
            alibi = (slopes_N, *_alibi_distances(ctx, *mask.shape, x.device))
        out_NTD, target_TJ = _attention_with_sinks(q_NTD, k_GTD, v_GTD, mask, softmax_scale(cfg), sinks, cfg.score_softcap, alibi,
                                                   chosen=(slots_TJ, n_keys) if csa and train_index else None)
    elif isinstance(mask, torch.Tensor):  # the reference
        # as a batch of one: torch's CPU flash kernel takes 4-D inputs only; on 3-D ones SDPA falls to its math path,
        # which keeps float32 scores and probabilities per head (12 N bytes a query-key pair: 3.1 GB at T = 8192, N = 4)
        q, k, v, Dv = q_NTD, k_GTD, v_GTD, v_GTD.shape[-1]
        if not q.is_cuda and Dv != q.shape[-1] and (torch.compiler.is_compiling() or torch.backends.cuda.flash_sdp_enabled()):
            # and the same head dim for q, k and v (multi-latent attention's 192 and 128): zeros added to the smaller change no
            # score (the scale is given) and no output channel kept (not where the flash kernels are turned off: sdpa_kernel)
            D = max(Dv, q.shape[-1])
            q, k, v = (F.pad(t, (0, D - t.shape[-1])) for t in (q, k, v))
        out_NTD = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=_additive_mask(ctx, mask, q.dtype), scale=softmax_scale(cfg),
                                                 enable_gqa=True)[0, ..., :Dv]
    else:
        if not x.is_cuda and torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params.values())):
            raise ValueError("cfg.impl: FlexAttention has no backward on CPU; use impl='torch' (or 'auto') to train on CPU")
        from torch.nn.attention.flex_attention import AuxRequest, flex_attention

        # the fused kernel on CUDA; eager on CPU, which tests the mask against the reference
        # (inside a compiled model dynamo compiles flex_attention itself, with the model)
        flex = _compiled_flex() if x.is_cuda and not torch.compiler.is_compiling() else flex_attention
        kw = dict(block_mask=mask, scale=softmax_scale(cfg), enable_gqa=True)
        mods = {}
        if cfg.score_softcap is not None:  # each scaled score capped (Gemma 2's); a tensor: flex_attention compiles its score_mod,
            # and a float captured there comes back symbolic once a process has seen two caps, which its kernel refuses
            mods["cap"] = torch.full((), float(cfg.score_softcap), device=q_NTD.device)
        if slopes_N is not None:  # ALiBi's bias on each scaled score
            q_index, kv_index = _alibi_distances(ctx, q_NTD.shape[1], k_GTD.shape[1], x.device)
            mods.update(slopes_N=slopes_N.float(), q_index=q_index, kv_index=kv_index)
        if mods:
            kw["score_mod"] = functools.partial(_score_mod, **mods)
        Dv = v_GTD.shape[-1]
        # the compiled kernel needs head dims of at least 16: zeros added to q, k and v change no
        # score (the scale is passed) and only add output columns, cut below (on CPU too, so
        # that the tests there take this path)
        q_NTD, k_GTD, v_GTD = (F.pad(t, (0, _FLEX_MIN_DIM - t.shape[-1])) if t.shape[-1] < _FLEX_MIN_DIM else t
                               for t in (q_NTD, k_GTD, v_GTD))
        if not q_NTD.shape[1]:  # no token (flex_attention's kernel refuses an empty length): [N, 0, Dv], tied to q, k, v for their zero gradients
            out_NTD = q_NTD.new_zeros(q_NTD.shape[0], 0, q_NTD.shape[-1]) + (q_NTD.sum() + k_GTD.sum() + v_GTD.sum())
        elif sinks is None:
            out_NTD = flex(q_NTD[None], k_GTD[None], v_GTD[None], **kw)[0]
        else:  # a sink adds exp(sink) to the denominator: out * Z / (Z + e^sink), Z = e^lse
            out_1NTD, aux = flex(q_NTD[None], k_GTD[None], v_GTD[None], return_aux=AuxRequest(lse=True), **kw)
            keep_NT = torch.sigmoid(aux.lse[0] - sinks.float()[:, None])
            out_NTD = (out_1NTD[0] * keep_NT[..., None]).to(q_NTD.dtype)
        out_NTD = out_NTD[..., :Dv]
    if wv_CNV is not None:  # absorbed: each head's latent output to its values
        out_NTD = torch.einsum("ntc,cnv->ntv", out_NTD, wv_CNV)
    if cfg.kv_shared and cfg.rope:  # the values were rotated with the keys: each output rotated back at its query's position
        out_NTD = rearrange(_gqa_rope(rearrange(out_NTD, "n t d -> t n d"), ctx.cos, -ctx.sin, cfg), "t n d -> n t d")
    if cfg.out_norm:  # each head's output over its channels, without weights (Muse Spark's o_norm)
        out_NTD = _rms_norm(out_NTD, None, cfg.norm_eps)
    out_TQ = rearrange(out_NTD, "n t d -> t (n d)")
    if params.get("wg") is not None:  # gated attention: each output channel (or head) times its gate
        out_TQ = _gated(out_TQ, matmul(q_lat if cfg.gate_on_q else x, params["wg"], fp8=cfg.fp8, impl=cfg.impl), cfg, params.get("bg"))
    if cfg.moa_experts is not None:  # each slot's heads through its expert's output projection, weighted and summed
        y_TH = _moa_out(out_TQ, params, cfg, moa)
    else:
        y_TH = out_projection(out_TQ, params, cfg)
    if params.get("bo") is not None:
        y_TH = y_TH + params["bo"]
    stats = {"index_choice": slots_TJ} if sparse and not shared else {}
    if cfg.moa_experts is not None and torch.is_grad_enabled() and params["moa_router"].requires_grad:  # the router's balance
        scores_TE, _, counts_E = _aux_scores(moa.logits_TE, cfg.moa_topk, return_counts=True, impl=cfg.impl)
        n_tokens = x.shape[0]
        if ctx.linear_cp is not None:  # context parallel: every rank's counts and tokens, this rank's share of the loss
            counts_E, n_tokens = ctx.linear_cp.sum_counts(counts_E), n_tokens * ctx.linear_cp.cp
        stats["moa_aux_loss"] = load_balancing_loss(scores_TE, counts_E, k=cfg.moa_topk, n_tokens=n_tokens)
    if train_index and blocks:  # each kv head's heads' attention over its chosen blocks, the indexer's loss against it
        with torch.no_grad():
            if block_kernel:  # each slot's probability summed over the heads, then over each block's slots
                target_GTJ = _blocks_target_by_kernel(q_NTD, k_GTD, v_GTD, slots_GTJ, lse_TN, cfg)
            else:  # the reference's probabilities for blocks of queries (never [N, T, S] at once)
                T, block = q_NTD.shape[1], _query_block(q_NTD.shape[0], k_GTD.shape[1])
                target_GTJ = torch.cat([block_index_target(_attention_probs(q_NTD[:, t0:t0 + block], k_GTD,
                                                                            keep_GTS[:, t0:t0 + block].repeat_interleave(r, dim=0), softmax_scale(cfg)),
                                                           chosen_GTJ[:, t0:t0 + block], kv_pos, cfg) for t0 in range(0, T, block)], dim=1)
        cp = ctx.gather_kv is not None  # under context parallel this rank's share: its queries' sum over the micro-batch's count
        stats["index_loss"] = block_index_loss(x.detach(), index_k_SD, mask, chosen_GTJ, target_GTJ, kv_pos, params, cfg, ctx,
                                               n_queries=mask.shape[1] if cp else x.shape[0])
    elif train_index and csa:  # the heads' attention on each query's chosen entries, the indexer's loss against it
        if heads_mean is not None:  # tensor parallel: every rank's heads (a mean over the ranks; the scale goes in index_loss)
            with torch.no_grad():
                target_TJ = heads_mean(target_TJ)
        # under context parallel this rank's share: its queries' sum over the micro-batch's count (the keys')
        stats["index_loss"] = _index_loss_blocks(x.detach(), q_index.detach(), index_keys_SD, slots_TJ, target_TJ, params, cfg, ctx,
                                                 n_queries=n_keys if ctx.gather_kv is not None else x.shape[0])
    elif train_index:
        with torch.no_grad():  # the attention's distribution over each query's chosen keys, summed over its heads
            if kernel:
                target_TJ = sparse_attention_probs(q_TND, k_TGD[:, 0], slots_TJ, lse_TN, v_dim=cfg.kv_rank, scale=softmax_scale(cfg), check=False,
                                                   impl=cfg.impl)
            else:  # the reference's probabilities, for blocks of queries (never [N, T, S] at once, as _attention_with_sinks)
                T, block = q_NTD.shape[1], _query_block(q_NTD.shape[0], k_GTD.shape[1])
                target_TJ = torch.cat([_attention_probs(q_NTD[:, t0:t0 + block], k_GTD, mask[t0:t0 + block], softmax_scale(cfg)).sum(0)
                                       .gather(1, slots_TJ[t0:t0 + block].clamp(min=0)) * (slots_TJ[t0:t0 + block] >= 0)
                                       for t0 in range(0, T, block)])
            if heads_mean is not None:  # tensor parallel: every rank's heads (a mean over the ranks; the scale goes in index_loss)
                target_TJ = heads_mean(target_TJ)
        # under context parallel this rank's share: its queries' sum over the micro-batch's count (the keys')
        cp = ctx.gather_kv is not None and ctx.latents is None
        stats["index_loss"] = _index_loss_blocks(x.detach(), q_index.detach(), index_k_SD, slots_TJ, target_TJ, params, cfg, ctx,
                                                 n_queries=mask.shape[1] if cp else x.shape[0])
    return y_TH, TensorDict(stats, batch_size=[])


class _AttachLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, loss):
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return x.clone()  # not a view: the zero-bubble schedules detach stage outputs in place

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=grad.device)


def attach_loss(x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """x, with `loss` (a scalar computed from activations before it) riding along: the
    forward returns x unchanged; the backward passes x's gradient through and gives `loss`
    the gradient 1, as if it had been added to the final loss (Megatron's
    MoEAuxLossAutoScaler). For a loss that trains parameters from inside a layer without
    being added to the model's loss (DeepSeek sparse attention's indexer loss,
    fmoe.model.Attention: weigh it first, attach_loss(y, c * loss)), or for the losses of a
    pipeline stage's layers that are not on the last stage (fmoe.parallel)."""
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        raise ValueError(f"loss: expected a 0-D tensor, got {type(loss).__name__} of shape {getattr(loss, 'shape', None)}")
    return _AttachLoss.apply(x, loss)


def index_loss(scores_TJ: torch.Tensor, target_TJ: torch.Tensor, keep_TJ: torch.Tensor, *, n_queries: Optional[int] = None) -> torch.Tensor:
    """DeepSeek sparse attention's indexer loss (DeepSeek-V3.2's sparse training stage), a
    float32 scalar: the mean over the T queries of KL(p_t || softmax(I_t)) over the keys
    each attended to (the J slots of its row where keep [T, J] is True), where p_t is
    target [T, J] (the attention's distribution over those keys summed over its heads, no
    gradient; renormalised here) and I_t the indexer's scores [T, J] of the same keys
    (index_scores with slots=). Its gradient reaches what the scores were computed from:
    attention computes them from the detached tokens and q latents, so that it reaches the
    indexer's weights only, as DeepSeek trains the indexer apart from the model. n_queries:
    the mean's count (None: T); under context parallel the micro-batch's T, so that this
    rank's T/cp queries give its share of the loss (the shares add up to one process's)."""
    if n_queries is not None and (isinstance(n_queries, bool) or not isinstance(n_queries, int) or n_queries < 1):
        raise ValueError(f"n_queries: expected a positive int (the queries the mean runs over) or None, got {n_queries!r}")
    if scores_TJ.shape != target_TJ.shape or scores_TJ.shape != keep_TJ.shape or keep_TJ.dtype != torch.bool:
        raise ValueError(f"keep: expected bool [T, J] like scores {list(scores_TJ.shape)} and target {list(target_TJ.shape)}, "
                         f"got {keep_TJ.dtype} {list(keep_TJ.shape)}")
    with torch.no_grad():
        p_TJ = torch.where(keep_TJ, target_TJ.float(), 0.0)
        p_TJ = p_TJ / p_TJ.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    log_q_TJ = torch.log_softmax(scores_TJ.float().masked_fill(~keep_TJ, float("-inf")), dim=-1)
    kl_TJ = torch.where(keep_TJ, torch.xlogy(p_TJ, p_TJ) - p_TJ * log_q_TJ.masked_fill(~keep_TJ, 0.0), 0.0)
    return kl_TJ.sum(-1).sum() / (scores_TJ.shape[0] if n_queries is None else n_queries)


def _index_loss_block(x_BH, q_lat_BC, keys_SD, slots_BJ, target_BJ, cos_BR, sin_BR, params, cfg: AttentionConfig) -> torch.Tensor:
    """A block of queries' indexer loss, summed over them."""
    scores_BJ = index_scores(x_BH, q_lat_BC, keys_SD, params, cfg, cos_BR, sin_BR, slots=slots_BJ)
    return index_loss(scores_BJ, target_BJ, slots_BJ >= 0, n_queries=1)


def _index_loss_blocks(x_TH, q_lat_TC, keys_SD, slots_TJ, target_TJ, params, cfg: AttentionConfig, ctx: AttentionContext, *,
                       n_queries: int, rows: int = 1 << 28) -> torch.Tensor:
    """index_loss of index_scores(slots=) (attention's indexer loss, the sum over the queries
    divided by n_queries) for blocks of queries whose gathered keys and products [block, J,
    index_head_dim or index_heads] hold about `rows` floats, each block recomputed in the
    backward (torch.utils.checkpoint): only the inputs are kept, never those of every query
    (6 GiB per layer at T = 4096, J = 2048, 64 heads of 128)."""
    T, J = slots_TJ.shape
    block = max(1, rows // max(1, J * max(cfg.index_head_dim, cfg.index_heads)))
    fn = functools.partial(_index_loss_block, params=params, cfg=cfg)
    total = 0.0
    for t0 in range(0, T, block):
        b = slice(t0, t0 + block)
        total = total + checkpoint(fn, x_TH[b], q_lat_TC[b], keys_SD, slots_TJ[b], target_TJ[b], ctx.cos[b], ctx.sin[b], use_reentrant=False)
    return total / n_queries


def _score_mod(score, b, h, q_idx, kv_idx, cap: Optional[torch.Tensor] = None, slopes_N=None, q_index=None, kv_index=None):
    """FlexAttention's score_mod: the softcap cap tanh(score / cap) (a 0-D float32 tensor; None: none), then ALiBi's
    bias slopes_N[h] (kv_index[kv_idx] - q_index[q_idx]) (slopes_N None: none)."""
    if cap is not None:
        score = torch.tanh(score / cap) * cap
    if slopes_N is not None:
        score = score + slopes_N[h] * (kv_index[kv_idx] - q_index[q_idx]).to(score.dtype)
    return score


def _alibi_distances(ctx: AttentionContext, n_queries: int, n_keys: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries' [T] and the keys' [S] int64 indices ALiBi measures distances between:
    the context's token_index and kv_index, or 0 ... T - 1 and 0 ... S - 1."""
    q_index = ctx.token_index if ctx.token_index is not None else torch.arange(n_queries, device=device)
    kv_index = ctx.kv_index if ctx.kv_index is not None else torch.arange(n_keys, device=device)
    return q_index.long(), kv_index.long()


def alibi_slopes(n_heads: int, max_bias: float = 8.0, device=None) -> torch.Tensor:
    """ALiBi's slope per head [n_heads] float32 (attention's params["alibi"]; Press et al.,
    BLOOM's, MPT's alibi_bias_max 8, Falcon-RW's): with P = 2^ceil(log2 n_heads) the
    geometric run m_h = 2^(-max_bias h / P), h = 1 .. P, whole where n_heads = P, else its
    entries h = 2, 4, ... then h = 1, 3, ..., the first n_heads (the run of the power of two
    below n_heads, then every other slope of the next one's). Computed in float64, rounded
    once, on `device` (no copy from the host)."""
    check_positive_int("n_heads", n_heads)
    if isinstance(max_bias, bool) or not isinstance(max_bias, (int, float)) or not 0 < max_bias < math.inf:
        raise ValueError(f"max_bias: expected a positive finite number (8: ALiBi's), got {max_bias!r}")
    P = 1 << (n_heads - 1).bit_length()
    slopes = torch.exp2(-float(max_bias) / P * torch.arange(1, P + 1, device=device, dtype=torch.float64))
    if P != n_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes.float()


def _masked_scores(q_NTD, k_GTD, mask_TS, scale: float, softcap: Optional[float] = None, bias_NTS=None) -> torch.Tensor:
    """Each head's scores [N, T, S] float32 (the kv heads repeated to the query heads), capped
    at softcap tanh(s / softcap) where softcap is set, plus bias_NTS (ALiBi's; None: none),
    -inf where mask [T, S] is False."""
    (N, T, D), (G, S) = q_NTD.shape, k_GTD.shape[:2]
    # each kv head's r = N / G query heads as one [r T, D] product (never the keys repeated per head)
    scores = (q_NTD.float().reshape(G, N // G * T, D) @ k_GTD.float().transpose(1, 2)).view(N, T, S) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias_NTS is not None:
        scores = scores + bias_NTS
    return scores.masked_fill(~mask_TS, float("-inf"))


def _attention_probs(q_NTD, k_GTD, mask_TS, scale: float) -> torch.Tensor:
    """Each head's attention distribution [N, T, S] float32 under mask (a row without keys: 0)."""
    return torch.softmax(_masked_scores(q_NTD, k_GTD, mask_TS, scale), dim=-1).nan_to_num(0.0)


_SCORE_ROWS = 1 << 26  # the reference's scores per block of queries (float32 numbers): 256 MiB
_KEPT_SCORES = 1 << 22  # the most scores a layer's one block keeps for its backward (16 MiB); past it, recomputed there


def _query_block(n_heads: int, n_keys: int) -> int:
    """The queries of a block of the dense reference: their scores [n_heads, block, n_keys]
    hold about _SCORE_ROWS floats (at least one query)."""
    return max(1, _SCORE_ROWS // max(1, n_heads * n_keys))


def _attention_with_sinks(q_NTD, k_GTD, v_GTD, mask_TS, scale: float, sinks_N, softcap: Optional[float] = None, alibi=None, *,
                          chosen: Optional[tuple] = None):
    """The reference attention with sinks (None: none), capped scores (softcap, None: none)
    and ALiBi's biases (alibi: (slopes [N], query positions [T], key positions [S]), each
    block's biases made in the block; None: none): softmax over [the allowed scores, the head's
    sink], the sink's share dropped (it has no value), in float32: (out [N, T, Dv] in q's
    dtype, target). For blocks of queries whose scores [N, block, S] hold about
    _SCORE_ROWS floats, each recomputed in the backward (torch.utils.checkpoint): the scores
    and probabilities of every query, [N, T, S] float32, are never kept at once (5.4 GB per
    layer at 64 heads, T = 4096, S = 5120); one block of more than _KEPT_SCORES scores is
    recomputed too (kept, each layer's would stay until the backward: 784 MiB a layer at 4
    heads, T = 4096, with sinks), a smaller one kept (no grad: never recomputed). chosen
    (slots [T, J] int64, n_keys): target [T, J] float32, the heads' probabilities summed at
    columns n_keys + slots (0 in an empty slot, -1; no gradient); None: target None. mask:
    a [T, S] bool tensor or its rule (MaskRows), whose rows each block makes for itself
    (never [T, S] values)."""
    T, block = q_NTD.shape[1], _query_block(q_NTD.shape[0], k_GTD.shape[1])
    fn = functools.partial(_sinks_block, mask_TS=mask_TS, k_GTD=k_GTD, v_GTD=v_GTD, scale=scale, sinks_N=sinks_N, softcap=softcap,
                           n_keys=None if chosen is None else chosen[1], alibi=alibi)
    slots_TJ = None if chosen is None else chosen[0]
    if block >= T and (q_NTD.shape[0] * T * k_GTD.shape[1] <= _KEPT_SCORES or not torch.is_grad_enabled()):
        return fn(q_NTD, slice(None), slots_TJ)
    outs, targets = [], []
    for t0 in range(0, T, block):
        b = slice(t0, t0 + block)
        out, target = checkpoint(fn, q_NTD[:, b], b, None if slots_TJ is None else slots_TJ[b], use_reentrant=False)
        outs.append(out)
        targets.append(target)
    return torch.cat(outs, dim=1), None if chosen is None else torch.cat(targets)


def _shared_kv_by_kernel(q_NTD: torch.Tensor, kv_SD: torch.Tensor, mask_TS, cfg: AttentionConfig, sinks_N, *, keep=None,
                         chosen: Optional[torch.Tensor] = None, target: bool = False):
    """Attention over one kv head that is its own values (kv_shared; DeepSeek-V4's layers) on
    the sparse kernel (fmoe.ops.sparse_attention): each query over the rows it attends to
    alone, kv [S + S', D] the rows (the keys, then any compressed entries), every head
    reading the same: the keys mask [T, S] allows (a bool tensor or its rule, MaskRows;
    compacted to cfg.window slots with a window, in position order), then the entries':
    those of chosen [T, J] (compressed sparse attention's entry slots, -1 empty) or, with
    chosen None, every one keep [T, S'] allows (a bool tensor or a MaskRows; None: no
    entries). sinks [N] (None: none) scale each head's output by sigmoid(lse - sink). (out
    [N, T, D] in q's dtype, target): with target, the heads' probabilities of the chosen
    entries summed [T, J] float32 (the sinks in their softmax; 0 in an empty slot; no
    gradient), as _attention_with_sinks gives them; else None."""
    device, n_keys = q_NTD.device, mask_TS.shape[1]
    with torch.no_grad():  # each query's rows: its keys (the allowed ones first, in position order), then the entries
        W = min(cfg.window, n_keys) if cfg.window is not None else n_keys
        if W < n_keys and isinstance(mask_TS, MaskRows):
            key_slots = _window_slots(mask_TS, W)
        elif W < n_keys:
            order_TW = torch.sort(mask_TS.to(torch.uint8), dim=1, descending=True, stable=True).indices[:, :W]
            key_slots = torch.where(mask_TS.gather(1, order_TW), order_TW, -1)
        else:
            key_slots = torch.where(_mask_rows(mask_TS), torch.arange(n_keys, device=device), -1)
        if chosen is not None:
            entry_slots = torch.where(chosen >= 0, chosen + n_keys, -1)
        elif keep is not None:
            keep_TS = _mask_rows(keep)
            entry_slots = torch.where(keep_TS, torch.arange(n_keys, n_keys + keep_TS.shape[1], device=device), -1)
        else:
            entry_slots = key_slots[:, :0]
        slots_TJ = torch.cat([key_slots, entry_slots], dim=1)
    q_TND = rearrange(q_NTD, "n t d -> t n d")
    kv_SD = kv_SD.to(q_TND.dtype)
    o_TND, lse_TN = sparse_attention(q_TND, kv_SD, slots_TJ, scale=softmax_scale(cfg), check=False, impl=cfg.impl)
    o_TND = _with_sinks(o_TND, lse_TN, sinks_N)
    target_TJ = None
    if target:
        with torch.no_grad():  # each chosen entry's probability summed over the heads, the sinks in the denominator
            lse = lse_TN.detach() if sinks_N is None else torch.logaddexp(lse_TN.detach(), sinks_N.detach().float())
            p_TJ = sparse_attention_probs(q_TND.detach(), kv_SD.detach(), slots_TJ, lse, scale=softmax_scale(cfg), check=False, impl=cfg.impl)
            target_TJ = p_TJ[:, key_slots.shape[1]:]
    return rearrange(o_TND, "t n d -> n t d"), target_TJ


def _window_slots(mask: MaskRows, W: int) -> torch.Tensor:
    """The keys each query of a sliding window's rule (MaskRows) sees, [T, W] int64 columns in
    position order (-1: none): in (document, position) order they are a run from the
    query's document's position max(0, q_pos - W + 1), each checked by the rule. O(T W + S
    log S) time and memory, never [T, S]; like the dense mask's stable sort, the first W
    keys where the rule allows more."""
    span = torch.maximum(mask.kv_pos.max(), mask.q_pos.max()).long() + 1
    key_S = mask.kv_doc.long() * span + mask.kv_pos.long()
    sorted_S, order_S = torch.sort(key_S, stable=True)
    first_T = torch.searchsorted(sorted_S, mask.q_doc.long() * span + (mask.q_pos.long() - W + 1).clamp(min=0))
    run_TW = first_T[:, None] + torch.arange(W, device=first_T.device)
    cols_TW = order_S[run_TW.clamp(max=key_S.shape[0] - 1)]
    return torch.where((run_TW < key_S.shape[0]) & mask.at(slice(None), cols_TW), cols_TW, -1)


def _with_sinks(o_TND: torch.Tensor, lse_TN: torch.Tensor, sinks_N: Optional[torch.Tensor]) -> torch.Tensor:
    """A kernel's output o [T, N, Dv] (its log-sum-exp lse [T, N] float32) under attention
    sinks [N] (None: o itself): a sink adds exp(sink) to each head's denominator, o Z / (Z +
    e^sink) with Z = e^lse, o sigmoid(lse - sink); in o's dtype, differentiable in all three."""
    if sinks_N is None:
        return o_TND
    return (o_TND.float() * torch.sigmoid(lse_TN - sinks_N.float())[..., None]).to(o_TND.dtype)


def _sinks_block(q_NBD, b: slice, slots_BJ, *, mask_TS, k_GTD, v_GTD, scale, sinks_N, softcap, n_keys, alibi):
    """_attention_with_sinks of the block b of B queries: (out [N, B, Dv], target [B, J] or None)."""
    (N, B, _), (G, S, Dv) = q_NBD.shape, v_GTD.shape
    mask_BS = _mask_rows(mask_TS, b)
    bias_NBS = None
    if alibi is not None:  # the block's own biases: [N, B, S], never [N, T, S] (1 GiB at T = 8192, 4 heads)
        slopes_N, q_pos_T, kv_pos_S = alibi
        bias_NBS = slopes_N.float()[:, None, None] * (kv_pos_S[None, :] - q_pos_T[b][:, None]).float()
    scores_NBS = _masked_scores(q_NBD, k_GTD, mask_BS, scale, softcap, bias_NBS)
    if sinks_N is None:
        probs_NBS = torch.softmax(scores_NBS, dim=-1)
    else:
        sink_NB1 = sinks_N.float()[:, None, None].expand(N, B, 1)
        probs_NBS = torch.softmax(torch.cat([scores_NBS, sink_NB1], dim=-1), dim=-1)[..., :-1]
    out_NBD = (probs_NBS.reshape(G, N // G * B, S) @ v_GTD.float()).view(N, B, Dv).to(q_NBD.dtype)
    target_BJ = None
    if slots_BJ is not None:
        with torch.no_grad():
            target_BJ = probs_NBS.detach()[:, :, n_keys:].sum(0).gather(1, slots_BJ.clamp(min=0)) * (slots_BJ >= 0)
    return out_NBD, target_BJ


def _head_layer_norm(x_THD: torch.Tensor, weight_HD: torch.Tensor, eps: float, bias_HD: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A LayerNorm over each head's last dim, weight_HD [heads, D] each head's own (or [D], one
    for every head), plus bias_HD of its shape (None: none); statistics in float32, the
    result in x's dtype."""
    x32 = x_THD.float()
    x32 = x32 - x32.mean(-1, keepdim=True)
    y = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps) * weight_HD.float()
    return (y if bias_HD is None else y + bias_HD.float()).to(x_THD.dtype)


def _gated(out_TQ: torch.Tensor, gate_TG: torch.Tensor, cfg: AttentionConfig, bias_N: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The attention output [T, N Dv] times cfg.gate_act of the gate's pre-activations
    gate_TG ([T, N Dv] channel by channel, [T, N] with cfg.gate_per_head: each head's Dv
    channels by one), in out_TQ's dtype; bias_N [N]: each head's bias, added to its gate's
    pre-activations (Beam's gate_bias)."""
    if bias_N is not None:
        N = bias_N.shape[0]
        gate_TG = gate_TG + (bias_N if cfg.gate_per_head else bias_N.repeat_interleave(gate_TG.shape[-1] // N)).to(gate_TG.dtype)
    if cfg.gate_act == "softplus":  # in float32 (Laguna's)
        gate_TG = F.softplus(gate_TG.float()).to(out_TQ.dtype)
    else:
        gate_TG = torch.sigmoid(gate_TG)
    if cfg.gate_per_head:
        N = gate_TG.shape[-1]
        return (rearrange(out_TQ, "t (n d) -> t n d", n=N) * gate_TG[..., None]).flatten(1)
    return out_TQ * gate_TG


class MoaRouting(NamedTuple):
    """A mixture of attention heads' routing of x's tokens (_moa_route): the router's float32
    logits [T, E], the Routes [T, k] (the softmax over the k chosen logits), x's rows
    permuted to the experts and their PermutePlan."""

    logits_TE: torch.Tensor
    routes: Routes
    x_perm: torch.Tensor
    plan: PermutePlan


def _moa_route(x_TH, params, cfg: AttentionConfig) -> MoaRouting:
    """The attention experts' routing of x (AttentionConfig's mixture of attention heads); no host read."""
    logits_TE = x_TH.float() @ params["moa_router"]
    routes = route(logits_TE, cfg.moa_topk, check=False, impl=cfg.impl)
    return MoaRouting(logits_TE, routes, *permute(x_TH, routes.experts, cfg.moa_experts, check=False, impl=cfg.impl))


def _moa_queries(params, cfg: AttentionConfig, moa: MoaRouting) -> torch.Tensor:
    """[T, N D]: each slot's expert's query heads (x wq[e]), as heads g k + j (slot j's head of kv head g)."""
    q_perm = grouped_matmul(moa.x_perm, params["wq"], moa.plan.offsets, impl=cfg.impl, check=False)  # [T k, G D], rows by expert
    q_TKQ = q_perm[moa.plan.row_of_slot.long()]  # each slot's row (no slot is dropped)
    return rearrange(q_TKQ, "t k (g d) -> t (g k d)", g=cfg.n_kv_heads)


def _moa_out(out_TQ: torch.Tensor, params, cfg: AttentionConfig, moa: MoaRouting) -> torch.Tensor:
    """[T, H]: the heads' outputs of each slot through its expert's wo[e], times the slot's
    weight, summed over the token's slots (fmoe.ops.unpermute, float32 sums)."""
    routes, plan = moa.routes, moa.plan
    G, k = cfg.n_kv_heads, cfg.moa_topk
    out_SQ = rearrange(out_TQ, "t (g k d) -> (t k) (g d)", g=G, k=k)  # slot t k + j's heads
    o_perm = out_SQ[plan.slot_of_row.long().clamp(min=0)]  # rows by expert (every row a slot)
    y_perm = grouped_matmul(o_perm, params["wo"], plan.offsets, impl=cfg.impl, check=False)
    return unpermute(y_perm, plan, routes.weights, impl=cfg.impl)


def _gqa_qkv(x, params, cfg: AttentionConfig, ctx: AttentionContext, heads_mean=None, moa=None, q_lat=None):
    """Grouped-query attention's q [T, N, D], k [T, G, D] and v [T, G, Dv] (times cfg.v_scale),
    RoPE applied (unless cfg.rope is False). moa: a mixture of attention heads' routing
    (_moa_route: MoaRouting), whose experts make the queries. q_lat: with cfg.q_rank, wq_b's
    input when already made (_mla_q_latent)."""
    N, G = cfg.n_heads, cfg.n_kv_heads

    def clip(y):
        return y if cfg.clip_qkv is None else y.clamp(-cfg.clip_qkv, cfg.clip_qkv)  # DBRX's clip_qkv

    def project(name, bias, x=x):
        y = matmul(x, params[name], fp8=cfg.fp8, impl=cfg.impl)
        return clip(y + params[bias] if params.get(bias) is not None else y)

    if moa is not None:
        q_TQ = clip(_moa_queries(params, cfg, moa))
    elif cfg.q_rank is not None:  # the queries from the normed q latent (DeepSeek-V4's)
        q_TQ = project("wq_b", "bq", _mla_q_latent(x, params, cfg) if q_lat is None else q_lat)
    else:
        q_TQ = project("wq", "bq")
    k_TK = project("wk", "bk")
    v_TV = project("wv", "bv") if cfg.has_wv else k_TK  # k_eq_v: the keys' projection as it comes (Gemma 4's global layers)
    if cfg.qk_norm == "proj":  # over the whole projection (OLMoE)
        ms = [t.float().square().mean(-1, keepdim=True) for t in (q_TQ, k_TK)]
        if heads_mean is not None:  # q's and k's [T, 2] averaged over the tp ranks' heads in one collective
            ms = heads_mean(torch.cat(ms, dim=-1)).split(1, dim=-1)
        q_TQ, k_TK = (_rms_norm(t, params[n], cfg.norm_eps, m, zero_centered=cfg.zero_centered_norms)
                      for t, n, m in zip((q_TQ, k_TK), ("q_norm", "k_norm"), ms))
    q_TND, k_TGD = rearrange(q_TQ, "t (n d) -> t n d", n=N), rearrange(k_TK, "t (g d) -> t g d", g=G)
    if cfg.qk_norm in ("head_layer", "layer"):  # a LayerNorm per head, each head its own weights (Cohere's) or one for all, before RoPE
        q_TND, k_TGD = (_head_layer_norm(t, params[name], cfg.norm_eps, params.get(name + "_bias"))
                        for t, name in ((q_TND, "q_norm"), (k_TGD, "k_norm")))
    # over each head's channels: before RoPE (Qwen3, GLM-4.5) or after (Hunyuan, Llama 4's weightless "rms"); "head_k":
    # the queries' without weights (no q_norm), the keys' with (DeepSeek-V4's)
    head_norm = cfg.qk_norm in ("head", "rms", "head_k")

    def norm_heads(q_TND, k_TGD):
        zc = cfg.zero_centered_norms
        return (_rms_norm(q_TND, params.get("q_norm"), cfg.norm_eps, zero_centered=zc),
                _rms_norm(k_TGD, params.get("k_norm"), cfg.norm_eps, zero_centered=zc))

    if head_norm and not cfg.qk_norm_after_rope:
        q_TND, k_TGD = norm_heads(q_TND, k_TGD)
    if cfg.rope:
        q_TND, k_TGD = (_gqa_rope(t, ctx.cos, ctx.sin, cfg) for t in (q_TND, k_TGD))
    if head_norm and cfg.qk_norm_after_rope:
        q_TND, k_TGD = norm_heads(q_TND, k_TGD)
    if cfg.temperature_floor is not None:  # the query temperature (Llama 4's, Mistral 4's), by the query's position
        (q_TND,) = _temperature(ctx, cfg, q_TND)
    v_TGD = k_TGD if cfg.kv_shared else rearrange(v_TV, "t (g d) -> t g d", g=G)  # kv_shared: the keys, normed and rotated
    if cfg.v_norm:  # over each value head's channels, without weights (Gemma 4's)
        v_TGD = _rms_norm(v_TGD, None, cfg.norm_eps)
    if cfg.v_scale != 1.0:  # MiMo-V2-Flash's attention_value_scale
        v_TGD = v_TGD * cfg.v_scale
    return q_TND, k_TGD, v_TGD


def _gqa_rope(x_TND: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: AttentionConfig) -> torch.Tensor:
    """Grouped-query attention's RoPE of x [T, N, D] by cos, sin [T, R/2]: its first R
    channels, or its last with cfg.rope_last (DeepSeek-V4's)."""
    impl = "torch" if cfg.impl == "torch" else "auto"
    if not cfg.rope_last:
        return apply_rope(x_TND, cos, sin, interleaved=cfg.interleaved, impl=impl)
    R = 2 * cos.shape[-1]
    return torch.cat([x_TND[..., :-R], apply_rope(x_TND[..., -R:], cos, sin, interleaved=cfg.interleaved, impl=impl)], dim=-1)


def query_temperature(positions: torch.Tensor, cfg: AttentionConfig) -> torch.Tensor:
    """[T] float32: the queries' scale 1 + temperature_scale * log(1 + floor((p +
    temperature_offset) / temperature_floor)) at positions p [T] (Llama 4's attention
    temperature tuning, offset 1: 1 up to position temperature_floor - 2, then growing with
    the log of the position; Mistral 4's, offset 0: 1 up to temperature_floor - 1); with
    temperature_kind "power", (1 + (p + temperature_offset) / temperature_floor) **
    temperature_scale (Beam's: above 1 from position 0 on, growing smoothly)."""
    if cfg.temperature_kind == "power":
        return torch.exp(torch.log1p((positions.float() + float(cfg.temperature_offset)) / cfg.temperature_floor) * cfg.temperature_scale)
    steps = torch.floor((positions.float() + float(cfg.temperature_offset)) / cfg.temperature_floor)
    return torch.log1p(steps) * cfg.temperature_scale + 1.0


def _temperature(ctx: AttentionContext, cfg: AttentionConfig, *queries: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each of the queries [T, N, *] times its position's query_temperature (computed once),
    in its own dtype."""
    scale_T11 = query_temperature(ctx.positions, cfg)[:, None, None]
    return tuple((q * scale_T11).to(q.dtype) for q in queries)


def _mla_latent_qkv(x, params, cfg: AttentionConfig, ctx: AttentionContext, q_lat=None):
    """Multi-latent attention absorbed (AttentionContext.latents = "absorbed"): q [T, N, C + R] (each
    head's nope query times its key slice of wkv_b, then its rotated query), one shared key
    [T, 1, C + R] (the normed latent, then the rotated key) and value [T, 1, C] (the latent),
    and the value slices wv [C, N, v_dim] that take the output back to each head's values.
    q . k equals _mla_qkv's per-head scores, so attention computes the same function."""
    N, D, R, C = cfg.n_heads, cfg.head_dim, cfg.rot_dim, cfg.kv_rank
    q_nope_TNP, q_rope_TNR, latent_TC, k_rope_T1R = _mla_parts(x, params, cfg, ctx, q_lat)
    wk_CNP, wv_CNV = rearrange(params["wkv_b"], "c (n e) -> c n e", n=N).split([D - R, cfg.v_dim], dim=-1)
    q_TNC = torch.einsum("tnp,cnp->tnc", q_nope_TNP, wk_CNP)
    q_TNQ = torch.cat([q_TNC, q_rope_TNR], dim=-1)
    k_T1Q = torch.cat([latent_TC[:, None, :], k_rope_T1R], dim=-1)
    return q_TNQ, k_T1Q, latent_TC[:, None, :], wv_CNV


def _mla_q_latent(x, params, cfg: AttentionConfig) -> torch.Tensor:
    """wq_b's input (multi-latent attention's, or grouped-query attention's with cfg.q_rank):
    the normed q latent [T, q_rank], or
    with cfg.q_latent_raw [normed | as it is] [T, 2 q_rank]."""
    w = matmul(x, params["wq_a"], fp8=cfg.fp8, impl=cfg.impl)
    normed = _rms_norm(w, params["q_a_norm"], cfg.latent_norm_eps, zero_centered=cfg.zero_centered_norms)
    return torch.cat([normed, w], dim=-1) if cfg.q_latent_raw else normed


def _mla_parts(x, params, cfg: AttentionConfig, ctx: AttentionContext, q_lat=None):
    """Multi-latent attention's q nope [T, N, D - R] and rotated q rope [T, N, R], the normed
    latent [T, kv_rank] and the rotated shared key [T, 1, R] (not rotated when cfg.rope is
    False: a NoPE block). q_lat: wq_b's input when already made (_mla_q_latent)."""
    N, D, R = cfg.n_heads, cfg.head_dim, cfg.rot_dim
    rope_impl = "torch" if cfg.impl == "torch" else "auto"
    mm = functools.partial(matmul, fp8=cfg.fp8, impl=cfg.impl)
    if cfg.q_rank is None:
        q_TQ = mm(x, params["wq"])
    else:
        q_TQ = mm(_mla_q_latent(x, params, cfg) if q_lat is None else q_lat, params["wq_b"])
    if cfg.latent_scales is not None:  # LongCat-Flash's
        q_TQ = q_TQ * cfg.latent_scales[0]
    q_nope_TNP, q_rope_TNR = rearrange(q_TQ, "t (n d) -> t n d", n=N).split([D - R, R], dim=-1)
    latent_TC, k_rope_TR = mm(x, params["wkv_a"]).split([cfg.kv_rank, R], dim=-1)
    k_rope_T1R = k_rope_TR[:, None, :]
    if cfg.rope:  # a NoPE block (Kimi Linear's) keeps the rope slices as they are
        q_rope_TNR = apply_rope(q_rope_TNR, ctx.cos, ctx.sin, interleaved=cfg.interleaved, impl=rope_impl)
        k_rope_T1R = apply_rope(k_rope_T1R, ctx.cos, ctx.sin, interleaved=cfg.interleaved, impl=rope_impl)
    if cfg.temperature_floor is not None:  # Mistral 4's query scale by position, on every channel after RoPE
        q_nope_TNP, q_rope_TNR = _temperature(ctx, cfg, q_nope_TNP, q_rope_TNR)
    latent_TC = _rms_norm(latent_TC, params["kv_a_norm"], cfg.latent_norm_eps, zero_centered=cfg.zero_centered_norms)
    if cfg.latent_scales is not None:
        latent_TC = latent_TC * cfg.latent_scales[1]
    return q_nope_TNP, q_rope_TNR, latent_TC, k_rope_T1R


def _mla_qkv(x, params, cfg: AttentionConfig, ctx: AttentionContext, q_lat=None):
    """Multi-latent attention's q, k [T, N, D] ([nope | rope] per head) and v [T, N, v_dim]:
    the latents RMSNorm'd, the rope slices rotated, the one rotary key shared by all heads."""
    q_nope_TNP, q_rope_TNR, latent_TC, k_rope_T1R = _mla_parts(x, params, cfg, ctx, q_lat)
    return (torch.cat([q_nope_TNP, q_rope_TNR], dim=-1), *_mla_expand(latent_TC, k_rope_T1R, params, cfg))


def _mla_expand(latent_TC, k_rope_T1R, params, cfg: AttentionConfig):
    """Per-head keys [T, N, D] ([nope | rope], the rotary key shared by every head) and values
    [T, N, v_dim] from the normed latents [T, kv_rank] (wkv_b) and rotated keys [T, 1, R]."""
    N, D, R = cfg.n_heads, cfg.head_dim, cfg.rot_dim
    kv_TNE = rearrange(matmul(latent_TC, params["wkv_b"], fp8=cfg.fp8, impl=cfg.impl), "t (n e) -> t n e", n=N)
    k_nope_TNP, v_TNV = kv_TNE.split([D - R, cfg.v_dim], dim=-1)
    return torch.cat([k_nope_TNP, k_rope_T1R.expand(-1, N, -1)], dim=-1), v_TNV.contiguous()


def _index_rope(x_TND: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: AttentionConfig) -> torch.Tensor:
    """The indexer's RoPE on x [T, N, index_head_dim]: its first rot_dim channels rotated by
    cos, sin [T, rot_dim/2], or its last with cfg.index_rope_last (on interleaved pairs with
    cfg.index_interleaved)."""
    if not cfg.index_rope_last:
        return apply_rope(x_TND, cos, sin, interleaved=cfg.index_interleaved, impl="torch")
    R = 2 * cos.shape[-1]
    rotated = apply_rope(x_TND[..., -R:].contiguous(), cos, sin, interleaved=cfg.index_interleaved, impl="torch")
    return torch.cat([x_TND[..., :-R], rotated], dim=-1)


def index_keys(x_TH: torch.Tensor, params, cfg: AttentionConfig, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek sparse attention's indexer keys [T, index_head_dim] float32 of tokens x [T, H]:
    LayerNorm(x index_wk) (weight index_k_norm, bias index_k_bias, eps cfg.index_norm_eps),
    its first rot_dim channels (the last with cfg.index_rope_last) rotated by the tables cos, sin
    [T, rot_dim/2] (on interleaved pairs with cfg.index_interleaved). No autograd needed: the
    top-k choice is not differentiable."""
    Di = cfg.index_head_dim
    k_TD = F.layer_norm(x_TH.float() @ params["index_wk"].float(), (Di,), params["index_k_norm"].float(), params["index_k_bias"].float(),
                        eps=cfg.index_norm_eps)
    return _index_rope(k_TD[:, None, :], cos, sin, cfg)[:, 0]


def index_scores(x_TH: torch.Tensor, q_lat_TC: torch.Tensor, keys_SD: torch.Tensor, params, cfg: AttentionConfig,
                 cos: torch.Tensor, sin: torch.Tensor, *, slots: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The lightning indexer's scores [T, S] float32 of T queries (tokens x [T, H], their
    normed q latents q_lat [T, q_rank]) over S keys (index_keys' [S, index_head_dim]):
    sum_h w[t, h] / sqrt(Ni) * relu(q[t, h] . k[s] / sqrt(Di)), q = q_lat index_wq per head
    (rot_dim channels rotated by cos, sin [T, rot_dim/2], as index_keys'), w = x index_w. slots: [T, J]
    int64 (index_slots'): the scores [T, J] of each query's keys keys[slots[t, j]] alone
    (0 in an empty slot), for the indexer's loss without a [T, S] product."""
    T, Ni, Di = x_TH.shape[0], cfg.index_heads, cfg.index_head_dim
    q_TND = (q_lat_TC.float() @ params["index_wq"].float()).view(T, Ni, Di)
    q_TND = _index_rope(q_TND, cos, sin, cfg)
    w_TN = (x_TH.float() @ params["index_w"].float()) * Ni**-0.5
    if slots is None:  # float32: the kernel with impl="triton" alone (faster than torch's in 16-bit inputs only)
        return indexer_scores(q_TND, w_TN, keys_SD.float(), scale=Di**-0.5, impl=cfg.impl)
    keys_TJD = keys_SD.float()[slots.clamp(min=0)]
    relu_TNJ = torch.relu(torch.einsum("tnd,tjd->tnj", q_TND, keys_TJD) * Di**-0.5)
    return torch.einsum("tn,tnj->tj", w_TN, relu_TNJ) * (slots >= 0)


def index_slots(scores_TS: torch.Tensor, mask_TS: torch.Tensor, topk: int, *, key_order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The keys each query attends to under DeepSeek sparse attention, as slots [T, J]
    int64, J = min(topk, S): of the keys mask [T, S] allows, the topk of highest score
    (scores [T, S], index_scores'), best first, then -1 in the slots left empty where the
    mask allows fewer. Equal scores go to the earlier key (the lower column; with
    key_order, the earlier token): a stable sort, so that a token's choice is the same
    whatever else shares its row (a packed batch, a cache's rows, a context-parallel split).
    Equal scores are common: a key whose dot products with every indexer head are <= 0
    scores exactly 0. key_order: [S] int64, the columns in token order (under context
    parallel the gathered keys are in rank order: argsort(kv_index),
    AttentionContext.key_order); None: the columns are in token order."""
    masked_TS = scores_TS.masked_fill(~mask_TS, float("-inf"))
    if key_order is not None:
        masked_TS = masked_TS.index_select(1, key_order)
    best = torch.sort(masked_TS, dim=-1, descending=True, stable=True)
    top_TJ = best.indices[:, :topk]
    if key_order is not None:  # back to the columns
        top_TJ = key_order[top_TJ]
    return torch.where(best.values[:, :topk] > float("-inf"), top_TJ, -1)


def _index_choice(x_TH, q_lat_TC, keys_SD, params, cfg: AttentionConfig, ctx: AttentionContext, mask_TS, rows: int = 1 << 28, *,
                  topk: Optional[int] = None) -> torch.Tensor:
    """index_slots of index_scores (no gradient) for blocks of queries whose indexer products
    [block, index_heads, S] hold about `rows` floats: never the [T, index_heads, S] product
    of every query at once (4 GiB in float32 at T = S = 4096 and 64 heads). topk: None,
    cfg.index_topk."""
    T, S = mask_TS.shape
    block = max(1, rows // max(1, cfg.index_heads * S))
    slots = []
    for t0 in range(0, T, block):
        b = slice(t0, t0 + block)
        scores_BS = index_scores(x_TH[b], q_lat_TC[b], keys_SD, params, cfg, ctx.cos[b], ctx.sin[b])
        rows_BS = _mask_rows(mask_TS, b)
        slots.append(index_slots(scores_BS, rows_BS, cfg.index_topk if topk is None else topk, key_order=ctx.key_order))
    return torch.cat(slots)


def slots_mask(slots_TJ: torch.Tensor, n_keys: int) -> torch.Tensor:
    """[T, n_keys] bool: True at each query's keys in slots [T, J] (index_slots'; -1: none)."""
    T = slots_TJ.shape[0]
    hit = torch.where(slots_TJ >= 0, slots_TJ, n_keys)
    return torch.zeros(T, n_keys + 1, dtype=torch.bool, device=slots_TJ.device).scatter_(1, hit, True)[:, :n_keys]


def block_index_qk(x_TH: torch.Tensor, params, cfg: AttentionConfig, cos: torch.Tensor, sin: torch.Tensor, *,
                   keys: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Block-sparse attention's indexer (cfg.index_topk_blocks; AttentionConfig) of tokens
    x [T, H]: queries [T, index_heads, index_head_dim] and keys [T, index_head_dim] in x's
    dtype, x index_wq per head and x index_wk, each RMS-normed over its channels (weights
    index_q_norm, index_k_norm; eps cfg.norm_eps, 1 + weight with cfg.zero_centered_norms),
    then its first rot_dim channels rotated by cos, sin [T, rot_dim/2] as the heads are.
    keys=False: the queries alone (keys None)."""
    T, Ni, Di = x_TH.shape[0], cfg.index_heads, cfg.index_head_dim

    def heads(w: str, norm: str, n: int) -> torch.Tensor:
        y = _rms_norm((x_TH @ params[w]).view(T, n, Di), params[norm], cfg.norm_eps, zero_centered=cfg.zero_centered_norms)
        return apply_rope(y, cos, sin, interleaved=cfg.interleaved, impl="torch")

    return heads("index_wq", "index_q_norm", Ni), heads("index_wk", "index_k_norm", 1)[:, 0] if keys else None


def document_offsets(ctx: AttentionContext, index: Optional[torch.Tensor], n: int) -> torch.Tensor:
    """[n] int64: where tokens lie in their documents (ctx.cu_seqlens), the tokens given by
    their global indices `index` [n] (ctx.token_index, ctx.kv_index: context parallel,
    decoding) or, index None, the context's own 0 ... n - 1. Block-sparse attention's blocks
    are counted so: in a trunk's context these are its positions, and the MTP depths' (rolled
    positions) and a context-parallel or cached split of keys agree with one process's."""
    if ctx.cu_seqlens is None:
        raise ValueError("ctx: block-sparse attention needs the documents (cu_seqlens) of its tokens: build the context with attention_context")
    cu = ctx.cu_seqlens.long()
    index = torch.arange(n, device=cu.device) if index is None else index.long()
    doc = (torch.searchsorted(cu, index, right=True) - 1).clamp(0, cu.shape[0] - 1)
    return index - cu[doc]


def _key_blocks(kv_pos: torch.Tensor, cfg: AttentionConfig) -> tuple[torch.Tensor, int]:
    """(each key's block [S], kv_pos // index_block_size; the blocks' count, ceil(S /
    index_block_size): a key's place in its document is at most its column)."""
    n_blocks = -(-kv_pos.shape[0] // cfg.index_block_size)
    return (kv_pos.long() // cfg.index_block_size).clamp(max=n_blocks - 1), n_blocks


def _block_scores(q_BND: torch.Tensor, k_SD: torch.Tensor, seen_BS: torch.Tensor, blk_S: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """[B, Ni, n_blocks] float32: each block's largest q . k of the keys seen [B, S] lets
    each query see (-inf: none), keys in blocks blk_S [S]; differentiable (the largest's
    product takes the gradient)."""
    B, Ni = q_BND.shape[:2]
    s_BNS = torch.einsum("bnd,sd->bns", q_BND.float(), k_SD.float()).masked_fill(~seen_BS[:, None, :], float("-inf"))
    return s_BNS.new_full((B, Ni, n_blocks), float("-inf")).scatter_reduce(-1, blk_S.expand(B, Ni, -1), s_BNS, "amax")


def _mask_rows(mask_TS, b: slice = slice(None)) -> torch.Tensor:
    """Rows b of a dense mask [T, S] or of MaskRows' rule, as [len(b), S] bool (every row: the dense mask)."""
    return mask_TS.rows(b) if isinstance(mask_TS, MaskRows) else mask_TS[b]


def block_index_choice(q_TND: torch.Tensor, k_SD: torch.Tensor, mask_TS, q_pos: torch.Tensor, kv_pos: torch.Tensor, cfg: AttentionConfig,
                       rows: int = 1 << 26) -> torch.Tensor:
    """Block-sparse attention's choice of blocks: [index_heads, T, J] int64, each query's and
    indexer head's blocks, best first, -1 in a slot left empty; J = min(index_topk_blocks,
    ceil(S / index_block_size)). Indexer queries q [T, Ni, Di] (block_index_qk's) score keys
    k [S, Di] by q . k (float32); key s lies in block kv_pos[s] // index_block_size (kv_pos
    [S]: its place in its document, document_offsets), query t's own block is q_pos[t] //
    index_block_size (q_pos [T] alike). A block's score for query t and head g is the largest
    score of its keys that mask [T, S] (a bool tensor or MaskRows) lets t see (-inf: none);
    the index_local_blocks blocks ending at t's own score +inf; the index_topk_blocks best
    are chosen (equal scores: the earlier block first; blocks of no visible key never).
    Queries are taken in groups whose [group, Ni, S] scores hold about `rows` floats. No host
    sync."""
    T, S = mask_TS.shape
    Ni, bs, L = q_TND.shape[1], cfg.index_block_size, cfg.index_local_blocks
    blk_S, n_blocks = _key_blocks(kv_pos, cfg)
    J = min(cfg.index_topk_blocks, n_blocks)
    chosen_NTJ = torch.empty(Ni, T, J, dtype=torch.int64, device=q_TND.device)
    step = max(1, rows // max(1, Ni * S))
    for t0 in range(0, T, step):
        b = slice(t0, t0 + step)
        best_BNK = _block_scores(q_TND[b], k_SD, _mask_rows(mask_TS, b), blk_S, n_blocks)
        B = best_BNK.shape[0]
        if L:  # the blocks ending at the query's own: always chosen
            own_B = (q_pos[b].long() // bs).clamp(max=n_blocks - 1)
            local_BL = (own_B[:, None] - torch.arange(L, device=own_B.device)).clamp(min=0)
            best_BNK = best_BNK.scatter(-1, local_BL[:, None, :].expand(B, Ni, L), float("inf"))
        top = torch.sort(best_BNK, dim=-1, descending=True, stable=True)
        chosen_NTJ[:, b] = torch.where(top.values[..., :J] > float("-inf"), top.indices[..., :J], -1).transpose(0, 1)
    return chosen_NTJ


def block_index_keep(chosen_NTJ: torch.Tensor, kv_pos: torch.Tensor, mask_TS: torch.Tensor, cfg: AttentionConfig) -> torch.Tensor:
    """[index_heads, T, S] bool: the keys each query's heads of kv head g attend to, those of
    the mask [T, S] in its chosen blocks (block_index_choice's chosen [Ni, T, J], -1: none;
    kv_pos [S], document_offsets'): the dense reference's mask."""
    Ni, T, J = chosen_NTJ.shape
    S = mask_TS.shape[1]
    blk_S, n_blocks = _key_blocks(kv_pos, cfg)
    picked_NTK = torch.zeros(Ni, T, n_blocks + 1, dtype=torch.bool, device=chosen_NTJ.device).scatter_(-1, chosen_NTJ % (n_blocks + 1), True)
    return picked_NTK.gather(-1, blk_S.expand(Ni, T, S)) & mask_TS


def block_index_slots(chosen_NTJ: torch.Tensor, q_pos: torch.Tensor, doc_start: torch.Tensor, key_order: Optional[torch.Tensor],
                      cfg: AttentionConfig) -> torch.Tensor:
    """[index_heads, T, J index_block_size] int64: the keys of each query's chosen blocks as
    the mask's columns, -1 past the query (or in an empty slot): the sparse kernel's index.
    The key at place p of query t's document is global token doc_start[t] + p (doc_start [T]:
    the query's document's first token, q_pos [T] its place there), column key_order[that]
    under context parallel and in decoding (AttentionContext.key_order), that itself
    otherwise."""
    bs = cfg.index_block_size
    offsets_NTJB = chosen_NTJ[..., None] * bs + torch.arange(bs, device=chosen_NTJ.device)
    live = (chosen_NTJ[..., None] >= 0) & (offsets_NTJB <= q_pos.long()[None, :, None, None])
    token_NTJB = (doc_start.long()[None, :, None, None] + offsets_NTJB).clamp(min=0)
    if key_order is not None:
        token_NTJB = key_order[token_NTJB.clamp(max=key_order.shape[0] - 1)]
    return torch.where(live, token_NTJB, -1).flatten(2)


def _kernel_operands(q_NTD, k_GSD, v_GSD, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv head g's operands of fmoe.ops.sparse_attention: its r query heads [T, r, Dv + D]
    (zeros first, where the rows hold the values) and the rows [v | k] [S, Dv + D]."""
    G, Dv = k_GSD.shape[0], v_GSD.shape[-1]
    r = q_NTD.shape[0] // G
    q_TRD = rearrange(q_NTD[g * r:(g + 1) * r], "r t d -> t r d")
    return torch.cat([q_TRD.new_zeros(*q_TRD.shape[:2], Dv), q_TRD], dim=-1), torch.cat([v_GSD[g], k_GSD[g]], dim=-1)


def _blocks_by_kernel(q_NTD, k_GSD, v_GSD, slots_GTJ, cfg: AttentionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention by fmoe.ops.sparse_attention, kv head by kv head: its query heads
    over the rows [v | k] of the keys its slots [T, J] name (_kernel_operands). -> (out
    [N, T, Dv], lse [T, N])."""
    outs, lses = [], []
    for g in range(k_GSD.shape[0]):
        o_TRV, lse_TR = sparse_attention(*_kernel_operands(q_NTD, k_GSD, v_GSD, g), slots_GTJ[g], v_dim=v_GSD.shape[-1], scale=softmax_scale(cfg),
                                         check=False, impl=cfg.impl)
        outs.append(rearrange(o_TRV, "t r v -> r t v"))
        lses.append(lse_TR)
    return torch.cat(outs), torch.cat(lses, dim=1)


def _blocks_target_by_kernel(q_NTD, k_GSD, v_GSD, slots_GTJ, lse_TN, cfg: AttentionConfig) -> torch.Tensor:
    """block_index_target on the kernel's path: each slot's probability summed over kv head g's
    heads (fmoe.ops.sparse_attention_probs, from the forward's lse), then over each chosen
    block's slots -> [G, T, J blocks]."""
    G = k_GSD.shape[0]
    r = q_NTD.shape[0] // G
    out = []
    for g in range(G):
        p_TJ = sparse_attention_probs(*_kernel_operands(q_NTD, k_GSD, v_GSD, g), slots_GTJ[g], lse_TN[:, g * r:(g + 1) * r].contiguous(),
                                      v_dim=v_GSD.shape[-1], scale=softmax_scale(cfg), check=False, impl=cfg.impl)
        out.append(p_TJ.view(p_TJ.shape[0], -1, cfg.index_block_size).sum(-1))
    return torch.stack(out)


def block_index_target(p_NTS: torch.Tensor, chosen_GTJ: torch.Tensor, kv_pos: torch.Tensor, cfg: AttentionConfig) -> torch.Tensor:
    """[G, T, J]: block-sparse attention's distribution over each query's chosen blocks
    (block_index_choice's chosen [G, T, J], -1: none) per kv head: its heads' attention
    probabilities p [N, T, S] (N = G r; the heads of kv head g the r from g r) summed over
    each block's keys (kv_pos [S], document_offsets') and over the r heads, 0 in an empty
    slot (the indexer loss's target; no gradient)."""
    G, T, J = chosen_GTJ.shape
    S = p_NTS.shape[-1]
    blk_S, n_blocks = _key_blocks(kv_pos, cfg)
    p_GTS = p_NTS.float().view(G, -1, T, S).sum(1)
    mass_GTK = p_GTS.new_zeros(G, T, n_blocks).scatter_add_(-1, blk_S.expand(G, T, S), p_GTS)
    return mass_GTK.gather(-1, chosen_GTJ.clamp(min=0)) * (chosen_GTJ >= 0)


def _block_loss_block(x_BH, k_SD, seen_BS, chosen_BNJ, target_BNJ, cos_BR, sin_BR, blk_S, n_blocks: int, params, cfg: AttentionConfig) -> torch.Tensor:
    """A group of queries' block-sparse indexer loss, summed over them and their heads: each
    query's and head's KL divergence over its chosen blocks, of the indexer's softmax over
    their scores (the largest q . k of each, / sqrt(index_head_dim)) from the attention's."""
    q_BND, _ = block_index_qk(x_BH, params, cfg, cos_BR, sin_BR, keys=False)
    best_BNK = _block_scores(q_BND, k_SD, seen_BS, blk_S, n_blocks) * cfg.index_head_dim ** -0.5
    scores_BNJ = best_BNK.gather(-1, chosen_BNJ.clamp(min=0))
    return index_loss(scores_BNJ.flatten(0, 1), target_BNJ.flatten(0, 1), (chosen_BNJ >= 0).flatten(0, 1), n_queries=1)


def block_index_loss(x_TH: torch.Tensor, k_SD: torch.Tensor, mask_TS: torch.Tensor, chosen_GTJ: torch.Tensor, target_GTJ: torch.Tensor,
                     kv_pos: torch.Tensor, params, cfg: AttentionConfig, ctx: AttentionContext, *, n_queries: int,
                     rows: int = 1 << 26) -> torch.Tensor:
    """Block-sparse attention's indexer loss, a float32 scalar: the sum over the T queries of
    x [T, H] (the detached tokens) and over their indexer heads of KL(p || softmax(I)) over
    the blocks each chose (chosen [G, T, J]), p its attention's share of each block
    (block_index_target's target [G, T, J]) and I the indexer's block scores recomputed
    from x and the keys k [S, Di] (block_index_qk's, differentiable) over sqrt(index_head_dim),
    divided by n_queries (T; under context parallel the micro-batch's, each rank's queries
    giving its share). Its gradient reaches the indexer's weights alone. Queries in groups
    whose [group, G, S] scores hold about `rows` floats, each recomputed in the backward."""
    T, S = mask_TS.shape
    blk_S, n_blocks = _key_blocks(kv_pos, cfg)
    step = max(1, rows // max(1, cfg.index_heads * S))
    fn = functools.partial(_block_loss_block, blk_S=blk_S, n_blocks=n_blocks, params=params, cfg=cfg)
    total = 0.0
    for t0 in range(0, T, step):
        b = slice(t0, t0 + step)
        total = total + checkpoint(fn, x_TH[b], k_SD, _mask_rows(mask_TS, b), chosen_GTJ[:, b].transpose(0, 1), target_GTJ[:, b].transpose(0, 1),
                                   ctx.cos[b], ctx.sin[b], use_reentrant=False)
    return total / n_queries


def _spread_keys(index_k_TD: torch.Tensor, G: int) -> torch.Tensor:
    """The indexer's keys [T, Di] as [T, G, ceil(Di / G)] channels (zeros after Di), to ride
    beside the G kv heads' keys through gather_kv (context parallel, the cache)."""
    T, Di = index_k_TD.shape
    per = -(-Di // G)
    return F.pad(index_k_TD, (0, G * per - Di)).view(T, G, per)


# ----------------------------------------------------------------------------------------
# linear attention: Gated DeltaNet
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet (arXiv 2412.06464), the linear-attention layers of Qwen3-Next and Qwen3.5,
    or (kind="kda") Kimi Delta Attention, Kimi Linear's.

    n_k_heads query/key heads of k_head_dim channels, n_v_heads value heads of v_head_dim
    (n_v_heads % n_k_heads == 0: value head h reads key head h // (n_v_heads / n_k_heads));
    conv: the taps of the causal depthwise convolution on q, k and v (its state in
    decoding: the conv - 1 tokens before); norm_eps: the gated output norm's; chunk_size:
    fmoe.ops.gated_delta_rule's chunk (the same result up to rounding); impl: its impl (the
    states' Triton kernels on CUDA with "auto"). kind "kda": a decay per key channel from a
    rank-Dk projection, the output gate from a rank-Dv projection through a sigmoid, as many
    key as value heads (linear_attention). kind "short_conv": LFM2's gated short convolution
    instead, over n_v_heads x v_head_dim channels (as many key heads and key dims: the
    channels are its heads, one or more each, which tensor parallelism splits), conv taps,
    no state but the convolution's. kind "lightning": MiniMax's lightning attention, no
    convolution (conv is not used), q, k, v through silu, a constant decay per head
    (lightning_decay), the output RMS-normed over all heads' channels and gated by a sigmoid;
    as many key as value heads of one dim. kind "mamba2": Mamba-2's mixer (SSD), its C and B
    as n_k_heads groups of k_head_dim (the state size) read by the n_v_heads heads of
    v_head_dim, the convolution over them and x with biases, dt = softplus(x wa + dt_bias)
    (at least dt_min: Nemotron-H's floor, 0 none), the rule without its delta, a skip D, and its output gated by silu(x wz), then RMS-normed
    per group of key heads (gate_norm "after", the default); gate_norm "before": RMS-normed first, then gated (Falcon-H1's
    mamba_norm_before_gate), "none": gated alone, without the norm or its weight out_norm (Falcon-H1's mamba_rms_norm
    false). kind "mamba1": Mamba-1's mixer (the selective scan of Mamba, Falcon Mamba and
    Jamba): n_v_heads channels of x (v_head_dim 1) after the convolution (with biases), each
    with a state of k_head_dim read and written through one group of C and B (n_k_heads 1)
    projected from the convolved x, dt from it through rank dt_rank, a decay per channel and
    state channel, a skip D, the output gated by silu(x wz) without a norm; dt_bc_norm "rms":
    dt, B and C RMS-normed with weights (Jamba's), "rms_unit" without (Falcon Mamba's), eps
    norm_eps. Kimi Delta Attention's variants (Ling's, kind "kda"
    only): full_rank, the decay's and the gate's projections whole (wf [H, N Dk], wz
    [H, N Dv]) instead of low-rank pairs; decay_bound b < 0 (None: Kimi's softplus decay),
    the bounded decay g = b sigmoid(exp(A_log) (x wf + dt_bias)), each step's log-decay in
    (b, 0). neg_eigval (kinds "gated_deltanet" and "kda"): the write strength beta =
    2 sigmoid(x wb) in [0, 2] instead of sigmoid(x wb) (OLMo Hybrid's allow_neg_eigval: the
    state's transition I - beta k k^T may reach the eigenvalue -1). fp8: the projections (q,
    k, v, the gates', the decay's, the output's) by fmoe.ops.fp8_matmul."""

    n_k_heads: int
    n_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv: int = 4
    norm_eps: float = 1e-6
    chunk_size: int = 64
    impl: str = "auto"
    kind: str = "gated_deltanet"
    full_rank: bool = False
    decay_bound: Optional[float] = None
    dt_min: float = 0.0
    neg_eigval: bool = False
    gate_norm: str = "after"
    dt_rank: Optional[int] = None
    dt_bc_norm: str = "none"
    fp8: bool = False

    def __post_init__(self):
        check_fp8(self.fp8)
        self._check_mamba1()
        if self.gate_norm not in GATE_NORMS:
            raise ValueError(f"gate_norm: expected one of {GATE_NORMS} (Mamba-2's output norm after its gate, before it, or none), got {self.gate_norm!r}")
        if self.gate_norm != "after" and self.kind != "mamba2":
            raise ValueError(f"gate_norm: where Mamba-2's output norm sits, needs kind 'mamba2', got {self.kind!r}")
        if not isinstance(self.neg_eigval, bool):
            raise ValueError(f"neg_eigval: expected a bool, got {self.neg_eigval!r}")
        if self.neg_eigval and self.kind not in ("gated_deltanet", "kda"):
            raise ValueError(f"neg_eigval: the delta rule's write strength in [0, 2], needs kind 'gated_deltanet' or 'kda', got {self.kind!r}")
        m = self.dt_min
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m < math.inf:
            raise ValueError(f"dt_min: expected a finite number >= 0 (Mamba-2's floor of dt; 0: none), got {m!r}")
        if m and self.kind != "mamba2":
            raise ValueError(f"dt_min: the floor of Mamba-2's dt, needs kind 'mamba2', got {self.kind!r}")
        if self.impl not in IMPLS:
            raise ValueError(f"impl: expected one of {IMPLS}, got {self.impl!r}")
        if self.kind not in LINEAR_KINDS:
            raise ValueError(f"kind: expected one of {LINEAR_KINDS}, got {self.kind!r}")
        if not isinstance(self.full_rank, bool):
            raise ValueError(f"full_rank: expected a bool, got {self.full_rank!r}")
        bound = self.decay_bound
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float)) or not -math.inf < bound < 0):
            raise ValueError(f"decay_bound: expected None or a finite number < 0 (the bounded decay's least log-decay), got {bound!r}")
        if (self.full_rank or bound is not None) and self.kind != "kda":
            raise ValueError(f"{'full_rank' if self.full_rank else 'decay_bound'}: a variant of Kimi Delta Attention, needs kind 'kda', got {self.kind!r}")
        if self.kind == "kda" and self.n_k_heads != self.n_v_heads:
            raise ValueError(f"n_v_heads: Kimi Delta Attention has as many key as value heads, got {self.n_k_heads} and {self.n_v_heads}")
        if self.kind == "lightning" and (self.n_k_heads, self.k_head_dim) != (self.n_v_heads, self.v_head_dim):
            raise ValueError(f"n_k_heads / k_head_dim: lightning attention has as many key as value heads, of one dim, got "
                             f"{self.n_k_heads} x {self.k_head_dim} beside {self.n_v_heads} x {self.v_head_dim}")
        if self.kind == "short_conv" and (self.n_k_heads, self.k_head_dim) != (self.n_v_heads, self.v_head_dim):
            raise ValueError(f"n_k_heads / k_head_dim: a short convolution's channels are n_v_heads x v_head_dim, the key fields the same, got "
                             f"{self.n_k_heads} x {self.k_head_dim} beside {self.n_v_heads} x {self.v_head_dim}")
        for name in ("n_k_heads", "n_v_heads", "k_head_dim", "v_head_dim", "conv", "chunk_size"):
            check_positive_int(name, getattr(self, name))
        if self.n_v_heads % self.n_k_heads:
            raise ValueError(f"n_v_heads: {self.n_v_heads} value heads do not split over {self.n_k_heads} key heads")
        if isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float)) or not 0 < self.norm_eps < math.inf:
            raise ValueError(f"norm_eps: expected a positive number, got {self.norm_eps!r}")

    def _check_mamba1(self) -> None:
        """Mamba-1's knobs (dt_rank, dt_bc_norm) and shape (one group of B and C, channels of one dim)."""
        if self.dt_bc_norm not in DT_BC_NORMS:
            raise ValueError(f"dt_bc_norm: expected one of {DT_BC_NORMS} (Mamba-1's RMS norms on dt, B and C: none, with weights, "
                             f"without), got {self.dt_bc_norm!r}")
        if self.kind != "mamba1":
            for name, unset in (("dt_rank", None), ("dt_bc_norm", "none")):
                if getattr(self, name) != unset:
                    raise ValueError(f"{name}: a knob of Mamba-1's mixer, needs kind 'mamba1', got {self.kind!r}")
            return
        r = self.dt_rank
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"dt_rank: expected an int >= 1 (the rank of Mamba-1's dt projection), got {r!r}")
        if (self.n_k_heads, self.v_head_dim) != (1, 1):
            raise ValueError(f"n_k_heads / v_head_dim: Mamba-1's B and C are one group of k_head_dim (its state) read by n_v_heads "
                             f"channels of one dim each, got {self.n_k_heads} groups and channels of {self.v_head_dim}")

    @property
    def k_channels(self) -> int:
        return self.n_k_heads * self.k_head_dim

    @property
    def v_channels(self) -> int:
        return self.n_v_heads * self.v_head_dim

    @property
    def conv_channels(self) -> int:
        """The channels the convolution runs over (its decoding state's): q, k and v's, or a short convolution's
        (lightning attention has none: 0)."""
        if self.kind == "lightning":
            return 0
        return self.v_channels if self.kind in ("short_conv", "mamba1") else 2 * self.k_channels + self.v_channels


LINEAR_KINDS = ("gated_deltanet", "kda", "short_conv", "lightning", "mamba2", "mamba1")
GATE_NORMS = ("after", "before", "none")  # LinearAttentionConfig.gate_norm: Mamba-2's output norm after its gate, before it, none
# LinearAttentionConfig.dt_bc_norm: Mamba-1's RMS norms on dt, B and C: none (Mamba's), with weights (Jamba's), without (Falcon Mamba's)
DT_BC_NORMS = ("none", "rms", "rms_unit")


def lightning_decay(n_heads: int, layer: int, n_layers: int, device=None) -> torch.Tensor:
    """MiniMax's lightning attention's log-decay per token of each head [n_heads] float32
    (<= 0), layer `layer` of n_layers: -b^(h + 1) (1 - layer / (n_layers - 1 + 1e-5) + 1e-5),
    b = 2^(-8 / n_heads), h = 0 .. n_heads - 1 (ALiBi's slopes, slower in deeper layers).
    Computed on `device` (no copy from the host)."""
    for name, value in (("n_heads", n_heads), ("n_layers", n_layers)):
        check_positive_int(name, value)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layers:
        raise ValueError(f"layer: expected an int in [0, {n_layers}), got {layer!r}")
    rate = (1 / 2 ** (8 / n_heads)) ** (torch.arange(n_heads, device=device) + 1)
    return -rate * (1 - layer / (n_layers - 1 + 1e-5) + 1e-5)


def linear_attention_shapes(H: int, cfg: LinearAttentionConfig) -> dict[str, tuple[int, ...]]:
    """Gated DeltaNet's parameters, name -> shape (linear_attention's params); Kimi Delta
    Attention's (kind "kda") have the decay's and the gate's low-rank pairs wf_a [H, Dk],
    wf_b [Dk, N Dk] and wz_a [H, Dv], wz_b [Dv, N Dv] instead of wa and wz, and dt_bias [N Dk];
    with full_rank, wf [H, N Dk] and wz [H, N Dv] instead of the pairs. A short convolution's
    (kind "short_conv"): wb, wc, wv [H, C], conv_v [K, C], wo [C, H]. Lightning attention's
    (kind "lightning"): wq, wk, wv, wz [H, N D], out_norm [N D], wo [N D, H] (its decay, a
    constant, is params["decay"] [N], not a weight: lightning_decay). Mamba-2's (kind "mamba2"):
    wq (its C), wk (its B) [H, Nk Dk], wv (its x), wz [H, Nv Dv], wa (its dt) [H, Nv], the
    convolutions' taps and biases conv_q_bias, conv_k_bias [Nk Dk], conv_v_bias [Nv Dv], A_log,
    dt_bias, D [Nv], out_norm [Nv Dv] (its gated norm's, per group of key heads; none with gate_norm "none"), wo. Mamba-1's
    (kind "mamba1", C = n_v_heads channels, N = k_head_dim, R = dt_rank): wv (its x), wz [H, C], conv_v [K, C],
    conv_v_bias [C], wdt [C, R], wk (its B), wq (its C) [C, N] (x_proj's rows dt, B, C, transposed), wa [R, C] (dt_proj),
    dt_bias, D [C], A_log [C, N], with dt_bc_norm "rms" the norms' weights dt_norm [R], b_norm, c_norm [N], wo [C, H]."""
    Ck, Cv, Nv, K = cfg.k_channels, cfg.v_channels, cfg.n_v_heads, cfg.conv
    if cfg.kind == "mamba1":
        R, N = cfg.dt_rank, cfg.k_head_dim
        norms = dict(dt_norm=(R,), b_norm=(N,), c_norm=(N,)) if cfg.dt_bc_norm == "rms" else {}
        return dict(wv=(H, Cv), wz=(H, Cv), conv_v=(K, Cv), conv_v_bias=(Cv,), wdt=(Cv, R), wk=(Cv, N), wq=(Cv, N), wa=(R, Cv), dt_bias=(Cv,),
                    A_log=(Cv, N), D=(Cv,), **norms, wo=(Cv, H))
    if cfg.kind == "short_conv":
        return dict(wb=(H, Cv), wc=(H, Cv), wv=(H, Cv), conv_v=(K, Cv), wo=(Cv, H))
    if cfg.kind == "lightning":
        return dict(wq=(H, Cv), wk=(H, Cv), wv=(H, Cv), wz=(H, Cv), out_norm=(Cv,), wo=(Cv, H))
    convs = dict(conv_q=(K, Ck), conv_k=(K, Ck), conv_v=(K, Cv))
    if cfg.kind == "mamba2":
        norm = {} if cfg.gate_norm == "none" else dict(out_norm=(Cv,))
        return dict(wq=(H, Ck), wk=(H, Ck), wv=(H, Cv), wz=(H, Cv), wa=(H, Nv), **convs, conv_q_bias=(Ck,), conv_k_bias=(Ck,),
                    conv_v_bias=(Cv,), A_log=(Nv,), dt_bias=(Nv,), D=(Nv,), **norm, wo=(Cv, H))
    if cfg.kind == "kda":
        Dk, Dv = cfg.k_head_dim, cfg.v_head_dim
        gates = dict(wz=(H, Cv), wb=(H, Nv), wf=(H, Ck)) if cfg.full_rank else dict(wz_a=(H, Dv), wz_b=(Dv, Cv), wb=(H, Nv), wf_a=(H, Dk), wf_b=(Dk, Ck))
        return dict(wq=(H, Ck), wk=(H, Ck), wv=(H, Cv), **gates, **convs, A_log=(Nv,), dt_bias=(Ck,), out_norm=(Dv,), wo=(Cv, H))
    return dict(wq=(H, Ck), wk=(H, Ck), wv=(H, Cv), wz=(H, Cv), wb=(H, Nv), wa=(H, Nv), **convs,
                A_log=(Nv,), dt_bias=(Nv,), out_norm=(cfg.v_head_dim,), wo=(Cv, H))


@dataclasses.dataclass
class LinearStates:
    """The decoding state of one linear-attention layer for the S sequences of a call:
    conv [S, conv - 1, Ck + Ck + Cv] (the last conv - 1 tokens' q, k, v projections, before
    the convolution; zeros before a sequence's first token) and state [S, Nv, Dk, Dv]
    float32 (the gated delta rule's). linear_attention reads them, then puts the states
    after the call's tokens in their place (fmoe.model.KVCache writes them back). tokens:
    the S T new tokens of x's rows (None: all of them); rows after them are padding (decoding
    under tensor parallelism pads a call's tokens to a multiple of tp), whose outputs are 0."""

    conv: torch.Tensor
    state: torch.Tensor
    tokens: Optional[int] = None


def _conv_out(y, bias, silu: bool, dtype):
    """A convolution's float32 sum y, plus its bias [C] (None: none), through silu (with silu)."""
    y = y if bias is None else y + bias.float()
    return (F.silu(y) if silu else y).to(dtype)


def _causal_conv(x_TC, w_KC, cu_seqlens, silu: bool = True, bias=None):
    """silu (with silu; else none) of the causal depthwise convolution of each document's
    tokens x [T, C] with taps w [K, C] (w[K-1] on the token itself, w[K-1-j] on the token j
    before it, 0 before the document's start) plus bias [C] (None: none; Mamba-2's), in
    float32; [T, C] in x's dtype."""
    K = w_KC.shape[0]
    y = x_TC.float() * w_KC[K - 1].float()
    for j in range(1, K):
        y = y + roll_packed(x_TC, cu_seqlens, shift=j, check=False).float() * w_KC[K - 1 - j].float()
    return _conv_out(y, bias, silu, x_TC.dtype)


def _causal_conv_split(x_TC, w_KC, cu_seqlens, cp, silu: bool = True, bias=None):
    """_causal_conv of this rank's tokens of a context-parallel split, its two chunks of
    L = T/cp / 2 (cp: the context's linear_cp): the K - 1 tokens before each chunk come
    from the rank that holds them (cp.conv_halo, one all-gather), and a tap reaches a token
    only inside its document (global indices against cu_seqlens)."""
    K, T = w_KC.shape[0], x_TC.shape[0]
    halo = cp.conv_halo(x_TC, K - 1)  # [2, K - 1, C]
    L = T // 2
    full = torch.cat([halo.to(x_TC.dtype), x_TC.reshape(2, L, -1)], dim=1)  # [2, K - 1 + L, C]
    index = cp.token_index(T, x_TC.device).view(2, L, 1)
    cu = cu_seqlens.long()
    start = cu[sequence_ids(cu, T, index=index)]  # each token's document start
    y = sum(full[:, K - 1 - j:K - 1 - j + L].float() * w_KC[K - 1 - j].float() * (index - j >= start) for j in range(K))
    return _conv_out(y, bias, silu, x_TC.dtype).reshape(T, -1)


def _causal_conv_continued(x_STC, w_KC, before_SJC, silu: bool = True, bias=None):
    """_causal_conv of S sequences' T new tokens x [S, T, C] after the J = K - 1 tokens
    before_SJC [S, J, C] they continue; returns (y [S, T, C], the new last J tokens)."""
    K = w_KC.shape[0]
    full = torch.cat([before_SJC.to(x_STC.dtype), x_STC], dim=1)  # [S, J + T, C]
    T = x_STC.shape[1]
    y = sum(full[:, j:j + T].float() * w_KC[j].float() for j in range(K))
    return _conv_out(y, bias, silu, x_STC.dtype), full[:, full.shape[1] - (K - 1):]


def _one_conv(u, taps, cu, split, states, silu: bool, bias=None):
    """The causal convolution of u [T, C] alone (LFM2's short convolution's, Mamba-1's):
    over a context-parallel split (the K - 1 tokens before each chunk from the rank holding
    them), the documents of cu, or continuing the decoding states (whose conv it replaces)."""
    if split is not None:
        return _causal_conv_split(u, taps, cu, split, silu=silu, bias=bias)
    if states is None:
        return _causal_conv(u, taps, cu, silu=silu, bias=bias)
    T, S = u.shape[0], states.conv.shape[0]
    y, states.conv = _causal_conv_continued(u.view(S, T // S, -1), taps, states.conv, silu=silu, bias=bias)
    return y.reshape(T, -1)


def _short_conv(x, params, cfg: LinearAttentionConfig, cu, split, states, mm) -> torch.Tensor:
    """LFM2's gated short convolution (linear_attention's kind "short_conv"): [T, H]."""
    y = _one_conv(mm(x, params["wb"]) * mm(x, params["wv"]), params["conv_v"], cu, split, states, silu=False)
    return mm(mm(x, params["wc"]) * y, params["wo"])


def _mamba1(x, params, cfg: LinearAttentionConfig, cu, split, states, mm, heads_sum) -> torch.Tensor:
    """Mamba-1's mixer (linear_attention's kind "mamba1"): [T, H]. Each of its C channels
    keeps a state of N = k_head_dim with a decay per state channel, B and C shared by every
    channel (fmoe.ops.selective_scan; selective_scan_cp over a cp split); with
    heads_sum (tensor parallel: this rank's channels) dt's, B's and C's projections summed
    over every rank's channels in one collective."""
    T, C, N = x.shape[0], cfg.n_v_heads, cfg.k_head_dim
    B = 1 if states is None else states.conv.shape[0]
    if split is not None and not callable(getattr(split, "selective_scan", None)):
        raise ValueError(f"ctx.linear_cp: mamba1 needs its selective_scan (fmoe.parallel.ContextParallel), got {type(split).__name__} without it")
    xc = _one_conv(mm(x, params["wv"]), params["conv_v"], cu, split, states, silu=True, bias=params["conv_v_bias"])  # [T, C]
    r, bk, cq = (mm(xc, params[n]) for n in ("wdt", "wk", "wq"))
    if heads_sum is not None:
        r, bk, cq = heads_sum(torch.cat([r, bk, cq], -1)).split([r.shape[-1], N, N], -1)
    if cfg.dt_bc_norm != "none":  # Jamba's (with weights) and Falcon Mamba's (without) RMS norms on dt, B and C
        r, bk, cq = (_rms_norm(t, params[n] if cfg.dt_bc_norm == "rms" else None, cfg.norm_eps)
                     for t, n in ((r, "dt_norm"), (bk, "b_norm"), (cq, "c_norm")))
    dt = F.softplus(mm(r, params["wa"]).float() + params["dt_bias"].float())  # [T, C]
    A, u = -params["A_log"].float().exp(), xc.float() * dt
    if split is not None:  # context parallel: the scan across the split (fmoe.parallel.selective_scan_cp)
        o = split.selective_scan(u[None], dt[None], A, bk[None], cq[None], cu, chunk_size=cfg.chunk_size, impl=cfg.impl, check=False)
    else:  # the scan kernels on CUDA (fmoe.ops.selective_scan), its chunked form elsewhere
        view = lambda t: t.reshape(B, T // B, t.shape[-1])  # noqa: E731  (not -1: T = 0 leaves it undefined)
        o = selective_scan(view(u), view(dt), A, view(bk), view(cq), cu, chunk_size=cfg.chunk_size, impl=cfg.impl, check=False,
                           initial_state=None if states is None else states.state[..., 0], final_state=states is not None)
        if states is not None:
            o, states.state = o[0], o[1][..., None]
    y = (o.reshape(T, C).float() + params["D"].float() * xc.float()) * F.silu(mm(x, params["wz"]).float())
    return mm(y.to(x.dtype), params["wo"])


def _without_delta(q, k, v, g, cfg: LinearAttentionConfig, cu, split, states) -> torch.Tensor:
    """fmoe.ops.gated_linear_attention (query scale 1) of lightning attention and Mamba-2: over a
    context-parallel split (split.gated_linear_attention), the documents of cu, or continuing
    the decoding states (whose state it replaces). o [B, T / B, N, Dv]."""
    kw = dict(scale=1.0, chunk_size=cfg.chunk_size, impl=cfg.impl)
    if split is not None:
        if not callable(getattr(split, "gated_linear_attention", None)):
            raise ValueError(f"ctx.linear_cp: {cfg.kind} needs its gated_linear_attention (fmoe.parallel.ContextParallel), "
                             f"got {type(split).__name__} without it")
        return split.gated_linear_attention(q, k, v, g, cu, check=False, **kw)
    if states is None:  # the context's cu_seqlens: make_batch checked them (no host read here)
        return gated_linear_attention(q, k, v, g, cu, check=False, **kw)
    o, states.state = gated_linear_attention(q, k, v, g, initial_state=states.state, final_state=True, check=False, **kw)  # no host read
    return o


def _lightning(x, params, cfg: LinearAttentionConfig, cu, split, states, mm, heads_mean) -> torch.Tensor:
    """MiniMax's lightning attention (linear_attention's kind "lightning"): [T, H]."""
    T, N, D = x.shape[0], cfg.n_v_heads, cfg.v_head_dim
    B = 1 if states is None else states.state.shape[0]
    q, k, v = (F.silu(mm(x, params[n])).reshape(B, T // B, N, D) for n in ("wq", "wk", "wv"))
    o = _without_delta(q, k, v, params["decay"].float().expand(B, T // B, N), cfg, cu, split, states)
    o_TC = o.reshape(T, N * D).float()
    ms = o_TC.square().mean(-1, keepdim=True)
    if heads_mean is not None:  # tensor parallel: the mean square over every rank's heads
        ms = heads_mean(ms)
    gated = (_rms_norm(o_TC, params["out_norm"], cfg.norm_eps, ms) * torch.sigmoid(mm(x, params["wz"]).float())).to(x.dtype)
    return mm(gated, params["wo"])


def _qkv_conv(x, params, ctx, split, states, mm):
    """q, k and v's projections (wq, wk, wv) through their causal convolutions (conv_q,
    conv_k, conv_v; Mamba-2's with biases conv_q_bias, ...) and silu: (B, cu, [q, k, v] [T, C]
    each): B rows of T / B tokens, the documents' cu_seqlens (None in decoding, whose conv
    state is updated)."""
    T = x.shape[0]
    qkv = [mm(x, params[n]) for n in ("wq", "wk", "wv")]
    taps = torch.cat([params[n] for n in ("conv_q", "conv_k", "conv_v")], -1)
    bias = torch.cat([params[n] for n in ("conv_q_bias", "conv_k_bias", "conv_v_bias")]) if "conv_q_bias" in params else None
    sizes = [t.shape[-1] for t in qkv]
    if states is not None:
        B = states.state.shape[0]
        y, states.conv = _causal_conv_continued(torch.cat(qkv, -1).view(B, T // B, -1), taps, states.conv, bias=bias)
        return B, None, list(y.reshape(T, -1).split(sizes, dim=-1))
    if split is not None:  # context parallel: one exchange for the three convolutions
        y = _causal_conv_split(torch.cat(qkv, -1), taps, ctx.cu_seqlens, split, bias=bias)
    else:
        y = _causal_conv(torch.cat(qkv, -1), taps, ctx.cu_seqlens, bias=bias)
    return 1, ctx.cu_seqlens, list(y.split(sizes, dim=-1))


def _mamba2(x, qkv, params, cfg: LinearAttentionConfig, B: int, cu, split, states, mm) -> torch.Tensor:
    """Mamba-2's mixer (linear_attention's kind "mamba2") from its convolved q (C), k (B) and
    v (x) [T, C]: [T, H]."""
    T, Nk, Nv, Dk, Dv = x.shape[0], cfg.n_k_heads, cfg.n_v_heads, cfg.k_head_dim, cfg.v_head_dim
    r = Nv // Nk
    q, k = (t.reshape(B, T // B, Nk, Dk).repeat_interleave(r, dim=2) for t in qkv[:2])
    xv = qkv[2].reshape(B, T // B, Nv, Dv).float()
    dt = F.softplus(mm(x, params["wa"]).float() + params["dt_bias"].float()).reshape(B, T // B, Nv)
    if cfg.dt_min:  # Nemotron-H's floor (no gradient below it, as torch.clamp's)
        dt = dt.clamp(min=cfg.dt_min)
    o = _without_delta(q, k, xv * dt[..., None], -params["A_log"].float().exp() * dt, cfg, cu, split, states)
    o = (o.float() + params["D"].float()[:, None] * xv).reshape(T, Nv * Dv)  # the skip
    gate = F.silu(mm(x, params["wz"]).float())
    if cfg.gate_norm == "none":
        return mm((o * gate).to(x.dtype), params["wo"])
    weight = params["out_norm"].view(Nk, r * Dv)  # a norm per group of key heads
    if cfg.gate_norm == "before":
        normed = _rms_norm(o.view(T, Nk, r * Dv), weight, cfg.norm_eps).reshape(T, Nv * Dv) * gate
    else:
        normed = _rms_norm((o * gate).view(T, Nk, r * Dv), weight, cfg.norm_eps)
    return mm(normed.reshape(T, Nv * Dv).to(x.dtype), params["wo"])


def _l2_normalize(x):
    """x / sqrt(sum(x^2) + 1e-6) over the last dim, float32 (Gated DeltaNet's q and k; the
    eps of fla's kernels and of transformers)."""
    x = x.float()
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def _check_linear_attention(x, params, cfg: LinearAttentionConfig) -> None:
    check_float("x", x, 2, "[T, H]")
    if not isinstance(cfg, LinearAttentionConfig):
        raise ValueError(f"cfg: expected a LinearAttentionConfig, got {type(cfg).__name__}")
    if not isinstance(params, Mapping):
        raise ValueError(f"params: expected a dict of tensors (linear_attention_shapes' names), got {type(params).__name__}")
    for name, shape in linear_attention_shapes(x.shape[1], cfg).items():
        p = params.get(name)
        if not isinstance(p, torch.Tensor) or tuple(p.shape) != shape:
            got = list(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(f"params[{name!r}]: expected a tensor {list(shape)}, got {got}")
        if name.startswith("w") and p.dtype != x.dtype:  # the projections' matrices multiply x's dtype
            raise ValueError(f"params[{name!r}]: expected x's dtype {x.dtype}, got {p.dtype}")
    decay = params.get("decay")
    if cfg.kind == "lightning" and (not isinstance(decay, torch.Tensor) or tuple(decay.shape) != (cfg.n_v_heads,)):
        got = list(decay.shape) if isinstance(decay, torch.Tensor) else type(decay).__name__
        raise ValueError(f"params['decay']: expected lightning attention's log-decay per head, a tensor [{cfg.n_v_heads}] (lightning_decay), got {got}")


def linear_attention(x: torch.Tensor, params, cfg: LinearAttentionConfig, ctx: "AttentionContext", *, heads_mean=None, heads_sum=None):
    """Gated DeltaNet over packed documents (Qwen3-Next's and Qwen3.5's linear attention);
    no host sync.

        q, k, v = silu(causal_conv(x wq)), silu(causal_conv(x wk)), silu(causal_conv(x wv))
        q, k = q / |q|, k / |k|                              per head (eps 1e-6)
        beta = sigmoid(x wb),  g = -exp(A_log) softplus(x wa + dt_bias)      per value head
                                                   (beta = 2 sigmoid(x wb) with cfg.neg_eigval)
        o = gated_delta_rule(q, k, v, g, beta)               q, k repeated over the value heads
        y = (rmsnorm(o) out_norm * silu(x wz)) wo           the norm over each head's Dv

    Kimi Delta Attention (cfg.kind "kda", Kimi Linear) differs in the decay, per key channel,
    and the output gate, low rank through a sigmoid:

        g = -exp(A_log) softplus(x wf_a wf_b + dt_bias)     [T, N, Dk]: A_log per head
        y = (rmsnorm(o) out_norm * sigmoid(x wz_a wz_b)) wo

    and Ling's variant (cfg.full_rank, cfg.decay_bound b) in its projections and decay:

        g = b sigmoid(exp(A_log) (x wf + dt_bias)),  y = (rmsnorm(o) out_norm * sigmoid(x wz)) wo

    LFM2's gated short convolution (cfg.kind "short_conv") has no rule, only the convolution
    (without silu, conv_v's taps) between two gates:

        y = ((x wc) * causal_conv((x wb) * (x wv))) wo

    Mamba-2's mixer (cfg.kind "mamba2", SSD; Granite 4.0-H's, Nemotron-H's) has the
    convolution (with biases) and no rule; C, B (q, k: Nk groups of the state's Dk) are read by
    the Nv heads of x (v, Dv), unnormalised:

        q, k, x = silu(causal_conv(x wq) + b_q), ..., dt = softplus(x wa + dt_bias)   [T, Nv]
        o = gated_linear_attention(q, k, x dt, -exp(A_log) dt, scale=1) + D x
        y = (groupnorm(o * silu(x wz)) out_norm) wo       the norm over each key group's r Dv

    Mamba-1's mixer (cfg.kind "mamba1"; Mamba's, Falcon Mamba's, Jamba's) has one
    convolution (with biases) over x's C channels, each channel a head of one value channel
    with its own decay per state channel (A_log [C, N]), and one B and C for all of them:

        u = silu(causal_conv(x wv) + b),  B, C = u wk, u wq,  dt = softplus(u wdt wa + dt_bias)
        o = selective_scan(u dt, dt, -exp(A_log), B, C) + D u       (per channel and state channel)
        y = (o * silu(x wz)) wo

    (with cfg.dt_bc_norm, u wdt, B and C RMS-normed first: with weights dt_norm, b_norm,
    c_norm for "rms", without for "rms_unit").

    MiniMax's lightning attention (cfg.kind "lightning") has no convolution and no rule, a
    constant decay per head (params["decay"], lightning_decay) and a query scale of 1:

        q, k, v = silu(x wq), silu(x wk), silu(x wv)
        o = gated_linear_attention(q, k, v, decay, scale=1)
        y = (rmsnorm(o) out_norm * sigmoid(x wz)) wo        the norm over all N Dv channels

    The convolution and the rule restart at each document (ctx.cu_seqlens), so a document's
    outputs do not depend on what it is packed with. In decoding (ctx.linear_states, a
    LinearStates of S sequences) x holds S sequences' T new tokens each, [S T, H] in that
    order, which continue the states, and the states after them are put in their place.
    Under context parallel (ctx.linear_cp) x holds this rank's T/cp tokens (split_batch's),
    the convolution reads the tokens before its chunks from the other ranks and the rule
    runs across the split (fmoe.parallel.gated_delta_rule_cp): the rows of the whole
    batch's outputs.

    Args:
        x: [T, H]. params: wq, wk [H, Nk Dk], wv, wz [H, Nv Dv], wb, wa [H, Nv], conv_q,
            conv_k [K, Nk Dk], conv_v [K, Nv Dv], A_log, dt_bias [Nv], out_norm [Dv],
            wo [Nv Dv, H] (linear_attention_shapes).
        cfg: LinearAttentionConfig. ctx: an AttentionContext with cu_seqlens (attention_context
            builds one), or with linear_states.
        heads_mean: when params hold a slice of the heads (tensor parallel,
            fmoe.parallel.HeadShard.mean): the mean over the ranks of per-token statistics,
            for lightning attention's norm over every head's channels; None: all heads here.
        heads_sum: when params hold a slice of Mamba-1's channels (tensor parallel,
            fmoe.parallel.HeadShard.sum): the sum over the ranks of per-token partial products
            [T, n], for its dt's, B's and C's projections from every channel; None: all here.
    Returns:
        (y [T, H] in x's dtype, an empty TensorDict): the layers' (output, stats) form.
    """
    _check_linear_attention(x, params, cfg)
    states = getattr(ctx, "linear_states", None)
    if states is None and getattr(ctx, "cu_seqlens", None) is None:
        raise ValueError("ctx: linear attention needs the micro-batch's cu_seqlens (build the context with attention_context) or linear_states")
    cos = getattr(ctx, "cos", None)
    if states is None and isinstance(cos, torch.Tensor) and cos.shape[0] != x.shape[0]:  # its cu_seqlens describe other tokens
        raise ValueError(f"ctx: built for {cos.shape[0]} tokens (its RoPE tables' rows), x has {x.shape[0]}")
    split = getattr(ctx, "linear_cp", None) if states is None else None
    if states is None and split is None and getattr(ctx, "gather_kv", None) is not None:
        raise ValueError("ctx: a context-parallel context (gather_kv) without linear_cp: linear attention needs the rule's exchange across the split "
                         "(build it with fmoe.parallel.ContextParallel(cp_mesh).attention_kwargs(token_index))")
    for name, fn, doc in (("heads_mean", heads_mean, "mean"), ("heads_sum", heads_sum, "sum")):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name}: expected a function of a [T, n] tensor (fmoe.parallel.HeadShard.{doc}) or None, got {type(fn).__name__}")
    if states is not None:
        if not isinstance(states, LinearStates) or not all(isinstance(t, torch.Tensor) for t in (states.conv, states.state)):
            got = type(states).__name__ if not isinstance(states, LinearStates) else f"conv {type(states.conv).__name__}, state {type(states.state).__name__}"
            raise ValueError(f"ctx.linear_states: expected a LinearStates of conv and state tensors (fmoe.model.KVCache's), got {got}")
        tokens = states.tokens
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= x.shape[0]):
            raise ValueError(f"ctx.linear_states.tokens: expected None or an int in 0..{x.shape[0]} (x's rows before decoding's padding), got {tokens!r}")
    if states is not None and states.tokens is not None and states.tokens < x.shape[0]:  # decoding's padding: outputs 0
        real = dataclasses.replace(states, tokens=None)
        y, stats = linear_attention(x[:states.tokens], params, cfg, dataclasses.replace(ctx, linear_states=real), heads_mean=heads_mean,
                                    heads_sum=heads_sum)
        states.conv, states.state = real.conv, real.state
        return torch.cat([y, y.new_zeros(x.shape[0] - states.tokens, y.shape[1])]), stats
    T, Nk, Nv, Dk, Dv = x.shape[0], cfg.n_k_heads, cfg.n_v_heads, cfg.k_head_dim, cfg.v_head_dim
    mm = functools.partial(matmul, fp8=cfg.fp8, impl=cfg.impl)
    if states is not None and (T % states.conv.shape[0] or states.state.shape[0] != states.conv.shape[0]
                               or tuple(states.conv.shape[1:]) != (cfg.conv - 1, cfg.conv_channels)):
        raise ValueError(f"ctx.linear_states: conv {list(states.conv.shape)} and state {list(states.state.shape)} do not fit {T} tokens "
                         f"of cfg's layer (expected [S, {cfg.conv - 1}, {cfg.conv_channels}], T a multiple of S)")
    if states is not None and T == 0:  # a decoding call of no real token: no output row, the states as they were
        return x.new_zeros(0, x.shape[1]), TensorDict({}, batch_size=[])
    if cfg.kind == "short_conv":
        return _short_conv(x, params, cfg, ctx.cu_seqlens if states is None else None, split, states, mm), TensorDict({}, batch_size=[])
    if cfg.kind == "mamba1":
        return _mamba1(x, params, cfg, ctx.cu_seqlens if states is None else None, split, states, mm, heads_sum), TensorDict({}, batch_size=[])
    if cfg.kind == "lightning":
        return _lightning(x, params, cfg, ctx.cu_seqlens if states is None else None, split, states, mm, heads_mean), TensorDict({}, batch_size=[])
    B, cu, qkv = _qkv_conv(x, params, ctx, split, states, mm)
    if cfg.kind == "mamba2":
        return _mamba2(x, qkv, params, cfg, B, cu, split, states, mm), TensorDict({}, batch_size=[])
    r = Nv // Nk
    q, k = (_l2_normalize(t.reshape(B, T // B, Nk, Dk)).repeat_interleave(r, dim=2) for t in qkv[:2])
    v = qkv[2].reshape(B, T // B, Nv, Dv)
    beta = torch.sigmoid(mm(x, params["wb"])).reshape(B, T // B, Nv)
    if cfg.neg_eigval:  # in [0, 2]: OLMo Hybrid's allow_neg_eigval
        beta = beta * 2
    if cfg.kind == "kda":  # a decay per key channel (key and value heads alike)
        f = (mm(x, params["wf"]) if cfg.full_rank else mm(mm(x, params["wf_a"]), params["wf_b"])).float() + params["dt_bias"].float()
        rate = params["A_log"].float().exp().repeat_interleave(Dk)
        g = (-rate * F.softplus(f) if cfg.decay_bound is None else cfg.decay_bound * torch.sigmoid(rate * f)).reshape(B, T // B, Nv, Dk)
    else:
        g = (-params["A_log"].float().exp() * F.softplus(mm(x, params["wa"]).float() + params["dt_bias"].float())).reshape(B, T // B, Nv)
    if split is not None:
        o = split.gated_delta_rule(q, k, v, g, beta, cu, chunk_size=cfg.chunk_size, impl=cfg.impl, check=False)
    elif states is None:
        o = gated_delta_rule(q, k, v, g, beta, cu, chunk_size=cfg.chunk_size, impl=cfg.impl, check=False)  # cu: checked by make_batch
    else:
        o, states.state = gated_delta_rule(q, k, v, g, beta, initial_state=states.state, final_state=True, chunk_size=cfg.chunk_size,
                                           impl=cfg.impl, check=False)  # no host read in a decoding step
    o_TNV = o.reshape(T, Nv, Dv)
    if cfg.kind == "kda":
        z = mm(x, params["wz"]) if cfg.full_rank else mm(mm(x, params["wz_a"]), params["wz_b"])
        gate = torch.sigmoid(z.reshape(T, Nv, Dv).float())
    else:
        gate = F.silu(mm(x, params["wz"]).reshape(T, Nv, Dv).float())
    gated = (_rms_norm(o_TNV, params["out_norm"], cfg.norm_eps).float() * gate).to(x.dtype)
    return mm(gated.reshape(T, Nv * Dv), params["wo"]), TensorDict({}, batch_size=[])
