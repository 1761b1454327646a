"""Upcycling: a trained dense model's weights as the start of an MoE model.

    upcycle_(model, dense_state, dense_cfg, *, seed=0, drop=0.0)    in place, on any mesh

Sparse upcycling (Komatsuzaki et al., 2022) with granularity (He et al., 2024,
arXiv:2410.07524, as Megatron Core's upcycling does). `model` is a Transformer(cfg) with
MoE layers, already initialised (reset_parameters(seed), or fmoe.parallel.materialize with
that seed); `dense_state` the state dict of a dense Transformer(dense_cfg) of the same
shape otherwise (same hidden size, attention, vocabulary, layer count, MTP depth).

- Every parameter the two models share by name and shape (embedding, attention, norms,
  head, the layers that stay dense, the MTP projections) is copied.
- Each MoE layer's routed experts come from the dense FFN of the same block (w_gate, w_up
  [H, F], w_down [F, H]; without a gate, mlp_act "relu2", w_up and w_down), cut along F into
  g = F / ffn_expert slices (the granularity; g = 1: every expert a whole copy): expert e
  holds slice e mod g, so experts g j .. g j + g - 1 (virtual group j) hold the whole FFN
  between them, and since SwiGLU (or relu^2) acts on each of the F channels alone, their
  outputs sum to the dense FFN's.
- The router rows of a virtual group are one row: row j of the router's own initial value
  (init_value(seed, name): what `model` was initialised with). The experts of a group tie
  on every token, top-k takes ties by the lower index, so with k a multiple of g a token's
  k experts are k / g whole groups. With the weights normalised over the k chosen (softmax
  after the top-k, or normalised sigmoids) and times route_scale, a group's g experts share
  one weight and the groups' weights sum to route_scale / g: the routed output is
  route_scale / g times the dense FFN's, so w_down is multiplied by g / route_scale.
  (Megatron Core multiplies each of the three matrices by the cube root of the factor
  instead: their sizes stay alike, but the result is exact only for an activation that
  scales linearly, which silu does not.)
- A hashed block's table (hash_layers: its experts fixed per token id) is redrawn so that
  each token id's k experts are k / g whole virtual groups (drawn as random_hash_table of the
  groups, from (seed, its name)); with g = 1 that is the table the model was initialised with.
- Shared experts start with w_down = 0 (no output until trained; their other weights, a
  shared gate and the expert biases keep their initial values).
- MTP modules the dense model lacks (a Hugging Face model has none) keep their initial
  values, as fmoe.hf.from_pretrained leaves them.

So the MoE model computes the dense model's function at the start, up to float rounding
(the slices' sums are reordered), as long as no token is dropped by a capacity factor.
Training breaks the ties: each expert of a group gets its own router-row gradient. Pre-
softmax routing, unnormalised sigmoids (route_normalize=False, or k = 1: route divides the
sigmoids by their sum only when k > 1) and SparseMixer (weights that do not sum to a
constant), weights on the experts' input (route_on_input), a norm on the experts' or the
MoE's output, gpt-oss's expert biases and a non-plain SwiGLU (the experts', the dense FFN's,
or that of the MoE model's dense MLPs) are refused: no exact start exists there. Every check
(the configs, and each dense tensor's presence and shape) comes before the first write: a
refusal leaves `model` as it was.
With drop > 0 (Drop-Upcycling) part of each expert starts fresh instead, by design.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence, Union

import torch

from fmoe.model import Transformer, TransformerConfig, copy_full_value, init_value, name_generator, random_hash_table
from fmoe.ops.checks import holds_values


def _moe_blocks(cfg: TransformerConfig) -> list[str]:
    """The name prefixes of the blocks that are MoE in a whole Transformer(cfg)."""
    blocks = [f"blocks.{i}.mlp." for i in range(cfg.n_layers) if cfg.is_moe(i)]
    if blocks:  # an MTP module's block is MoE when the trunk has MoE blocks
        blocks += [f"mtp.{d}.block.mlp." for d in range(cfg.mtp_depth)]
    return blocks


def granularity(cfg: TransformerConfig, dense_cfg: TransformerConfig) -> int:
    """g = dense_cfg.ffn_dense / cfg.ffn_expert, once the pair is checked for an exact start
    (module docstring); a ValueError names the knob that rules it out."""
    if any(dense_cfg.is_moe(i) for i in range(dense_cfg.n_layers)):
        raise ValueError("dense_cfg: expected a dense model (no MoE layer: n_dense = n_layers), got one with MoE layers")
    if not _moe_blocks(cfg):
        raise ValueError("cfg: expected a model with MoE layers to upcycle into, got a dense one")
    F, Fe, E, k = dense_cfg.ffn_dense, cfg.ffn_expert, cfg.n_experts, cfg.k
    if F % Fe:
        raise ValueError(f"ffn_expert: expected a divisor of the dense model's ffn_dense={F} (the experts are slices of its FFN), got {Fe}")
    g = F // Fe
    if E % g:
        raise ValueError(f"n_experts: expected a multiple of the granularity g = ffn_dense / ffn_expert = {g}, got {E}")
    if k % g:
        raise ValueError(f"k: expected a multiple of the granularity g = {g} (each token takes whole groups of the g slices), got {k}")
    if cfg.n_groups and (E // cfg.n_groups) % g:
        raise ValueError(f"n_groups: expected routing groups of a multiple of g = {g} experts, got {E // cfg.n_groups} per group")
    if cfg.score == "softmax" and cfg.pre_softmax:
        raise ValueError("pre_softmax: the weights of a softmax over every expert do not sum to a constant over the k chosen; "
                         "upcycling needs the softmax after the top-k (pre_softmax=False)")
    if cfg.score == "sparsemixer":
        raise ValueError("score: sparsemixer's weights (each slot's own masked softmax) do not sum to a constant over the k chosen; "
                         "upcycling needs softmax (after the top-k), sigmoid or sqrtsoftplus routing")
    if cfg.route_on_input:
        raise ValueError("route_on_input: the routing weight scales each expert's input, and the SwiGLU of a scaled input is not the "
                         "scaled SwiGLU; upcycling needs the weights on the experts' output (route_on_input=False)")
    if cfg.score in ("sigmoid", "sqrtsoftplus") and not cfg.route_normalize:
        raise ValueError(f"route_normalize: unnormalised {cfg.score} weights do not sum to a constant; upcycling needs route_normalize=True")
    if cfg.score == "sigmoid" and k == 1:  # sqrt(softplus) is normalised for every k: its one weight is 1
        raise ValueError("k: a single sigmoid weight is not normalised (sigmoids are divided by their sum only when k > 1), so it is not a "
                         "constant; upcycling with sigmoid routing needs k > 1 (or score='sqrtsoftplus')")
    if dense_cfg.mlp_bias:
        raise ValueError("mlp_bias: the dense FFN's biases are not carried into the experts (their output bias would count once per "
                         "chosen slice); upcycle a dense model without them")
    if cfg.expert_biases:
        raise ValueError("expert_biases: the dense FFN has no biases to upcycle them from")
    if cfg.mlp_act != dense_cfg.mlp_act:
        raise ValueError(f"mlp_act: the experts' gate activation must be the dense FFN's, {dense_cfg.mlp_act!r}, got {cfg.mlp_act!r}")
    if (cfg.swiglu_alpha, cfg.swiglu_limit, cfg.swiglu_offset) != (1.0, None, 0.0):
        raise ValueError("swiglu_alpha, swiglu_limit, swiglu_offset: the dense FFN's SwiGLU is the plain one; the experts' must be too")
    if dense_cfg.shared_swiglu_limit is not None:
        raise ValueError("shared_swiglu_limit: the dense FFN's SwiGLU is clamped, which the experts' plain one would not be; upcycle a dense "
                         "model without the clamp")
    if (dense_cfg.shared_swiglu_alpha, dense_cfg.shared_swiglu_offset) != (1.0, 0.0):
        raise ValueError(f"shared_swiglu_alpha, shared_swiglu_offset: the dense FFN's SwiGLU is g sigmoid(alpha g) (u + offset) (alpha="
                         f"{dense_cfg.shared_swiglu_alpha!r}, offset={dense_cfg.shared_swiglu_offset!r}), which the experts' plain one "
                         "would not compute; upcycle a dense model with the plain SwiGLU (1.0, 0.0)")
    if cfg.moe_out_norm:
        raise ValueError("moe_out_norm: a norm on the MoE blocks' output changes the dense block's function; upcycle without it")
    if cfg.expert_out_norm:
        raise ValueError("expert_out_norm: each routed expert's output normed before its weight, the slices' outputs no longer sum to the "
                         "dense FFN's; upcycle without it")
    if cfg.norm_gate_rank:
        raise ValueError("norm_gate_rank: a MoE block's pre-MLP norm is gated (GatedRMSNorm), a dense block's is not, which changes the "
                         "dense block's function; upcycle without it")
    if cfg.dense_beside_moe:
        raise ValueError("dense_beside_moe: Gemma 4's MoE blocks keep a dense MLP beside the experts, each with norms of its own, which "
                         "changes the dense block's function; upcycle without it")
    if cfg.moe_latent:
        raise ValueError("moe_latent: a latent MoE's experts work in L channels between two projections the dense FFN does not have; "
                         "upcycle without it")
    if cfg.zero_experts:
        raise ValueError("zero_experts: a slot routed to a zero expert passes its token through, which changes the dense block's "
                         "function; upcycle without them")
    if cfg.shortcut_moe:
        raise ValueError("shortcut_moe: a pair's MoE output added after the next block (beside a dense MLP of its own) changes the "
                         "dense blocks' function; upcycle without it")
    return g


# TransformerConfig fields in which the MoE model may differ from the dense one: its MoE blocks' knobs (granularity checks
# those that rule an exact start out), how it runs (impl, ac, fp8, init_std, the losses' weights), and its MTP modules
# (a Hugging Face dense model has none). Every other field must be the dense model's: it shapes the function the MoE
# model computes at the start (a layer more, another RoPE base or norm eps gave other logits with matching shapes), and
# so must those of _DENSE_MLP_FIELDS where the MoE model has dense MLPs (_differ). post_norm_eps is not here: it is the
# eps of every block's post-norms (the MoE-only norms that take it, moe_out_norm and expert_out_norm, are refused).
_MAY_DIFFER = frozenset({
    "n_dense", "ffn_dense", "n_experts", "k", "ffn_expert", "n_shared", "shared_ffn", "shared_gate", "shared_scale", "moe_layers", "score",
    "pre_softmax", "n_groups", "topk_groups", "group_score_topk", "route_scale", "route_normalize", "expert_bias", "expert_bias_on_logits",
    "sparsemixer_eps", "zero_experts", "hash_layers", "shortcut_moe", "capacity_factor", "capacity_policy", "route_on_input", "moe_out_bias",
    "router_softcap", "router_scale", "router_bias", "expert_biases", "swiglu_alpha", "swiglu_limit", "swiglu_offset", "shared_swiglu_limit",
    "shared_swiglu_alpha", "shared_swiglu_offset", "swiglu_limit_layers", "shared_swiglu_limit_layers", "mlp_act", "mlp_bias", "dense_beside_moe",
    "router_norm", "router_expert_scale", "moe_out_norm", "moe_latent", "moe_latent_norm", "expert_out_norm", "norm_gate_rank",
    "mtp_depth", "mtp_norm", "init_std", "impl", "ac", "fp8", "fp8_layers", "fp8_fast_accum", "index_loss_coeff", "moa_aux_coeff",
})
# the fields of _MAY_DIFFER that shape the dense MLPs too (Block: ffn_dense, mlp_bias, and the shared experts' SwiGLU knobs)
_DENSE_MLP_FIELDS = ("ffn_dense", "mlp_bias", "shared_swiglu_alpha", "shared_swiglu_offset")


def _differ(cfg: TransformerConfig, dense_cfg: TransformerConfig) -> list[str]:
    """The fields in which the MoE model cfg differs from dense_cfg outside its MoE blocks'
    routed part ("name=dense value (here value)"): those not in _MAY_DIFFER; where cfg has
    dense MLP blocks, _DENSE_MLP_FIELDS and their SwiGLU clamp; and mtp_norm where an MTP
    module is copied (its own output norm, or the trunk's final norm)."""
    must = {f.name for f in dataclasses.fields(TransformerConfig) if f.name not in _MAY_DIFFER}
    dense_mlps = [i for i in range(cfg.n_layers) if not cfg.is_moe(i) and i not in (cfg.mlp_free_layers or ())]
    if dense_mlps:
        must.update(_DENSE_MLP_FIELDS)
        if any(cfg.mlp_limit(i) != dense_cfg.mlp_limit(i) for i in dense_mlps):
            must.update(("shared_swiglu_limit", "shared_swiglu_limit_layers"))
    if cfg.mtp_depth and dense_cfg.mtp_depth:
        must.add("mtp_norm")
    return [f"{f.name}={getattr(dense_cfg, f.name)!r} (here {getattr(cfg, f.name)!r})" for f in dataclasses.fields(TransformerConfig)
            if f.name in must and getattr(dense_cfg, f.name) != getattr(cfg, f.name)]


def _plan(part: Transformer, dense_state: Mapping[str, torch.Tensor], dense_cfg: TransformerConfig) -> tuple[int, list]:
    """Check one part against the dense model, writing nothing: (g, [(name, p, what,
    source)]), what the parameter's name in its MoE block ("router", "experts.w_up", ...;
    None outside one), source the dense tensor it is written from (None: none). Each source is
    read here to check it, one at a time, and once more where it is written."""
    cfg = part.cfg
    g = granularity(cfg, dense_cfg)
    differ = _differ(cfg, dense_cfg)
    if differ:
        raise ValueError(f"dense_cfg: the dense model differs from the MoE model outside its MoE blocks: {', '.join(differ)}; "
                         "the upcycled model would not start as the dense model's function")
    H, Fe = cfg.hidden, cfg.ffn_expert
    blocks, plan = _moe_blocks(cfg), []
    for name, p in part.named_parameters():
        if name.startswith("mtp.") and int(name.split(".")[1]) >= dense_cfg.mtp_depth:
            continue  # an MTP module the dense model lacks (a Hugging Face model's): its initial values
        block = next((b for b in blocks if name.startswith(b)), None)
        what = name[len(block):] if block is not None else None
        if what in ("router", "shared.w_down"):
            plan.append((name, p, what, None))
            continue
        if what in ("experts.w_gate", "experts.w_up", "experts.w_down"):
            source = block + what.split(".")[1]
            missing = f"dense_state: no {source!r} to upcycle {name!r} from"
            shape, whose = (g * Fe, H) if what == "experts.w_down" else (H, g * Fe), "expected"
        elif what is not None and what.startswith(("router_bias", "router_norm", "expert_scale", "shared.", "shared_gate", "out_bias")):
            continue  # their initial values (Gemma 4's router scales: ones, each group's weights alike; the output bias: zeros)
        else:
            source, shape, whose = name, tuple(p.shape), "the MoE model's is"
            missing = f"dense_state: no {name!r}: the dense model differs from the MoE model outside the MoE layers"
        try:
            value = dense_state[source]
        except KeyError:
            raise ValueError(missing) from None
        if not isinstance(value, torch.Tensor):  # a numpy array: "no attribute 'detach'" before
            raise ValueError(f"dense_state: {source!r} is a {type(value).__name__}, expected a tensor")
        if tuple(value.shape) != shape:
            raise ValueError(f"dense_state: {source!r} has shape {tuple(value.shape)}, {whose} {shape}")
        if not holds_values(value):  # read when written: the model half written before torch's NotImplementedError
            raise ValueError(f"dense_state: {source!r} is a {value.device.type} tensor holding no values (a dense model built on the meta "
                             "device and never loaded?)")
        plan.append((name, p, what, source))
    return g, plan


@torch.no_grad()
def upcycle_(model: Union[Transformer, Sequence[Transformer]], dense_state: Mapping[str, torch.Tensor], dense_cfg: TransformerConfig,
             *, seed: int = 0, drop: float = 0.0) -> None:
    """Write the dense model's weights into `model`, an initialised MoE Transformer, in place
    (module docstring).

    Args:
        model: a Transformer with MoE layers, or this rank's pipeline parts (a list of
            pruned Transformers: each writes the parameters it holds). Its parameters may be
            DTensors (FSDP2, TP, EP): each rank writes its own block of every full value.
        dense_state: the dense model's full state (parameter name -> tensor): a state dict,
            or fmoe.train.checkpoint.ModelTensors(path), which reads each tensor from the
            checkpoint only when it is needed, so a rank holds one dense tensor at a time.
        dense_cfg: the dense model's TransformerConfig.
        seed: the seed `model` was initialised with (its routers' rows come from it).
        drop: Drop-Upcycling (Nakamura et al., ICLR 2025): in each expert, this fraction of
            its Fe channels (chosen at random per expert, round(drop Fe) of them, the same in
            its w_gate columns, w_up columns and w_down rows) is drawn afresh from a normal
            with the mean and standard deviation of the dense matrix it came from (w_down's
            after the scale above), so the copies of an FFN start apart. 0 (the default):
            the exact start above; 1: every expert fresh, with the dense weights' statistics.

    Raises a ValueError naming the knob (granularity, or a field the dense model has another
    value of) or the parameter (a shape, or one the dense model lacks) that rules the pair
    out, before anything is written.
    """
    if isinstance(drop, bool) or not isinstance(drop, (int, float)) or not 0.0 <= drop <= 1.0:
        raise ValueError(f"drop: expected the fraction of each expert's channels to draw afresh, in [0, 1], got {drop!r}")
    if not isinstance(dense_cfg, TransformerConfig):
        raise ValueError(f"dense_cfg: expected the dense model's TransformerConfig, got {type(dense_cfg).__name__}")
    if not isinstance(dense_state, Mapping):  # the dense model itself: "argument of type 'Transformer' is not iterable" before
        raise ValueError(f"dense_state: expected the dense model's state (a mapping of names to tensors, e.g. its state_dict()), "
                         f"got {type(dense_state).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, int):  # reset_parameters' rule: the routers' rows come from it
        raise ValueError(f"seed: expected an int (the seed the model was initialised with), got {seed!r}")
    listed = isinstance(model, Iterable) and not isinstance(model, (str, bytes, torch.nn.Module))
    parts = [model] if isinstance(model, torch.nn.Module) else list(model) if listed else []  # a generator of chunks too
    if not parts or not all(isinstance(part, Transformer) for part in parts):
        raise ValueError(f"model: expected a fmoe.model.Transformer or a sequence of its pipeline chunks, got "
                         f"{[type(m).__name__ for m in parts] if listed and parts else type(model).__name__}")
    empty = next((name for part in parts for name, p in part.named_parameters() if not holds_values(p)), None)
    if empty is not None:  # copies into it wrote nothing, without a word
        raise ValueError(f"model: {empty!r} is a meta tensor holding no values (a model built on the meta device): allocate and "
                         "initialise it first (fmoe.parallel.materialize, or to_empty and reset_parameters)")
    plans = [_plan(part, dense_state, dense_cfg) for part in parts]  # every check first: a refusal leaves the model as it was
    fe = parts[0].cfg.ffn_expert
    if drop > 0 and round(drop * fe) == 0:  # the exact start, where a Drop-Upcycling one was asked for
        raise ValueError(f"drop: {drop:g} of each expert's {fe} channels rounds to none (round(drop Fe) = 0), so no channel would "
                         f"start fresh; {1 / fe:.3g} or more draws one (0: the exact start)")
    for part, (g, plan) in zip(parts, plans):
        cfg = part.cfg
        E, H, Fe = cfg.n_experts, cfg.hidden, cfg.ffn_expert
        for name, p, what, source in plan:
            if what == "router":  # virtual groups: experts g j .. g j + g - 1 share row j
                fresh = init_value(seed, name, p.shape, cfg.init_std)
                copy_full_value(p, fresh[: E // g].repeat_interleave(g, dim=0))
            elif what == "shared.w_down":  # the shared experts add nothing until trained
                copy_full_value(p, torch.zeros(p.shape))
            elif what is not None:  # the routed experts, from the dense FFN
                dense = dense_state[source].detach().float().cpu()
                if what == "experts.w_down":  # [F, H] -> slices [g, Fe, H], times g / route_scale
                    experts = dense.reshape(g, Fe, H) * (g / (cfg.route_scale or 1.0))
                else:  # [H, F] -> slices [g, H, Fe]
                    experts = dense.reshape(H, g, Fe).transpose(0, 1)
                experts = experts.repeat(E // g, 1, 1)  # expert e: slice e mod g
                if drop > 0:  # Drop-Upcycling: each expert's dropped channels drawn afresh
                    n = round(drop * Fe)
                    # the same channels in an expert's three matrices: one draw per block
                    block = name[: -len(what)]
                    dropped = torch.zeros(E, Fe, dtype=torch.bool)
                    dropped.scatter_(1, init_value(seed, block + "drop", (E, Fe), 1.0).argsort(dim=1)[:, :n], True)
                    fresh = init_value(seed, name + ".drop", experts.shape, 1.0) * experts.std() + experts.mean()
                    experts = torch.where(dropped[:, :, None] if what == "experts.w_down" else dropped[:, None, :], fresh, experts)
                copy_full_value(p, experts)
            else:
                copy_full_value(p, dense_state[source].detach().cpu())  # its second read (_plan's the first): one tensor held at a time
        for name, table in part.named_buffers():
            if name.endswith("hash_table"):  # hashed blocks: each token id's k experts as k / g whole virtual groups
                V, k = table.shape
                groups = random_hash_table(V, k // g, E // g, name_generator(seed, name))  # g = 1: the table reset_parameters drew
                table.copy_((groups[:, :, None] * g + torch.arange(g)).reshape(V, k))
