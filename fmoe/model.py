"""nn.Modules that own parameters and call fmoe.layers, and the reference MoE transformer.

    MoE(hidden, ffn, cfg)(x[..., H]) -> (y[..., H], stats)
    model = Transformer(TransformerConfig(...))
    ctx = model.context(batch)            # once per micro-batch: RoPE tables, attention mask
    losses, stats = model(batch, ctx)     # batch: fmoe.train.data.make_batch's TensorDict

The reference transformer is a decoder over packed documents (DeepSeek-V3 style), built only
from fmoe.layers and fmoe.ops: token embedding, `n_dense` dense SwiGLU blocks then MoE
blocks, RMSNorm residual blocks (pre-norm, or post- or both) with GQA attention (RoPE or YaRN), shared experts,
sigmoid or softmax routing with an expert bias or aux losses, optional capacity, and
`mtp_depth` multi-token-prediction modules (SPEC.md 5) sharing the embedding and the output
head: module d takes the previous depth's hidden state h and the embedding of its input
tokens, h' = W_proj [norm(emb); norm(h)], runs one block, and predicts with the shared head.
Its forward returns losses as SUMS over valid tokens with their counts, so that a train loop
divides by the step's global valid-token count (DESIGN.md: gradients then do not depend on
how tokens are split over ranks or micro-batches), and a TensorDict of per-layer MoE stats.
One micro-batch, one context: what depends only on the batch (the RoPE tables of the trunk
and of every MTP depth, the attention mask) is built once by `Transformer.context` and
passed down to every attention call; the forward and backward read no tensor value on the
host (no device->host sync), so the whole model compiles with torch.compile(fullgraph=True).
Activation checkpointing (TransformerConfig.ac, AC_MODES): "full" recomputes each block in
the backward, "attention" each block's norm and attention, "experts" each MoE layer's
routed experts (torch.utils.checkpoint, non-reentrant, inside the modules, so it composes
with FSDP2, TP and EP); gradients, losses and stats equal those of "none".
Pipeline parallelism (fmoe.parallel.pipeline) prunes a Transformer to one stage's blocks
(LayerElsewhere placeholders keep the indices, so names stay the whole model's) and sets its
`pipeline_chunk` (PipelineChunk); forward then takes the previous stage's `hidden`.
Inference: `logits(input_ids, cu_seqlens)` of packed documents, and `decode(input_ids,
cache)` of the new tokens of one sequence through a KVCache (`kv_cache(max_tokens)`).

Legend: T tokens, H hidden, V vocab, F expert FFN size, Fs shared FFN size, E experts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
import re
from typing import Optional

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

from fmoe.layers import (EXPERT_BIASES, GATE_NORMS, LINEAR_KINDS, AttentionConfig, AttentionContext, LinearAttentionConfig, LinearStates, MoEConfig, alibi_slopes, attach_loss, attention,
                         PLAIN_ACTS, XIELU, attention_context, check_clip_qkv, check_hash_routing, check_sparsemixer_knobs, check_window, compress_shapes, dense_mlp, gqa_q_shapes, index_shapes, lightning_decay, linear_attention, linear_attention_shapes, local_experts, mla_shapes, out_shapes,
                         moe, prescaled_rms_norm, q_in, qk_norm_shapes, rms_norm_saving_input, softmax_scale)
from fmoe.ops import linear_cross_entropy
from fmoe.ops.checks import check_positive_int
from fmoe.ops.experts import GLU_ACTS
from fmoe.ops.fp8 import check_fp8_fast_accum
from fmoe.ops.backend import local_tensor as _local

# activation checkpointing (TransformerConfig.ac): what the backward recomputes instead of
# keeping. none; full: each block; attention: each block's norm + attention; experts: each
# MoE layer's routed experts (dispatch, grouped SwiGLU MLP, combine: the [T k, F] tensors)
AC_MODES = ("none", "full", "attention", "experts")
NORM_ROLES = ("embed", "attn_post", "mlp_post", "final")  # TransformerConfig.norm_overrides' roles
NORM_KINDS = ("unit", "plain", "zero_centered", "prescaled")  # ... and kinds
HC_KINDS = ("manifold", "independent")


# the fields of the blocks' configs that TransformerConfig fills from fields of other names: a
# block config's ValueError names the TransformerConfig field (_named_as)
ATTENTION_FIELDS = dict(score_softcap="attn_softcap", rot_dim="rope_dim", interleaved="rope_interleaved", reversed="rope_reversed",
                        linear_factor="rope_linear_factor", v_dim="v_head_dim", v_scale="value_scale", out_norm="attn_out_norm",
                        k_eq_v="global_k_eq_v", latent_norm_eps="mla_norm_eps", latent_scales="mla_scales", gate_on_q="attn_gate_on_q",
                        scale="attn_scale", gate_act="attn_gate_act", gate_per_head="attn_gate_per_head",
                        index_interleaved="index_rope_interleaved", index_shared="index_shared_layers", index_loss="index_loss_coeff",
                        temperature_kind="nope_temperature_kind")
MOE_FIELDS = dict(scale="route_scale", normalize="route_normalize", weights_on_input="route_on_input", logit_softcap="router_softcap",
                  logit_scale="router_scale", bias_on_logits="expert_bias_on_logits", glu_act="mlp_act", expert_out_norm_eps="post_norm_eps")
LINEAR_FIELDS = dict(n_k_heads="linear_k_heads", n_v_heads="linear_v_heads", k_head_dim="linear_k_dim", v_head_dim="linear_v_dim",
                     conv="linear_conv", norm_eps="linear_norm_eps", kind="linear_kind", full_rank="linear_full_rank",
                     decay_bound="linear_decay_bound", dt_min="linear_dt_min", neg_eigval="linear_neg_eigval", gate_norm="linear_gate_norm",
                     dt_rank="linear_dt_rank", dt_bc_norm="linear_dt_bc_norm")


@contextlib.contextmanager
def _named_as(fields: dict, body: Optional[dict] = None):
    """A ValueError ("name: ..." or "name / name: ...") raised again with the block config's
    fields named as the TransformerConfig fields they were built from: a leading key of
    fields by its value, and the keys with an underscore (identifiers, not words) in the
    rest of the message by body's value where body holds the key, else fields' ("rope_last:
    rotates the last rope_dim channels", not rot_dim)."""
    try:
        yield
    except ValueError as e:
        name, sep, rest = str(e).partition(":")
        words = {key: own for key, own in {**fields, **(body or {})}.items() if "_" in key}
        pattern = r"(?<![\w.])(" + "|".join(map(re.escape, sorted(words, key=len, reverse=True))) + r")(?!\w)"
        renamed = re.sub(pattern, lambda m: words[m.group(1)], rest) if words else rest
        names = name.split(" / ")  # "n_k_heads / v_head_dim: ..." names two fields
        if not sep or (not any(n in fields for n in names) and renamed == rest):
            raise
        raise ValueError(f"{' / '.join(fields.get(n, n) for n in names)}:{renamed}") from None


def recompute(fn, *args):
    """fn(*args) with its activations recomputed in the backward instead of kept
    (torch.utils.checkpoint, non-reentrant) while autograd records; a plain call otherwise.
    Only the region's inputs stay alive; outputs that do not require grad (the MoE counts)
    come from the first forward, so nothing is counted twice."""
    if torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def init_value(seed: int, name: str, shape, std: float) -> torch.Tensor:
    """The full float32 initial value Normal(0, std) of shape `shape` of the parameter
    called `name` (its name in the model, e.g. "blocks.1.mlp.experts.w_gate"), on the CPU:
    a function of (seed, name) only, drawn from a generator of its own (seeded by a hash of
    both), so it does not depend on the mesh, the device or the order of initialisation."""
    return torch.empty(tuple(shape), dtype=torch.float32).normal_(0.0, std, generator=name_generator(seed, name))


def name_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator of its own for the tensor called `name`, seeded by a hash of (seed, name)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def _mixer_start(kind: str, leaf: str, uniform, shape) -> torch.Tensor:
    """A linear-attention mixer's dt_bias or A_log at the start, as the kind's reference
    (Transformer.reset_parameters); uniform() draws the parameter's own uniforms in (0, 1)."""
    if leaf == "A_log":
        if kind == "mamba1":  # [C, N]: A = 1 .. N in every channel (S4D-real)
            return torch.arange(1, shape[1] + 1, dtype=torch.float32).log().expand(shape)
        low = 0.0 if kind == "gated_deltanet" else 1.0
        return torch.log(low + (16.0 - low) * uniform())
    if kind == "kda":
        return torch.zeros(shape)
    # softplus(dt_bias) = dt log-uniform in [0.001, 0.1], at least 1e-4: softplus's inverse dt + log(1 - exp(-dt))
    dt = (math.log(1e-3) + math.log(100.0) * uniform()).exp().clamp(min=1e-4)
    return dt + torch.log(-torch.expm1(-dt))


def local_block(param: torch.Tensor) -> tuple[slice, ...]:
    """This rank's block of param's full value, as slices: all of it for a plain tensor, a
    DTensor's own shard found from its layout (as DCP does: no communication)."""
    from torch.distributed.tensor import DTensor  # torch.distributed only when a DTensor may exist

    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def copy_full_value(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write the full value `full` into param: whole for a plain tensor, this rank's block of
    it (local_block) for a DTensor, with no copy of the full tensor."""
    from torch.distributed.tensor import DTensor

    local = param.to_local() if isinstance(param, DTensor) else param
    block = local_block(param)
    if tuple(s.stop - s.start for s in block) != tuple(local.shape):
        raise ValueError(f"param: a DTensor whose local shape {tuple(local.shape)} is not its layout's block {block}")
    local.copy_(full[block])


# torch's norms, which a model of one's own may hold: init_parameters starts them as torch does (gain 1, bias 0)
TORCH_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
               nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


@torch.no_grad()
def init_parameters(module: nn.Module, cfg: Optional["TransformerConfig"], seed: Optional[int] = None, prefix: str = "",
                    recurse: bool = True) -> None:
    """The reference model's start (Transformer.reset_parameters, whose docstring lists it) of
    `module`'s parameters and buffers, each named as in a Transformer: prefix is the module's
    place in one ("blocks.0.attn" for an Attention; the rules read the names' ends, so "attn"
    will do). cfg: the model's (init_std, n_layers for the output projections' scale,
    zero_centered_norms); None for a module built without one: std 0.02, no depth scale.
    seed None: torch.initial_seed(). recurse=False leaves the submodules' parameters alone.
    Every building block holding matrices calls it as it is built (Attention, LinearAttention,
    DenseMLP, GatedRMSNorm, HyperConnection, MTPModule; MoE its own reset_parameters): one
    built alone starts finite and seeded, a function of (seed, name) as the model's."""
    seed = torch.initial_seed() if seed is None else check_positive_int("seed", seed, 0)  # 1.0 and True drew other weights than 1
    base = 0.02 if cfg is None else cfg.init_std
    depth = 1 if cfg is None else 2 * cfg.n_layers  # the output projections' std is base / sqrt(depth)
    mixers = {m: sub.cfg.kind for m, sub in module.named_modules(prefix=prefix) if isinstance(sub, LinearAttention)}
    # each norm's gain at the start: 1 (a zero-centred one's weight 0; cfg.norm_overrides may mix the kinds)
    zero_centered = {m + ".weight": sub.zero_centered for m, sub in module.named_modules(prefix=prefix) if isinstance(sub, RMSNorm)}
    streams = {m: sub.n for m, sub in module.named_modules(prefix=prefix) if isinstance(sub, HyperConnection)}
    tables = {m + ".hash_table": sub.cfg.n_experts for m, sub in module.named_modules(prefix=prefix) if isinstance(sub, MoE)}
    # torch's norms in a model of one's own (a subclass's nn.LayerNorm named final_ln): as torch starts them, whatever their names
    torch_norms = {m: sub for m, sub in module.named_modules(prefix=prefix) if isinstance(sub, TORCH_NORMS) and (recurse or sub is module)}
    for name, p in module.named_parameters(prefix=prefix, recurse=recurse):
        if p.is_meta:
            continue
        mixer, _, leaf = name.rpartition(".")
        if mixer in torch_norms or leaf == "bias":  # a norm's gain 1, every bias 0 (an nn.Linear's of one's own)
            _local(p).fill_(1.0 if leaf == "weight" else 0.0)
            continue
        if mixer in mixers and leaf in ("dt_bias", "A_log"):
            copy_full_value(p, _mixer_start(mixers[mixer], leaf, lambda: torch.special.ndtr(init_value(seed, name, p.shape, 1.0)), p.shape))
            continue
        kind = name.replace(".attn_beside.", ".attn.")  # a parallel hybrid's attention beside the mixer: initialised as attention is
        if name.endswith(("_hc.base", "_hc.scale", "hc_head.base", "hc_head.scale")):  # HyperConnection's biases and scales
            if name.endswith("scale"):
                _local(p).fill_(0.01)
            else:  # pre ~ 1/n: sigmoid(-log(n - 1)); the post and mixing biases 0
                n = streams[name.rpartition(".")[0]]
                copy_full_value(p, torch.cat([torch.full((n,), -math.log(n - 1)), torch.zeros(p.shape[0] - n)]))
            continue
        if name.endswith(("attn.out_norm", "attn.D", "attn.dt_norm", "attn.b_norm", "attn.c_norm", "mlp.router_norm",
                          "mlp.expert_scale")):
            _local(p).fill_(1.0)  # Gated DeltaNet's output norm (never zero-centred); Mamba's skip and dt, B, C norms; Gemma 4's router scales
            continue
        if name.endswith(("xielu_alpha_p", "xielu_alpha_n")):  # xIELU's a_p = 0.8 and a_n = beta + 0.3 at the start, Apertus's
            _local(p).fill_(math.log(math.expm1(0.8 if name.endswith("alpha_p") else 0.8 - 0.5)))
            continue
        if name.endswith(("norm.weight", "q_norm", "k_norm", "q_a_norm", "kv_a_norm", "compress_norm")):
            _local(p).fill_(0.0 if zero_centered.get(name, cfg is not None and cfg.zero_centered_norms) else 1.0)
            continue
        if name.endswith(("mlp.latent_norm", "mlp.expert_out_norm")):  # Muse Spark's MoE norms: gains 1 + weight
            _local(p).zero_()
            continue
        if kind.endswith(("attn.bq", "attn.bk", "attn.bv", "attn.bo", "attn.sinks", "attn.bg", "attn.index_k_bias", "attn.q_norm_bias", "attn.k_norm_bias",
                          "attn.compress_bias", "attn.index_compress_bias",
                          "router_bias", "mlp.out_bias", "norm.bias", "head_bias",
                          "attn.conv_q_bias", "attn.conv_k_bias", "attn.conv_v_bias")
                         + EXPERT_BIASES):
            _local(p).zero_()
            continue
        std = base / depth ** 0.5 if name.endswith(("wo", "w_down")) else base
        if name.endswith(("attn.conv_q", "attn.conv_k", "attn.conv_v")):  # K taps per channel: torch's Conv1d's spread, 1 / sqrt(3 K)
            std = (3 * p.shape[0]) ** -0.5
        copy_full_value(p, init_value(seed, name, p.shape, std))
    for name, b in module.named_buffers(prefix=prefix, recurse=recurse):
        if name.endswith("expert_bias") and not b.is_meta:
            b.zero_()
        if name.endswith("hash_table") and not b.is_meta:  # a function of (seed, name), as init_value's
            b.copy_(random_hash_table(*b.shape, tables[name], name_generator(seed, name)))
        if name.endswith("layer_scalar") and not b.is_meta:
            b.fill_(1.0)
    for sub in torch_norms.values():  # a batch norm's running statistics
        if hasattr(sub, "reset_running_stats") and not any(b.is_meta for b in sub.buffers(recurse=False)):
            sub.reset_running_stats()


class DenseMLP(nn.Module):
    """SwiGLU: (silu(x w_gate) * (x w_up)) w_down, w_gate / w_up [H, F], w_down [F, H]; with
    act "gelu_tanh" GeGLU; with act "relu2" no gate (w_gate None): relu(x w_up)^2 w_down
    (fmoe.layers.dense_mlp's act). bias: b_gate, b_up [F] (no b_gate without a gate) and
    b_down [H] added to the projections' outputs (TransformerConfig.mlp_bias). limit: the
    SwiGLU's clamp (fmoe.layers.dense_mlp's limit; TransformerConfig.shared_swiglu_limit); alpha,
    offset: its gate's sigmoid gain and up's offset (dense_mlp's; shared_swiglu_alpha / _offset)."""

    def __init__(self, hidden: int, ffn: int, impl: str, *, fp8: bool = False, act: str = "silu", xielu: tuple[float, float] = XIELU,
                 bias: bool = False, limit: Optional[float] = None, alpha: float = 1.0, offset: float = 0.0, device=None, dtype=None):
        super().__init__()
        check_positive_int("hidden", hidden), check_positive_int("ffn", ffn)
        kw = dict(device=device, dtype=dtype)
        self.impl, self.fp8, self.act, self.limit, self.alpha, self.offset = impl, fp8, act, limit, alpha, offset
        self.w_gate = None if act in PLAIN_ACTS else nn.Parameter(torch.empty(hidden, ffn, **kw))
        self.w_up = nn.Parameter(torch.empty(hidden, ffn, **kw))
        self.w_down = nn.Parameter(torch.empty(ffn, hidden, **kw))
        self.b_gate = nn.Parameter(torch.empty(ffn, **kw)) if bias and self.w_gate is not None else None
        self.b_up = nn.Parameter(torch.empty(ffn, **kw)) if bias else None
        self.b_down = nn.Parameter(torch.empty(hidden, **kw)) if bias else None
        if act == "xielu":  # its learned scalars (softplus'ed in fmoe.ops.experts.xielu) and its constants (beta, eps)
            self.xielu_alpha_p = nn.Parameter(torch.empty(1, **kw))
            self.xielu_alpha_n = nn.Parameter(torch.empty(1, **kw))
            self.xielu = xielu
        init_parameters(self, None, prefix="mlp")  # a model's reset_parameters sets its own start

    # set by fmoe.parallel.SwiGLUParallel for xIELU's scalars and b_down, held whole on each tp rank: their gradients summed over tp
    tensor_parallel = None

    def forward(self, x_TH):
        gate, tp = (None if self.w_gate is None else _local(self.w_gate)), self.tensor_parallel
        params = None
        if self.act == "xielu":
            scalars = (_local(self.xielu_alpha_p), _local(self.xielu_alpha_n))
            if tp is not None:  # this rank's FFN columns: its share of their gradients
                scalars = tuple(tp.weight(w) for w in scalars)
            params = (*scalars, *self.xielu)
        b_gate, b_up, b_down = (None if b is None else _local(b) for b in (self.b_gate, self.b_up, self.b_down))
        if b_down is not None and tp is not None:  # added once over the ranks' sum
            b_down = tp.share(b_down)
        w_up, w_down = _local(self.w_up), _local(self.w_down)
        if x_TH.is_floating_point() and torch.is_autocast_enabled(x_TH.device.type):  # torch.autocast: in its dtype, as a linear
            dtype = torch.get_autocast_dtype(x_TH.device.type)
            x_TH, gate, w_up, w_down, b_gate, b_up, b_down = (None if t is None else t.to(dtype)
                                                             for t in (x_TH, gate, w_up, w_down, b_gate, b_up, b_down))
        return dense_mlp(x_TH, gate, w_up, w_down, impl=self.impl, fp8=self.fp8, act=self.act, act_params=params,
                         b_gate=b_gate, b_up=b_up, b_down=b_down, limit=self.limit, alpha=self.alpha, offset=self.offset)


class GroupedExperts(nn.Module):
    """The routed experts' stacked SwiGLU weights: w_gate, w_up [E, H, F], w_down [E, F, H]
    (without a gate, cfg.glu_act in PLAIN_ACTS: w_gate None), with biases=True also b_gate, b_up [E, F] and b_down [E, H] (a child module of MoE with a forward of its own, so that FSDP can shard the experts
    over their own mesh and gather them when they run).

    forward(x [T, H], routes, rows=None) -> (y [T, H], counts [E]): the routed experts' weighted
    output, by fmoe.layers.local_experts, or by `dispatcher` when one is set
    (fmoe.parallel.ExpertParallel, with the weights sharded over expert-parallel ranks;
    same call signature as local_experts); rows: local_experts' (the expert output norm).
    `sequence_parallel`: a SequenceShard under tensor parallelism applied alone
    (fmoe.parallel.tensor_parallel_plan): x is this rank's token shard and the weights'
    gradients are summed over the tp ranks where they are used; None otherwise
    (fmoe.parallel.parallelize, whose FSDP2 or expert parallelism sums them over the expert
    data mesh that holds the tp ranks).
    """

    def __init__(self, n_experts: int, hidden: int, ffn: int, cfg: MoEConfig, *, biases: bool = False, device=None, dtype=None):
        super().__init__()
        check_positive_int("n_experts", n_experts), check_positive_int("hidden", hidden), check_positive_int("ffn", ffn)
        kw = dict(device=device, dtype=dtype)
        self.cfg = cfg
        self.dispatcher = None
        self.sequence_parallel = None  # a SequenceShard under tensor_parallel_plan alone (class docstring)
        self.recompute = False  # recompute the routed experts in the backward (ac="experts")
        gated = cfg.glu_act not in PLAIN_ACTS
        self.w_gate = nn.Parameter(torch.empty(n_experts, hidden, ffn, **kw)) if gated else None
        self.w_up = nn.Parameter(torch.empty(n_experts, hidden, ffn, **kw))
        self.w_down = nn.Parameter(torch.empty(n_experts, ffn, hidden, **kw))
        self.names = ["w_gate", "w_up", "w_down"] if gated else ["w_up", "w_down"]
        if biases:  # b_gate, b_up [E, F], b_down [E, H] (gpt-oss)
            self.b_gate = nn.Parameter(torch.zeros(n_experts, ffn, **kw))
            self.b_up = nn.Parameter(torch.zeros(n_experts, ffn, **kw))
            self.b_down = nn.Parameter(torch.zeros(n_experts, hidden, **kw))
            self.names += list(EXPERT_BIASES)

    def forward(self, x_TH, routes, rows=None):
        if self.recompute:
            return recompute(self._experts, x_TH, routes, rows)
        return self._experts(x_TH, routes, rows)

    def _experts(self, x_TH, routes, rows=None):
        params = {n: _local(getattr(self, n)) for n in self.names}
        if self.sequence_parallel is not None:  # a token shard's partial gradients, summed over tp
            params = {n: self.sequence_parallel.weight(w) for n, w in params.items()}
        if torch.is_autocast_enabled(x_TH.device.type):  # the weights in x's autocast dtype, as a linear's would be
            params = {n: w.to(x_TH.dtype) for n, w in params.items()}
        return (self.dispatcher or local_experts)(x_TH, routes, params, self.cfg, **({} if rows is None else dict(rows=rows)))


class KeepsFloat32(nn.Module):
    """A module whose tensors named in _FLOAT32 stay float32 when it is cast (`.to(torch.
    bfloat16)`, `.half()`): they are restored from their float32 values (on the new device),
    not from a rounded copy, and so are their gradients (a float32 router with a bf16 .grad
    accumulated its next gradients in bf16, and torch's AdamW refused it). One parametrized
    (torch.nn.utils.parametrize) keeps its originals float32."""

    _FLOAT32: tuple[str, ...] = ()

    def _float32_leaves(self):
        """(module, name) of each stored tensor of _FLOAT32: a parametrized one's originals."""
        for n in self._FLOAT32:
            if parametrize.is_parametrized(self, n):
                originals = self.parametrizations[n]
                stored = [*originals.named_parameters(recurse=False), *originals.named_buffers(recurse=False)]
                yield from ((originals, a) for a, _ in stored if a.startswith("original"))
            elif getattr(self, n, None) is not None:
                yield self, n

    def _apply(self, fn, recurse=True):
        # .data: the values themselves (the cast swaps the tensor's and its grad's data in place)
        kept = {(m, n): (t.data, None if t.grad is None else t.grad.data) for m, n in self._float32_leaves() if (t := getattr(m, n)) is not None}
        super()._apply(fn, recurse)
        for (m, name), (data, grad) in kept.items():
            t = getattr(m, name)
            if t.dtype != torch.float32:
                t.data = data.to(device=t.device)
            if t.grad is not None and t.grad.dtype != t.dtype:
                t.grad = grad.to(device=t.device)
        return self


def random_hash_table(vocab: int, k: int, n_experts: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """[vocab, k] int64: k distinct experts of 0..n_experts-1 for each token id, uniformly at
    random (the top-k of uniforms, drawn 4096 ids at a time), a function of the generator only
    (None: torch's default one)."""
    rows = [torch.rand(min(4096, vocab - v), n_experts, generator=generator).topk(k, dim=1).indices for v in range(0, vocab, 4096)]
    return torch.cat(rows) if rows else torch.zeros(0, k, dtype=torch.int64)


class MoE(KeepsFloat32):
    """Parameters of a mixture-of-experts block; forward calls fmoe.layers.moe.

    Owns: router [E, H] (float32) with an optional router_bias [E] (float32; router_bias=True),
    optional router_norm [H] and expert_scale [E] (float32, one at initialisation; Gemma 4's
    router: fmoe.layers.moe's params of those names),
    `experts` (GroupedExperts: w_gate / w_up [E, H, F], w_down [E, F, H], and with
    expert_biases=True b_gate / b_up [E, F], b_down [E, H]), optional `shared` experts (a DenseMLP of Fs) with an optional sigmoid
    gate `shared_gate` [H], and, with expert_bias=True, the aux-loss-free
    `expert_bias` [E], a persistent float32 buffer (added to the sigmoids or, with softmax
    scoring, to the probabilities to choose the experts: fmoe.ops.route). With cfg.zero_experts = Z
    the router, router_bias and expert_bias have E + Z rows (cfg.n_choices), the experts
    E: the last Z choices are zero-computation experts (fmoe.layers.moe). The router and the bias stay float32
    when the module is cast (`.to(torch.bfloat16)`, `.half()`): routing decisions and bias
    steps of 1e-3 need it.

    forward passes its children to fmoe.layers.moe as the routed and the shared experts:
    the routing, the shared-expert gate and the stats are computed there, in one place.
    fmoe.parallel shards `experts` over ranks and sets its dispatcher (ExpertParallel).
    Under tensor parallelism fmoe.parallel also sets `sequence_parallel` (a SequenceShard;
    None otherwise): x is then this rank's slice of the micro-batch's tokens, the router's
    and shared gate's gradients are summed over the tp ranks where they are used, and the
    capacity drop looks at the whole micro-batch; the stats cover this rank's tokens. Under
    context parallelism fmoe.parallel sets `capacity_drop` (a ContextCapacityDrop; None
    otherwise), the drop over every cp rank's tokens, which takes the place of the tp one.

    Args:
        hidden: H. ffn: F per routed expert. cfg: MoEConfig (n_experts, k, routing).
        shared_ffn: Fs of the shared experts (0: none; DeepSeek's n_shared experts of size F
            are one SwiGLU of Fs = n_shared * F). shared_gate: sigmoid gate on their output.
        expert_bias: own an expert_bias buffer (needed by cfg.bias_on_logits, unless hashed:
            hash_vocab; not with cfg.score "sparsemixer").
        latent: L > 0, a latent MoE (Nemotron 3 Super's): latent_in [H, L] and latent_out
            [L, H] around the routed experts, which work in L (their weights [E, L, F]); the
            router and the shared experts read x (fmoe.layers.moe's params of those names).
        latent_norm: with latent, the experts' input RMS-normed, gain 1 + latent_norm [L] (0 at
            initialisation; Muse Spark's pre_expert_norm). expert_out_norm: each expert's
            output row normed before its weight by fmoe.layers.prescaled_rms_norm of
            expert_out_norm [L or H] (0 at initialisation; Muse Spark's post_expert_norm).
        out_bias: a bias out_bias [H] added to the block's output (0 at initialisation;
            JetMoE's MoE bias).
        hash_vocab: V > 0, a hashed MoE: its tokens' experts are hash_table [V, k] (int64, a
            persistent buffer; random_hash_table at reset_parameters) at their ids, the router
            weighing them (fmoe.layers.moe's params["hash_table"]); not with expert_bias, nor
            with cfg's score "sparsemixer", pre_softmax or zero_experts.
    """

    _FLOAT32 = ("router", "router_bias", "expert_bias", "router_norm", "expert_scale")

    def __init__(
        self, hidden: int, ffn: int, cfg: MoEConfig, *, shared_ffn: int = 0, shared_gate: bool = False,
        expert_bias: bool = False, router_bias: bool = False, expert_biases: bool = False, router_norm: bool = False,
        expert_scale: bool = False, latent: int = 0, latent_norm: bool = False, expert_out_norm: bool = False, out_bias: bool = False,
        hash_vocab: int = 0, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        check_positive_int("hidden", hidden), check_positive_int("ffn", ffn), check_positive_int("shared_ffn", shared_ffn, 0)
        if shared_gate and not shared_ffn:
            raise ValueError("shared_gate: needs shared experts (shared_ffn > 0)")
        if latent_norm and not latent:
            raise ValueError("latent_norm: the norm of a latent MoE's experts' input, needs latent > 0")
        check_positive_int("latent", latent, 0)
        E, H, kw = cfg.n_experts, hidden, dict(device=device, dtype=dtype)
        self.cfg = cfg
        self.router = nn.Parameter(torch.empty(cfg.n_choices, H, device=device, dtype=torch.float32))
        self.router_bias = nn.Parameter(torch.empty(cfg.n_choices, device=device, dtype=torch.float32)) if router_bias else None
        # Gemma 4's router: the weight of its input's RMSNorm [H], and a scale per expert of the chosen weights [E] (fmoe.layers.moe)
        self.router_norm = nn.Parameter(torch.ones(H, device=device, dtype=torch.float32)) if router_norm else None
        self.expert_scale = nn.Parameter(torch.ones(cfg.n_choices, device=device, dtype=torch.float32)) if expert_scale else None
        self.experts = GroupedExperts(E, latent or H, ffn, cfg, biases=expert_biases, **kw)
        # a latent MoE: the routed experts' input x latent_in [H, L], their sum times latent_out [L, H]
        self.latent_in = nn.Parameter(torch.empty(H, latent, **kw)) if latent else None
        self.latent_out = nn.Parameter(torch.empty(latent, H, **kw)) if latent else None
        # Muse Spark's: the latent's zero-centred norm, and each expert's output row's prescaled one (fmoe.layers.moe)
        self.latent_norm = nn.Parameter(torch.zeros(latent, **kw)) if latent_norm else None
        self.expert_out_norm = nn.Parameter(torch.zeros(latent or H, **kw)) if expert_out_norm else None
        self.shared = DenseMLP(H, shared_ffn, cfg.impl, fp8=cfg.fp8, act=cfg.glu_act, limit=cfg.shared_swiglu_limit, alpha=cfg.shared_swiglu_alpha,
                               offset=cfg.shared_swiglu_offset, **kw) if shared_ffn else None
        if shared_gate:
            self.shared_gate = nn.Parameter(torch.empty(H, **kw))
        self.out_bias = nn.Parameter(torch.empty(H, **kw)) if out_bias else None
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(cfg.n_choices, device=device, dtype=torch.float32), persistent=True)
        check_positive_int("hash_vocab", hash_vocab, 0)
        if hash_vocab and expert_bias:
            raise ValueError("expert_bias: a hashed MoE's experts are its table's (hash_vocab), the bias would choose nothing; set expert_bias=False")
        if hash_vocab:
            check_hash_routing(cfg, "hash_vocab")
        if cfg.score == "sparsemixer" and expert_bias:
            raise ValueError("expert_bias: sparsemixer routing (cfg.score='sparsemixer') takes no expert bias; set expert_bias=False")
        if cfg.bias_on_logits and not expert_bias and not hash_vocab:  # a hashed MoE's table chooses: no bias, nothing to move
            raise ValueError("cfg.bias_on_logits: applies to score='sigmoid' with an expert_bias only, expected expert_bias=True, got False")
        if hash_vocab:  # hash routing: token id v's k experts (reset_parameters draws them)
            self.register_buffer("hash_table", torch.zeros(hash_vocab, cfg.k, device=device, dtype=torch.int64), persistent=True)
        self.sequence_parallel = None  # fmoe.parallel's SequenceShard under tp > 1 (class docstring)
        self.capacity_drop = None  # fmoe.parallel's ContextCapacityDrop under cp > 1 (class docstring)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Every weight Normal(0, std), the biases (router, experts) and the expert bias 0. A
        model stacking blocks may scale the output projections by depth (the reference model
        does)."""
        for name, p in self.named_parameters():
            if name.endswith(("router_bias", "out_bias") + EXPERT_BIASES):
                nn.init.zeros_(p)
            elif name in ("router_norm", "expert_scale"):
                nn.init.ones_(p)
            elif name in ("latent_norm", "expert_out_norm"):  # gains 1 + weight
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, std=std)
        if "expert_bias" in self._buffers:
            self.expert_bias.zero_()
        if "hash_table" in self._buffers and not self.hash_table.is_meta:
            self.hash_table.copy_(random_hash_table(*self.hash_table.shape, self.cfg.n_experts))

    def forward(self, x: torch.Tensor, token_mask: Optional[torch.Tensor] = None, route_x: Optional[torch.Tensor] = None,
                token_ids: Optional[torch.Tensor] = None):
        """x [..., H] -> (y [..., H], stats TensorDict of fmoe.layers.moe). token_mask: None,
        or [T] bool over the micro-batch's tokens (x's under sequence parallelism: this rank
        routes its slice of it), False on padding, which is not routed (fmoe.layers.moe).
        route_x: the router's input where it is not x (fmoe.layers.moe's), x's shape.
        token_ids: [T] int, the micro-batch's token ids (sliced as token_mask under sequence
        parallelism): a hashed MoE (hash_vocab) routes by them (fmoe.layers.moe's token_ids),
        and needs them; another ignores them."""
        x_TH = x.reshape(-1, x.shape[-1])
        if x_TH.is_floating_point() and torch.is_autocast_enabled(x_TH.device.type):  # torch.autocast: the experts compute in its
            x_TH = x_TH.to(torch.get_autocast_dtype(x_TH.device.type))  # dtype, as a linear would; the router stays float32
        # under tensor parallelism x is this rank's token shard: the router's and the gate's
        # gradients are summed over tp where they are used; the capacity drop sees every token
        sp = self.sequence_parallel
        if sp is not None and self.shared is not None:
            from torch.distributed.tensor import DTensor, Shard  # torch.distributed only under tensor parallelism

            # split by its FFN columns (SwiGLUParallel's Shard(1) of w_up [H, F]; FSDP2 shards dim 0, over other mesh dims):
            # a plan of one's own left it whole
            w_up = self.shared.w_up
            if not (isinstance(w_up, DTensor) and any(isinstance(p, Shard) and p.dim == 1 for p in w_up.placements)):
                raise ValueError("MoE: under sequence parallelism (its sequence_parallel set) its shared experts would run on the rank's "
                                 "token shard with whole weights, each rank's gradients a share of theirs, without a word: split them "
                                 "over tp with fmoe.parallel.SwiGLUParallel (as tensor_parallel_plan does)")
        replicated = (lambda w: w) if sp is None else sp.weight
        params = {"router": replicated(_local(self.router))}
        for name in ("router_bias", "router_norm", "expert_scale"):
            if getattr(self, name) is not None:
                params[name] = replicated(_local(getattr(self, name)))
        if "expert_bias" in self._buffers:
            params["expert_bias"] = self.expert_bias
        if "hash_table" in self._buffers:
            params["hash_table"] = self.hash_table
            if token_ids is None:
                raise ValueError("token_ids: a hashed MoE routes by its tokens' ids, expected [T] int ids, got None")
            if sp is not None:
                token_ids = sp.local_rows(token_ids, x_TH.shape[0])
        else:
            token_ids = None
        for name in ("shared_gate", "latent_in", "latent_out", "latent_norm", "expert_out_norm", "out_bias"):
            if getattr(self, name, None) is not None:
                params[name] = replicated(_local(getattr(self, name)))
        for name in ("latent_in", "latent_out"):  # projections of x, in x's dtype: under FSDP2's mixed precision this
            if name in params:  # module's own unit is not cast (the router's float32), so its float32 weights compute in bf16 here
                params[name] = params[name].to(x_TH.dtype)
        drop = self.capacity_drop  # cp: over every cp rank's tokens (and tp slices)
        if drop is None and sp is not None:
            drop = sp.drop_by_capacity
        if token_mask is not None and sp is not None:
            token_mask = sp.local_rows(token_mask, x_TH.shape[0])
        y_TH, stats = moe(x_TH, params, self.cfg, experts=self.experts, shared=self.shared, drop=drop, token_mask=token_mask,
                          route_x=None if route_x is None else route_x.reshape(-1, route_x.shape[-1]), token_ids=token_ids)
        return (y_TH if x.ndim == 2 else y_TH.reshape(x.shape)), stats  # no view: FSDP hooks the output


# ----------------------------------------------------------------------------------------
# the reference transformer
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Every knob of the reference model (defaults: a small CPU-sized MoE).

    Layers: n_layers blocks, the first n_dense with a dense SwiGLU of ffn_dense, the rest
    MoE blocks (or exactly the blocks listed in moe_layers, e.g. Qwen's decoder_sparse_step
    / mlp_only_layers) of n_experts experts of ffn_expert, k per token, n_shared shared
    experts (one SwiGLU of shared_ffn, default n_shared * ffn_expert) with an optional
    sigmoid shared_gate, their output times shared_scale (Cohere 2 MoE's "average": 0.5
    beside route_scale 0.5). mlp_free_layers: blocks of their mixer alone, without an MLP or
    its norm (Nemotron-H's mixer layers with no MLP layer after them; not MoE blocks, not
    with parallel_blocks, shortcut_moe or layer_scalars); mixer_free_layers: blocks of their
    MLP alone, without attention or its norm (Nemotron-H's MLP layers with no mixer layer
    before them; not with parallel_blocks, shortcut_moe, normed_residual or DeepSeek sparse
    attention). moe_latent L: a latent MoE (Nemotron 3 Super's), the routed experts (of L in,
    L out) between x latent_in [H, L] and latent_out [L, H], the router and the shared
    experts on x (fmoe.model.MoE's latent); moe_latent_norm: the experts' input x latent_in
    RMS-normed, gain 1 + latent_norm [L] (Muse Spark's pre_expert_norm, eps norm_eps);
    expert_out_norm: each routed expert's output row normed before its weight, y (1 + w) /
    rms(y (1 + w)) of expert_out_norm [L or H] (Muse Spark's post_expert_norm, eps post_norm_eps
    or norm_eps; fmoe.layers.moe's params of those names). residual_gates: each block's two
    residual adds weighed channel by channel, x' = alpha x + beta y with beta = sigmoid(g / T),
    alpha = sqrt(max(sigmoid(-g / T) (1 + beta), 1e-3)) of the add's gate g [H] (float32) and T =
    residual_gate_temperature (Muse Spark's; fmoe.model.ResidualGate; not with
    hyper_connections, shortcut_moe, parallel_blocks, depth_scaled_residual, normed_residual
    or residual_scale). Routing: score ("softmax", "sigmoid", "sqrtsoftplus": DeepSeek-V4's sqrt(softplus(logits)),
    fmoe.ops.route's, or "sparsemixer": Phi-3.5-MoE's
    top-2 with its gap sparsemixer_eps, k = 2, without expert_bias; fmoe.ops.sparsemixer_route), pre_softmax (softmax over all experts, then top-k,
    weights not renormalised), n_groups/topk_groups with group_score_topk (a group's score
    sums its best group_score_topk scores; None: k // topk_groups), route_scale,
    route_normalize (sigmoid, sqrtsoftplus: renormalise the k weights; False keeps the raw scores),
    expert_bias (aux-loss-free balancing: a bias on the sigmoids, or softmax's probabilities, for the choice only;
    with expert_bias_on_logits on the sigmoid scoring's logits instead: Kolibri-1's), capacity_factor with
    capacity_policy ("probs" | "position"), zero_experts (Z zero-computation experts beside
    the n_experts computing ones: the router chooses among n_experts + Z, and a slot routed
    to a zero expert passes its token through times its weight, with no FLOPs: LongCat-Flash's
    identity experts; fmoe.layers.MoEConfig.zero_experts), route_on_input (the weights scale each expert's
    input, not its output: Llama 4; fmoe.layers.MoEConfig.weights_on_input). hash_layers n: the
    first n MoE blocks of the trunk route by hashing (DeepSeek-V4's hash_moe layers): each token
    goes to the k experts a fixed table hash_table [vocab_size, k] (int64, a persistent buffer
    of MoE, k distinct random experts per token id at reset_parameters) names for its token id,
    the router weighing them (fmoe.ops.hash_route); those blocks own no expert_bias (nothing to
    balance) and train their router through the weights alone; the MTP blocks route as the rest;
    not with sparsemixer, pre_softmax or zero_experts. shortcut_moe:
    LongCat-Flash's shortcut-connected MoE: the blocks go in pairs (2j, 2j + 1); a pair whose
    first block is a MoE block (is_moe(2j); the second never is) gives that block a dense
    SwiGLU of ffn_dense beside the MoE, both of its MLP input, and adds the MoE's output (its
    shared experts' too) after the second block's MLP: x + attn, then + dense; x + attn,
    then + mlp + the MoE's output (so the MoE overlaps the next attention). Between the two
    blocks the stream is [T, 2H], the residual and the MoE's output side by side (Block).
    n_layers even; not with parallel_blocks, post_norms, moe_out_norm or residual_scale;
    the MTP blocks are ordinary blocks; a pipeline stage holds whole pairs. Attention:
    n_heads/n_kv_heads of head_dim, qkv_bias, qk_norm (None | "head" | "proj" | "rms" | "head_layer" | "layer" | "head_k",
    fmoe.layers.AttentionConfig; qk_norm_bias: the q/k LayerNorms' biases, Chameleon's and
    Persimmon's; qk_norm_after_rope: the per-head norms after RoPE, Hunyuan,
    Llama 4; nope_qk_norm=False: none in the NoPE blocks, Llama 4), rope_base, rope_dim (rotated
    channels per head, None: all; rope_last: each head's last rope_dim channels, DeepSeek-V4's),
    rope_interleaved, rope_reversed (each pair turned the other
    way, sin negated: NanoChat's rotate_half (x2, -x1)), yarn_factor (None: plain RoPE) with
    yarn_original_max_positions, yarn_beta_fast / yarn_beta_slow / yarn_mscale /
    yarn_mscale_all_dim / yarn_truncate; llama3_factor (None: none; not with YaRN) with
    llama3_low_freq_factor / llama3_high_freq_factor / llama3_original_max_positions:
    Llama 3.1's RoPE scaling (fmoe.ops.rope.llama3_inv_freq); longrope_short_factors (None:
    none; not with YaRN or Llama 3.1's scaling) with longrope_long_factors /
    longrope_original_max_positions / longrope_short_scale / longrope_long_scale: LongRoPE,
    Phi-3's (fmoe.layers.AttentionConfig; the short factors and scale in a document of at
    most longrope_original_max_positions positions, the long ones in a longer one);
    rope_linear_factor (None: none; not with the other scalings): linear position
    interpolation, every RoPE frequency divided by it (Gemma 3's "linear" rope type; beside
    local_rope_base, in the global blocks only). o_bias:
    an attention output bias; attn_sinks: a learned sink logit per head (sink_layers: in
    those trunk blocks only, the MTP blocks without; None: every block; MiMo-V2-Flash's
    sliding-window blocks); attn_gate: gated
    attention, the heads' outputs times sigmoid(x wg) channel by channel before wo (AFMoE;
    fmoe.layers.attention); attn_gate_act "softplus" instead of "sigmoid", and
    attn_gate_per_head: one gate per head (wg [H, n_heads]; Laguna's g_proj:
    fmoe.layers.AttentionConfig.gate_act, gate_per_head); attn_gate_bias: a bias per head
    bg [n_heads] added to its gate's pre-activations (Beam's gate_bias). router_softcap: the router's
    logits capped at c tanh(l / c) before routing (Laguna; fmoe.layers.MoEConfig.logit_softcap).
    router_scale: the router's logits times this constant before the routing (Muse Spark's
    output_multiplier; fmoe.layers.MoEConfig.logit_scale). router_bias: a float32 bias on the router logits; expert_biases: biases of the routed
    experts' three projections; swiglu_alpha / swiglu_limit / swiglu_offset: the routed
    experts' clamped SwiGLU (fmoe.ops.grouped_mlp; gpt-oss: 1.702, 7.0, 1.0);
    shared_swiglu_limit: the shared experts' and dense MLPs' clamp (their gate at most it, up
    within +-it; Step 3.7's swiglu_limits_shared); swiglu_limit_layers /
    shared_swiglu_limit_layers: the trunk blocks whose routed experts / shared experts and
    dense MLPs those limits clamp (None: every block, the MTP blocks too; listed: those
    alone, Step 3.7's last layers); shared_swiglu_alpha / shared_swiglu_offset: the shared
    experts' and dense MLPs' gate sigmoid gain and up offset, g sigmoid(alpha g) (u + offset)
    (MiniMax-M3's 1.702, 1.0; fmoe.layers.dense_mlp). mlp_act: every
    MLP's gate activation (dense blocks, shared and routed experts), "silu" (SwiGLU) or
    "gelu_tanh" (GeGLU: GELU's tanh form, Gemma's; fmoe.ops.swiglu's act) or "silu_cap"
    (SwiGLU whose limits cap silu(gate) rather than gate: Step 3.7's), or "relu2": MLPs
    without a gate, relu(x w_up)^2 w_down (Arcee's and Nemotron-H's, Nemotron 3's routed and
    shared experts; not with expert_biases), or "xielu": dense MLPs without a gate, xIELU(x
    w_up) w_down with its two learned scalars per MLP (Apertus's; fmoe.ops.experts.xielu), or
    "gelu_new" / "gelu": MLPs without a gate, gelu_tanh(x w_up) w_down (GELU's tanh form; Phi-2's)
    / gelu(x w_up) w_down (GELU's exact form; GPT-NeoX's and Pythia's), or "relu": relu(x
    w_up) w_down (OPT's).
    mlp_bias: biases on the dense blocks' MLP projections (DenseMLP's b_gate, b_up [F], b_down
    [H]; Llama's mlp_bias, Jais 2's), trunk and MTP blocks alike; not on the MoE blocks'
    shared experts, nor with shortcut_moe or dense_beside_moe. Gemma 4's MoE
    blocks: dense_beside_moe, a dense MLP of ffn_dense beside the MoE, each with its own pre-
    and post-norm (mlp_norm / dense_post_norm, moe_norm / moe_post_norm), their sum through
    mlp_post_norm before the residual add (needs pre_norms and post_norms); router_norm, the
    router reads its block's input through an RMSNorm of weight router_norm [H] times 1 /
    sqrt(H); router_expert_scale, each chosen weight times its expert's expert_scale [E]
    (fmoe.layers.moe's params). layer_scalars: each trunk block's output, the whole
    residual, times its buffer layer_scalar [1] (Gemma 4's, read from its checkpoints; 1
    at initialisation, not trained). kv_rank (with q_rank,
    v_head_dim): multi-latent attention (DeepSeek-V2/V3; head_dim = nope + rope dims,
    rope_dim the rope part, n_kv_heads = n_heads; fmoe.layers.AttentionConfig); mla_scales
    (with q_rank and kv_rank): its queries times sqrt(hidden / q_rank) and its normed kv
    latent times sqrt(hidden / kv_rank) (LongCat-Flash's; AttentionConfig.latent_scales);
    mla_norm_eps: the q and kv latents' RMSNorms' eps (grouped-query attention's q latent's too) (None: 1e-6, DeepSeek's; HY-V4-VL's
    rms_norm_eps). q_rank without kv_rank: grouped-query attention's queries from a normed q_rank
    latent (DeepSeek-V4's; AttentionConfig.q_rank). q_latent_raw (with q_rank and kv_rank): wq_b reads the q latent normed and as it is, [2 q_rank, N D],
    and attn_gate_on_q: the output gate reads that input instead of x (A.X-K2's;
    AttentionConfig.q_latent_raw, gate_on_q). norm_gate_rank r (None: off): the attention's
    pre-norm of every block and the MLP's of MoE blocks are GatedRMSNorms, y = rmsnorm(x)
    times sigmoid(silu(y gate_down) gate_up) over rank r (A.X-K2's). Without
    kv_rank, v_head_dim is grouped-query attention's value head dim where it is not head_dim
    (MiMo-V2-Flash; None: head_dim), and value_scale multiplies its values (MiMo-V2-Flash's
    attention_value_scale). clip_qkv: grouped-query attention's q, k and v clamped to
    [-clip_qkv, clip_qkv] after their projections (DBRX; fmoe.layers.AttentionConfig.clip_qkv;
    not beside linear-attention blocks, which would not clamp). local_kv_heads: the kv heads
    of the window's or chunk's blocks where they differ from n_kv_heads (MiMo-V2-Flash's
    sliding blocks: twice as many; None: n_kv_heads). local_heads: the query heads of the
    window's or chunk's blocks where they differ from n_heads (Laguna's
    num_attention_heads_per_layer; None: n_heads). local_head_dim: the head dim of the
    window's or chunk's blocks where it differs from head_dim (Gemma 4's sliding blocks,
    256 beside its global ones' 512; grouped-query attention; needs local_rope_base: those
    blocks' own RoPE tables, over local_rope_dim or all their channels). v_norm: the values
    RMS-normed per head without weights; global_k_eq_v: the blocks without a window or chunk
    have no wv, their values the keys' projection (Gemma 4's attention_k_eq_v); rope_proportion:
    proportional RoPE in the blocks without a window or chunk, only the first share of the
    frequency pairs turning (Gemma 4's "proportional" rope type; fmoe.layers.AttentionConfig).
    attn_softcap: every attention score capped at c tanh(s / c) before the softmax (Gemma 2's
    attn_logit_softcapping; fmoe.layers.AttentionConfig.score_softcap). attn_out_norm: each head's
    attention output RMS-normed over its channels without weights, before the output gate and
    wo (Muse Spark's o_norm; grouped-query attention; fmoe.layers.AttentionConfig.out_norm).
    index_topk
    (with q_rank and kv_rank): DeepSeek sparse attention in every block (DeepSeek-V3.2,
    GLM-5), each query attending to the index_topk keys a lightning indexer of index_heads
    heads of index_head_dim scores highest (its RoPE on interleaved pairs with
    index_rope_interleaved, on its last channels with index_rope_last; its key's LayerNorm eps
    index_norm_eps; fmoe.layers.AttentionConfig; under context parallel the indexer's
    keys gathered like K and V), the indexer trained by its own loss with weight
    index_loss_coeff per micro-batch (0: not trained: fmoe.layers.index_loss, Attention);
    index_shared_layers: the trunk blocks without an indexer, which attend to the keys the
    nearest earlier block with one chose (GLM-5's "shared" layers; not block 0).
    index_topk_blocks (grouped-query attention): block-sparse attention (MiniMax-M3's), each
    query's heads of kv head g attending to the keys of the index_topk_blocks blocks of
    index_block_size positions that indexer head g scores highest, the index_local_blocks
    blocks ending at its own always among them (index_heads: the kv heads' count, one indexer
    head each; index_head_dim; fmoe.layers.AttentionConfig); in the blocks index_block_layers
    lists (None: every block), the others attending over every earlier token; the indexers
    trained by their own loss with weight index_loss_coeff (fmoe.layers.block_index_loss; 0:
    frozen, requires_grad False); not with a sliding window, chunks or ALiBi. moa_experts:
    a mixture of attention heads in every attention block (JetMoE's MoA;
    fmoe.layers.AttentionConfig): moa_experts attention experts, each with its own query
    projection wq[e] [H, n_kv_heads head_dim] and output projection wo[e], moa_topk of them
    per token (n_heads = moa_topk n_kv_heads), the kv heads shared; its router moa_router
    [H, moa_experts] float32, balanced by its switch loss with weight moa_aux_coeff per
    micro-batch (Attention; the loop averages it over the attention blocks and logs
    moa_aux_loss; under context parallel each rank's share, over every rank's counts; under
    tensor parallelism each expert's projections split by their kv heads); not with
    multi-latent attention, the
    indexers, qkv_bias, attn_gate or per-block head counts. o_groups g, o_rank r: every attention
    block's grouped output projection (DeepSeek-V4's o_groups, o_lora_rank; fmoe.layers.
    AttentionConfig): the heads' outputs in g groups of contiguous heads, each projected to r
    channels by its wo_a[i], then the g r channels to H by wo [g r, H]; either attention kind,
    not with moa_experts or fp8. kv_shared: every attention block's values are its keys after
    their norm and RoPE, no wv, and each head's output rotated back at its query's position
    (DeepSeek-V4's shared key-value heads; fmoe.layers.AttentionConfig); grouped-query attention
    only. compress_layers: the blocks of heavily compressed attention (DeepSeek-V4's HCA;
    AttentionConfig.compress_rate = compress_rate m, 128): besides their keys (their window
    where they have one), their queries attend to one compressed entry per complete run of m
    tokens of the document, their compressor's (compress_wkv, compress_wg, compress_bias
    float32, compress_norm); they keep the global RoPE tables where the window's layers have
    their own (local_rope_base: DeepSeek-V4's main and compress RoPE); with kv_shared and one
    kv head; the model's contexts then hold dense masks (the reference attends); in decoding
    the cache keeps each sequence's entries and open run (KVCache); under context parallel
    each rank makes the entries of the whole micro-batch from every rank's gathered compressor
    inputs. csa_layers: the blocks of compressed sparse attention (DeepSeek-V4's CSA;
    AttentionConfig.compress_rate = csa_rate, 4, compress_topk = csa_topk, 512): overlapping
    entries of runs of csa_rate tokens, each query attending to the csa_topk of them its
    lightning indexer (index_heads of index_head_dim, rotated as the keys are) scores highest;
    their compressor's compress_wkv, compress_wg [H, 2 D], compress_bias, compress_norm and the
    indexer's index_wq, index_w, index_compress_*, trained by its own loss with weight
    index_loss_coeff, as DeepSeek sparse attention's (fmoe.layers.index_loss over the chosen
    entries; 0: frozen, requires_grad False); with kv_shared, one kv head and q_rank; not with compress_layers' blocks,
    index_topk or index_topk_blocks; dense masks as above; in decoding the cache keeps each
    sequence's entries beside its indexer's and its last complete and open runs (KVCache); under
    context parallel as above (both compressors' inputs gathered). moe_out_bias: a bias [H] added to
    each MoE block's output (JetMoE's MoE bias; MoE.out_bias). tie_embeddings: the
    output head is the embedding; out_vocab V' (None: vocab_size): the output head has V' <=
    vocab_size rows, the logits are those of token ids 0 .. V' - 1 while the embedding keeps
    every id (Apertus 1.5's output_vocab_size: its multimodal ids are inputs, never outputs);
    every label must be below V' (the training forward asserts it on the device, reading nothing
    on the host); not with tie_embeddings; head_bias: the head adds a bias [V] to the logits (Phi-3.5-MoE's
    lm_head; fmoe.ops.linear_cross_entropy's bias). Granite's multipliers (each 1 / None: none): attn_scale,
    the softmax scale (None: 1/sqrt(head_dim), or YaRN's); embed_scale multiplies every
    embedding lookup (the trunk's and the MTP modules'); round_embed_scale: embed_scale rounded
    to the embeddings' dtype before it multiplies (Gemma's: sqrt(1152) = 33.94 multiplies bf16
    embeddings as 34.0; float32 ones as itself); residual_scale multiplies each
    attention and MLP output before its residual add; depth_scaled_residual: the n-th
    residual add (the embedding the first, block i's attention the 2i + 2-th, its MLP the
    2i + 3-th) is x sqrt((n - 1) / n) + y / sqrt(n) (Beam's); normed_residual a (None: off):
    each sublayer's residual is its normed input, x <- a norm(x) + f(norm(x)) x residual_scale
    (MiniMax's blocks; DeepNorm's a); the logits are divided by
    logit_divisor (the normed hidden states are, before the head); logit_softcap c (None:
    off): the logits capped at c tanh(l / c), in the loss (fmoe.ops.linear_cross_entropy's
    softcap), in logits and in decode (Gemma 2's and Beam's final_logit_softcapping). window: sliding-window
    attention (a query attends to the `window` newest tokens of its document, itself
    included) in the trunk blocks listed in window_layers (None: every trunk block); the
    other blocks and the MTP blocks attend to every earlier token. chunk: chunked attention
    (a query attends to the earlier tokens of its chunk of `chunk` tokens of its document,
    Llama 4) in the trunk blocks listed in chunk_layers (None: every trunk block); not with
    a window. nope_layers: the trunk
    blocks whose attention has no RoPE (NoPE: q and k unrotated, EXAONE 4's global layers;
    grouped-query attention only); the MTP blocks always rotate. nope_temperature_floor
    (None: off) and nope_temperature_scale: the NoPE blocks' queries scaled by 1 + scale *
    log(1 + floor((p + 1) / floor)) at position p (Llama 4's attention temperature tuning);
    nope_temperature_kind "power": by (1 + (p + 1) / floor) ** scale instead (Beam's
    scalable softmax: floor 2048, scale 0.1; fmoe.layers.AttentionConfig.temperature_kind).
    query_temperature_floor (None: off) and query_temperature_scale: every block's queries
    scaled by 1 + scale * log(1 + floor(p / floor)) at position p, after RoPE (Mistral 4's and
    Ministral 3's llama_4_scaling_beta over original_max_position_embeddings; either kind of
    attention; not with nope_temperature_floor).
    local_rope_base: the RoPE base of the window's or chunk's blocks (plain RoPE at this base
    there, rope_base and its scaling in the others: Mellum, OLMo 3; None: rope_base everywhere;
    fmoe.layers.AttentionConfig.local_rope_base); local_rope_dim: with local_rope_base, the
    channels those blocks rotate where they are not rope_dim's (Laguna: every channel in the
    sliding blocks beside half in the full ones; None: rope_dim). pre_norms: an RMSNorm on
    each block's attention and MLP input (the usual pre-norm block); post_norms: one on each
    branch's output before its residual add (OLMo 2 / FlexOlmo without pre_norms; both:
    Gemma's sandwich); moe_out_norm: one on each MoE block's output (routed plus shared
    experts) before its residual add, the dense blocks' and the attention's without
    (A.X-K1's post_mlp_layernorm; not with post_norms). parallel_blocks: each block adds its
    attention and its MLP of the same normed input, x + attn(n(x)) + mlp(n(x)), one pre-norm
    (attn_norm) and no mlp_norm (Cohere's; needs pre_norms, not with post_norms or
    moe_out_norm); with parallel_norms the MLP reads its own pre-norm, x + attn(n1(x)) +
    mlp(n2(x)) (mlp_norm; GPT-NeoX's and Pythia's parallel residual). layer_norms: every block norm, the final norm and the MTP modules' are
    LayerNorms without bias, the mean taken out before the scale (Cohere's; the q/k norms stay
    RMSNorms); norm_bias: with a bias each (Phi-3.5-MoE's; needs layer_norms).
    norm_weights=False: those norms (and embed_norm) have no weights, x / rms(x) alone
    (NanoChat's; not with zero_centered_norms, norm_bias or norm_gate_rank). embed_norm: the
    embeddings pass through such a norm (embed_norm) before the first block (NanoChat's).
    abs_positions: P, learned absolute position embeddings pos_embed [P, H] added to the
    trunk's token embeddings at each token's position in its document (GPT-Neo's, OPT's,
    GPT-2's wpe); no block then rotates (every block NoPE, is_nope); positions must stay
    below P (a ValueError in logits and decode, an assert on the device in the training
    forward, which reads nothing on the host); not with MTP modules (which rotate).
    abs_position_offset: rows of pos_embed before position 0's ([P + offset, H], position p
    its row p + offset: OPT's 2).
    alibi: ALiBi, attention with linear biases in place of RoPE (BLOOM's, MPT's, Falcon-RW's):
    every block NoPE (is_nope), head h's score of a key d tokens back in its document gets
    -m_h d added (m_h fmoe.layers.alibi_slopes(n_heads), constants the blocks compute, not
    weights; under tensor parallel each rank its heads' slopes); grouped-query attention
    only, not with abs_positions, nope_layers, MTP modules (which rotate) or compressed
    entries (compress_layers, csa_layers: no distance to them). alibi_scaled:
    the bias times the softmax scale as well, added before the scaling (Falcon's).
    zero_centered_norms: every RMSNorm's gain is 1 + its weight, the weight 0 at initialisation
    (Qwen3-Next's zero-centred norms: weight decay pulls the gain to 1;
    the blocks', the final, the MTP modules' and the q/k norms; not the linear-attention
    layers' gated output norm). post_norm_eps: the post-norms' eps (attn_post_norm, mlp_post_norm; None:
    norm_eps; Muse's 1e-8 beside its 1e-5). norm_overrides: "role:kind" entries, a norm's own
    kind where the knobs above would make it otherwise (Muse Glimmer's and Muse Spark's mixes),
    role "embed" (embed_norm), "attn_post", "mlp_post" (the post-norms) or "final"; kind "unit"
    (no weight, x / rms(x)), "plain" (gain = weight), "zero_centered" (gain = 1 + weight) or
    "prescaled" (the gain first, then the norm: (x (1 + w)) / rms(x (1 + w)), Muse Spark's
    input-scaled norm; weight 0 at initialisation); RMSNorms only (not with layer_norms,
    norm_bias or norm_weights=False). linear_layers: the trunk blocks whose mixer is Gated DeltaNet
    linear attention instead of softmax attention (Qwen3-Next, Qwen3.5: three in four;
    fmoe.layers.linear_attention) with linear_k_heads query/key heads of linear_k_dim,
    linear_v_heads value heads of linear_v_dim and a causal convolution of linear_conv taps;
    linear_kind "kda": Kimi Delta Attention instead (Kimi Linear: a decay per key channel, a
    low-rank output gate; as many key as value heads; linear_full_rank: its decay's and gate's
    projections whole, linear_decay_bound b < 0: the bounded decay b sigmoid(...), Ling's
    hybrid models': fmoe.layers.LinearAttentionConfig's full_rank, decay_bound); linear_kind "short_conv": LFM2's gated
    short convolution of linear_conv taps over linear_v_heads x linear_v_dim channels (the
    key fields the same; LFM2's: hidden heads of one channel); linear_kind "lightning": MiniMax's
    lightning attention, linear_v_heads heads of linear_v_dim (the key fields the same), no
    convolution, a constant decay per head by the block's depth (fmoe.layers.lightning_decay),
    its output norm over every head's channels with eps 1e-6 (MiniMax's); linear_kind "mamba2":
    Mamba-2's mixer (Granite 4.0-H's), its C and B as linear_k_heads groups of linear_k_dim (the
    state) read by linear_v_heads heads of x of linear_v_dim, the convolution of linear_conv
    taps with biases, a skip D, the output gated then RMS-normed per group (linear_dt_min: the
    floor of its dt, Nemotron-H's time_step_min; 0 none); linear_neg_eigval: the Gated
    DeltaNet or KDA write strength beta = 2 sigmoid(x wb) in [0, 2] (OLMo Hybrid's
    allow_neg_eigval: the state's transition I - beta k k^T may have the eigenvalue -1);
    linear_norm_eps: the linear-attention blocks' gated output norm's eps (None: norm_eps);
    linear_pre_norms: the linear-attention blocks are pre-norm blocks (a norm before each
    branch, none after) whatever pre_norms and post_norms make of the others (OLMo Hybrid's
    Gated DeltaNet blocks beside its post-norm attention blocks; TransformerConfig.block_norms);
    linear_gate_norm: where Mamba-2's output norm sits, "after" its gate (the default),
    "before" it or "none" (fmoe.layers.LinearAttentionConfig.gate_norm; Falcon-H1's
    mamba_norm_before_gate, mamba_rms_norm); linear_kind "mamba1": Mamba-1's mixer (Mamba's,
    Falcon Mamba's, Jamba's selective scan), linear_v_heads channels of x (linear_v_dim 1),
    each with a state of linear_k_dim and a decay per state channel, one B and C
    (linear_k_heads 1), dt through rank linear_dt_rank (None: ceil(hidden / 16), Mamba's
    "auto"), linear_dt_bc_norm "rms" / "rms_unit": RMS norms on dt, B and C with weights
    (Jamba's) or without (Falcon Mamba's), eps linear_norm_eps (None: norm_eps); tensor
    parallelism splits its channels; parallel_hybrid: every linear_layers block
    holds softmax attention (Block.attn_beside) beside its linear mixer, both reading the
    block's normed input, their outputs summed (Falcon-H1's parallel hybrid: Mamba-2 and
    attention in each layer; not with DeepSeek sparse attention);
    the attention knobs (window, chunk,
    NoPE, q/k norms, gate) are the other blocks'. The MTP blocks always attend. mtp_depth MTP modules; mtp_norm: each with its own output
    norm before the shared head (DeepSeek-V3, GLM-4.5, Megatron Core) instead of the
    trunk's final norm. impl: "auto" | "triton" | "torch"
    for every op. ac: activation checkpointing, one of AC_MODES ("none" | "full" |
    "attention" | "experts"; trunk and MTP blocks alike; gradients equal those without).
    fp8: the forward and input-gradient GEMMs of the attention projections, the dense MLPs
    and the routed and shared experts in fp8 (e4m3, row-wise power-of-two scales; the weight
    gradients in the compute dtype: fmoe.ops.fp8_matmul), trunk and MTP blocks alike, and
    the linear-attention blocks' projections; the embedding, router, head and MTP projections
    stay in the compute dtype. The weights and the optimizer are unchanged: only the GEMMs' operands are cast.
    fp8_layers: with fp8, only these trunk blocks' GEMMs in fp8, the others' and the MTP
    blocks' in the compute dtype (None: every block; e.g. all but the first and the last:
    Megatron's first and last layers in bf16). fp8_fast_accum: the routed experts' fp8
    grouped GEMMs with the tensor cores' own accumulator on CUDA (torch._scaled_grouped_mm's
    use_fast_accum: 3.3x faster on an H100, less exact; fmoe.ops.grouped_mlp); needs fp8.
    hyper_connections: n >= 2 residual streams instead of one (hyper-connections; the stream
    between blocks is [T, n H], stream s its columns s H .. (s + 1) H): the embedding is
    copied into every stream; each attention and MLP reads a weighted sum of the streams
    (the "pre" weights) and its output is added into each stream times that stream's "post"
    weight, both per token from the streams themselves (HyperConnection); before the final
    norm a last weighted sum collapses them (Transformer.hc_head). hc_kind "manifold":
    DeepSeek-V4's mHC, the streams also mixed before the add by a per-token doubly
    stochastic n x n matrix (hc_sinkhorn_iters Sinkhorn-Knopp steps); "independent": HY-V4's,
    no mixing, hc_eps added to the post weights too. hc_magnitude: the post weights' bound
    (hc_magnitude sigmoid(...)); hc_eps: added to the pre weights. At initialisation (scales
    0.01) the model is near the one-stream model of its other weights; with the scales and
    hc_eps 0 and magnitude 2 it is that model. Not with shortcut_moe, parallel_blocks,
    residual_scale or MTP modules.
    """

    vocab_size: int = 258
    hidden: int = 128
    n_layers: int = 4
    n_dense: int = 1
    ffn_dense: int = 384
    n_experts: int = 8
    k: int = 2
    ffn_expert: int = 96
    n_shared: int = 1
    shared_ffn: Optional[int] = None
    shared_gate: bool = False
    shared_scale: float = 1.0
    moe_layers: Optional[tuple[int, ...]] = None
    score: str = "sigmoid"
    pre_softmax: bool = False
    n_groups: Optional[int] = None
    topk_groups: Optional[int] = None
    group_score_topk: Optional[int] = None
    route_scale: Optional[float] = None
    route_normalize: bool = True
    expert_bias: bool = True
    expert_bias_on_logits: bool = False
    sparsemixer_eps: float = 0.01
    zero_experts: int = 0
    hash_layers: int = 0
    shortcut_moe: bool = False
    capacity_factor: Optional[float] = None
    capacity_policy: str = "probs"
    route_on_input: bool = False
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    qkv_bias: bool = False
    qk_norm: Optional[str] = None
    qk_norm_bias: bool = False
    qk_norm_after_rope: bool = False
    nope_qk_norm: bool = True
    rope_base: float = 10000.0
    rope_dim: Optional[int] = None
    rope_interleaved: bool = False
    rope_last: bool = False
    rope_reversed: bool = False
    yarn_factor: Optional[float] = None
    yarn_original_max_positions: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 1.0
    yarn_truncate: bool = True
    llama3_factor: Optional[float] = None
    rope_linear_factor: Optional[float] = None
    llama3_low_freq_factor: float = 1.0
    llama3_high_freq_factor: float = 4.0
    llama3_original_max_positions: int = 8192
    longrope_short_factors: Optional[tuple[float, ...]] = None
    longrope_long_factors: Optional[tuple[float, ...]] = None
    longrope_original_max_positions: int = 4096
    longrope_short_scale: float = 1.0
    longrope_long_scale: float = 1.0
    q_rank: Optional[int] = None
    kv_rank: Optional[int] = None
    v_head_dim: Optional[int] = None
    mla_scales: bool = False
    mla_norm_eps: Optional[float] = None
    q_latent_raw: bool = False
    attn_gate_on_q: bool = False
    norm_gate_rank: Optional[int] = None
    index_topk: Optional[int] = None
    index_heads: int = 64
    index_head_dim: int = 128
    index_rope_interleaved: bool = False
    index_rope_last: bool = False
    index_norm_eps: float = 1e-6
    index_loss_coeff: float = 1.0
    index_shared_layers: Optional[tuple[int, ...]] = None
    index_topk_blocks: Optional[int] = None
    index_block_size: int = 128
    index_local_blocks: int = 1
    index_block_layers: Optional[tuple[int, ...]] = None
    moa_experts: Optional[int] = None
    moa_topk: int = 1
    moa_aux_coeff: float = 0.01
    o_groups: Optional[int] = None
    o_rank: Optional[int] = None
    kv_shared: bool = False
    compress_layers: Optional[tuple[int, ...]] = None
    compress_rate: int = 128
    csa_layers: Optional[tuple[int, ...]] = None
    csa_rate: int = 4
    csa_topk: int = 512
    moe_out_bias: bool = False
    o_bias: bool = False
    attn_sinks: bool = False
    sink_layers: Optional[tuple[int, ...]] = None
    value_scale: float = 1.0
    clip_qkv: Optional[float] = None
    local_kv_heads: Optional[int] = None
    local_heads: Optional[int] = None
    local_head_dim: Optional[int] = None
    attn_softcap: Optional[float] = None
    v_norm: bool = False
    attn_out_norm: bool = False
    global_k_eq_v: bool = False
    rope_proportion: Optional[float] = None
    attn_gate: bool = False
    attn_gate_act: str = "sigmoid"
    attn_gate_per_head: bool = False
    attn_gate_bias: bool = False
    router_softcap: Optional[float] = None
    router_scale: float = 1.0
    router_bias: bool = False
    expert_biases: bool = False
    swiglu_alpha: float = 1.0
    swiglu_limit: Optional[float] = None
    swiglu_offset: float = 0.0
    shared_swiglu_limit: Optional[float] = None
    shared_swiglu_alpha: float = 1.0
    shared_swiglu_offset: float = 0.0
    swiglu_limit_layers: Optional[tuple[int, ...]] = None
    shared_swiglu_limit_layers: Optional[tuple[int, ...]] = None
    mlp_act: str = "silu"
    mlp_bias: bool = False
    dense_beside_moe: bool = False
    router_norm: bool = False
    router_expert_scale: bool = False
    layer_scalars: bool = False
    tie_embeddings: bool = False
    out_vocab: Optional[int] = None
    attn_scale: Optional[float] = None
    embed_scale: float = 1.0
    round_embed_scale: bool = False
    residual_scale: float = 1.0
    depth_scaled_residual: bool = False
    normed_residual: Optional[float] = None
    logit_divisor: float = 1.0
    logit_softcap: Optional[float] = None
    window: Optional[int] = None
    window_layers: Optional[tuple[int, ...]] = None
    chunk: Optional[int] = None
    chunk_layers: Optional[tuple[int, ...]] = None
    nope_layers: Optional[tuple[int, ...]] = None
    nope_temperature_floor: Optional[int] = None
    nope_temperature_scale: float = 0.1
    nope_temperature_kind: str = "log"
    query_temperature_floor: Optional[int] = None
    query_temperature_scale: float = 0.1
    local_rope_base: Optional[float] = None
    local_rope_dim: Optional[int] = None
    pre_norms: bool = True
    post_norms: bool = False
    moe_out_norm: bool = False
    parallel_blocks: bool = False
    parallel_norms: bool = False
    layer_norms: bool = False
    norm_bias: bool = False
    norm_weights: bool = True
    embed_norm: bool = False
    abs_positions: Optional[int] = None
    abs_position_offset: int = 0
    alibi: bool = False
    alibi_scaled: bool = False
    head_bias: bool = False
    zero_centered_norms: bool = False
    post_norm_eps: Optional[float] = None
    norm_overrides: tuple[str, ...] = ()
    linear_layers: Optional[tuple[int, ...]] = None
    linear_k_heads: int = 2
    linear_v_heads: int = 4
    linear_k_dim: int = 32
    linear_v_dim: int = 32
    linear_conv: int = 4
    linear_kind: str = "gated_deltanet"
    linear_full_rank: bool = False
    linear_decay_bound: Optional[float] = None
    linear_dt_min: float = 0.0
    linear_neg_eigval: bool = False
    linear_norm_eps: Optional[float] = None
    linear_pre_norms: bool = False
    linear_gate_norm: str = "after"
    linear_dt_rank: Optional[int] = None
    linear_dt_bc_norm: str = "none"
    parallel_hybrid: bool = False
    mlp_free_layers: Optional[tuple[int, ...]] = None
    mixer_free_layers: Optional[tuple[int, ...]] = None
    moe_latent: Optional[int] = None
    moe_latent_norm: bool = False
    expert_out_norm: bool = False
    residual_gates: bool = False
    residual_gate_temperature: float = 0.3
    mtp_depth: int = 0
    mtp_norm: bool = False
    norm_eps: float = 1e-6
    init_std: float = 0.02
    impl: str = "auto"
    ac: str = "none"
    fp8: bool = False
    fp8_layers: Optional[tuple[int, ...]] = None
    fp8_fast_accum: bool = False
    hyper_connections: int = 0
    hc_kind: str = "manifold"
    hc_magnitude: float = 2.0
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20

    def __post_init__(self):
        if self.ac not in AC_MODES:
            raise ValueError(f"ac: expected one of {', '.join(AC_MODES)}, got {self.ac!r}")
        for name in ("vocab_size", "hidden", "n_layers", "n_heads", "n_kv_heads", "head_dim", "n_experts", "k", "ffn_dense", "ffn_expert"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if isinstance(self.init_std, bool) or not isinstance(self.init_std, (int, float)) or not 0 <= self.init_std < math.inf:
            raise ValueError(f"init_std: expected a finite number >= 0, got {self.init_std!r}")
        if isinstance(self.n_dense, bool) or not isinstance(self.n_dense, int) or not 0 <= self.n_dense <= self.n_layers:
            raise ValueError(f"n_dense: expected 0..n_layers = {self.n_layers} (an int), got {self.n_dense!r}")
        check_positive_int("mtp_depth", self.mtp_depth, 0)
        check_positive_int("n_shared", self.n_shared, 0)  # 1.5 failed in torch.empty
        # "False" is truthy: it built the feature (the other bools' checks are beside their knobs)
        for name in ("qkv_bias", "o_bias", "attn_sinks", "router_bias", "expert_biases", "mtp_norm", "shared_gate", "expert_bias",
                     "tie_embeddings", "round_embed_scale", "dense_beside_moe", "router_norm", "router_expert_scale", "layer_scalars",
                     "v_norm", "global_k_eq_v"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if self.linear_kind not in LINEAR_KINDS:  # checked by the linear blocks' config only where there are some
            raise ValueError(f"linear_kind: expected one of {', '.join(LINEAR_KINDS)}, got {self.linear_kind!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads: {self.n_heads} heads do not split over {self.n_kv_heads} kv heads")
        if self.mlp_act not in GLU_ACTS + PLAIN_ACTS:
            raise ValueError(f"mlp_act: expected one of {', '.join(GLU_ACTS + PLAIN_ACTS)} (the MLPs' gate activation, or relu2 / xielu / gelu_new / gelu / relu: no gate), "
                             f"got {self.mlp_act!r}")
        if self.mlp_act == "xielu" and (any(self.is_moe(i) for i in range(self.n_layers)) or self.shortcut_moe):
            raise ValueError("mlp_act: 'xielu' (Apertus's, with learned scalars per MLP) in dense MLPs only; experts with it are not built")
        if self.mlp_act in PLAIN_ACTS and self.expert_biases:
            raise ValueError(f"expert_biases: mlp_act {self.mlp_act!r} makes experts without a gate, which take no b_gate (gpt-oss's biases)")
        if self.dense_beside_moe:
            bad = [name for name in ("shortcut_moe", "parallel_blocks", "hyper_connections", "moe_out_norm", "norm_gate_rank") if getattr(self, name)]
            if bad:
                raise ValueError(f"dense_beside_moe: Gemma 4's dense MLP beside the MoE, each with its own norms, not with {', '.join(bad)}")
            if not (self.pre_norms and self.post_norms):
                raise ValueError("dense_beside_moe: the dense MLP and the MoE each have a pre- and a post-norm, needs pre_norms and post_norms")
        if self.layer_scalars and (self.shortcut_moe or self.hyper_connections):
            raise ValueError("layer_scalars: a scale of each block's output stream, not with shortcut_moe or hyper_connections")
        for name in ("attn_scale", "embed_scale", "residual_scale", "logit_divisor", "value_scale", "norm_eps"):  # norm_eps: the attention's bound
            value = getattr(self, name)
            if (value is not None or name != "attn_scale") and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf):
                raise ValueError(f"{name}: expected a positive finite number{' or None' if name == 'attn_scale' else ''}, got {value!r}")
        check_window(self.window)
        if self.window_layers is not None and self.window is None:
            raise ValueError("window_layers: needs a window (the sliding window's width)")
        if self.chunk_layers is not None and self.chunk is None:
            raise ValueError("chunk_layers: needs a chunk (the attention chunk's length)")
        if self.nope_temperature_floor is not None and self.nope_layers is None:
            raise ValueError("nope_temperature_floor: scales the NoPE blocks' queries, needs nope_layers")
        if self.nope_temperature_kind != "log" and self.nope_temperature_floor is None:
            raise ValueError(f"nope_temperature_kind: the form of the NoPE blocks' query scale, needs nope_temperature_floor "
                             f"(got {self.nope_temperature_kind!r})")
        cap = self.logit_softcap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf):
            raise ValueError(f"logit_softcap: expected None or a positive finite number, got {cap!r}")
        if not isinstance(self.attn_gate_bias, bool) or (self.attn_gate_bias and not self.attn_gate):
            raise ValueError(f"attn_gate_bias: the output gate's bias per head, a bool, True needs attn_gate=True (got {self.attn_gate_bias!r})")
        self._check_depth_scaled_residual()
        self._check_normed_residual()
        if self.norm_gate_rank is not None:
            check_positive_int("norm_gate_rank", self.norm_gate_rank)
            if not self.pre_norms or self.layer_norms or self.zero_centered_norms or self.norm_bias:
                raise ValueError("norm_gate_rank: gates the blocks' plain RMSNorm pre-norms, needs pre_norms and not layer_norms, "
                                 "zero_centered_norms or norm_bias")
        if self.attn_gate_on_q and not self.attn_gate:
            raise ValueError("attn_gate_on_q: the output gate reads the q latent, needs attn_gate=True")
        if self.query_temperature_floor is not None:
            check_positive_int("query_temperature_floor", self.query_temperature_floor)
        scale = self.query_temperature_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise ValueError(f"query_temperature_scale: expected a finite number, got {scale!r}")
        if self.query_temperature_floor is not None and self.nope_temperature_floor is not None:
            raise ValueError("query_temperature_floor: scales every block's queries, not beside nope_temperature_floor (the NoPE blocks' own)")
        if self.local_rope_base is not None and self.window is None and self.chunk is None:
            raise ValueError("local_rope_base: the RoPE base of the window's or chunk's blocks, needs a window or a chunk")
        if self.local_kv_heads is not None:
            check_positive_int("local_kv_heads", self.local_kv_heads)
            if self.window is None and self.chunk is None:
                raise ValueError("local_kv_heads: the kv heads of the window's or chunk's blocks, needs a window or a chunk")
            if (self.local_heads or self.n_heads) % self.local_kv_heads:
                raise ValueError(f"local_kv_heads: {self.local_heads or self.n_heads} heads do not split over {self.local_kv_heads} kv heads")
            if self.kv_rank is not None:
                raise ValueError("local_kv_heads: grouped-query attention's kv heads; multi-latent attention has n_heads")
        if self.local_head_dim is not None:
            check_positive_int("local_head_dim", self.local_head_dim)
            if self.window is None and self.chunk is None:
                raise ValueError("local_head_dim: the head dim of the window's or chunk's blocks, needs a window or a chunk")
            if self.kv_rank is not None or self.v_head_dim is not None:
                raise ValueError("local_head_dim: grouped-query attention's head dim (its values' too), not with kv_rank or v_head_dim")
            if self.local_rope_base is None:
                raise ValueError("local_head_dim: the local blocks' RoPE tables are their own (of their head dim), needs local_rope_base")
        if self.local_heads is not None:
            check_positive_int("local_heads", self.local_heads)
            if self.window is None and self.chunk is None:
                raise ValueError("local_heads: the query heads of the window's or chunk's blocks, needs a window or a chunk")
            if self.kv_rank is not None:
                raise ValueError("local_heads: grouped-query attention's query heads; multi-latent attention has n_heads")
            if self.local_heads % (self.local_kv_heads or self.n_kv_heads):
                raise ValueError(f"local_heads: {self.local_heads} heads do not split over {self.local_kv_heads or self.n_kv_heads} kv heads")
        if self.moe_out_norm and self.post_norms:
            raise ValueError("moe_out_norm: a norm on the MoE blocks' output, which post_norms already puts on every block's")
        if self.parallel_blocks and (not self.pre_norms or self.post_norms or self.moe_out_norm):
            raise ValueError("parallel_blocks: attention and MLP of one pre-norm's output, needs pre_norms and neither post_norms nor moe_out_norm")
        check_positive_int("abs_position_offset", self.abs_position_offset, 0)
        if self.abs_position_offset and self.abs_positions is None:
            raise ValueError("abs_position_offset: the rows of pos_embed before position 0's, needs abs_positions")
        if self.abs_positions is not None:
            check_positive_int("abs_positions", self.abs_positions)
            if self.mtp_depth:
                raise ValueError("abs_positions: learned absolute positions leave every block without RoPE, which the MTP blocks have; "
                                 "set mtp_depth=0")
        self._check_alibi()
        if self.parallel_norms and not self.parallel_blocks:
            raise ValueError("parallel_norms: the MLP's own pre-norm in a parallel block, needs parallel_blocks=True")
        if (self.attn_gate_act != "sigmoid" or self.attn_gate_per_head) and not self.attn_gate:
            raise ValueError("attn_gate_act / attn_gate_per_head: gated attention's gate, needs attn_gate=True")
        if self.v_head_dim is not None:
            check_positive_int("v_head_dim", self.v_head_dim)
        if self.value_scale != 1.0 and self.kv_rank is not None:
            raise ValueError("value_scale: scales grouped-query attention's values, not multi-latent attention's")
        check_clip_qkv(self.clip_qkv, self.kv_rank)
        if self.clip_qkv is not None and self.linear_layers:
            raise ValueError("clip_qkv: clamps the attention blocks' q, k and v; the linear-attention blocks (linear_layers) have no such clamp")
        if self.sink_layers is not None and not self.attn_sinks:
            raise ValueError("sink_layers: the blocks with attention sinks, needs attn_sinks")
        for name in ("pre_norms", "post_norms", "linear_pre_norms", "linear_neg_eigval", "mlp_bias", "moe_out_norm", "parallel_blocks", "parallel_norms", "layer_norms",
                     "nope_qk_norm", "route_on_input", "attn_gate", "zero_centered_norms", "norm_bias", "head_bias", "shortcut_moe", "mla_scales", "q_latent_raw", "attn_gate_on_q",
                     "parallel_hybrid", "norm_weights", "embed_norm", "rope_reversed", "attn_out_norm", "moe_latent_norm", "expert_out_norm",
                     "residual_gates"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if self.norm_bias and not self.layer_norms:
            raise ValueError("norm_bias: a bias on each LayerNorm, needs layer_norms (the RMSNorms have none)")
        if not self.norm_weights:
            for name in ("zero_centered_norms", "norm_bias", "norm_gate_rank"):
                if getattr(self, name):
                    raise ValueError(f"norm_weights: False leaves the norms without weights, not with {name}")
        self._check_norm_overrides()
        self._check_scales_norms_and_gates()
        if self.out_vocab is not None:
            check_positive_int("out_vocab", self.out_vocab, 1, self.vocab_size)
            if self.tie_embeddings:
                raise ValueError("out_vocab: an output head of its own rows, not with tie_embeddings (the head is then the embedding)")
        if self.fp8_layers is not None and self.fp8 is not True:
            raise ValueError("fp8_layers: the blocks whose GEMMs run in fp8, needs fp8=True")
        check_fp8_fast_accum(self.fp8_fast_accum, self.fp8 is True)
        for name in ("moe_layers", "window_layers", "chunk_layers", "nope_layers", "linear_layers", "fp8_layers", "index_shared_layers",
                     "sink_layers", "mlp_free_layers", "mixer_free_layers", "swiglu_limit_layers",
                     "shared_swiglu_limit_layers", "index_block_layers", "compress_layers", "csa_layers"):  # block lists: distinct indices, kept sorted
            layers = getattr(self, name)
            if layers is None:
                continue
            try:
                layers = tuple(layers)
            except TypeError:  # one int, not a list of them
                raise ValueError(f"{name}: expected distinct block indices in 0..{self.n_layers - 1}, got {layers!r}") from None
            if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_layers for i in layers) or len(set(layers)) != len(layers):
                raise ValueError(f"{name}: expected distinct block indices in 0..{self.n_layers - 1}, got {getattr(self, name)!r}")
            object.__setattr__(self, name, tuple(sorted(layers)))
        if self.shortcut_moe:
            if self.n_layers % 2:
                raise ValueError(f"n_layers: shortcut_moe builds the blocks in pairs, expected an even number, got {self.n_layers}")
            odd = [i for i in self.moe_layers or () if i % 2]
            if odd:
                raise ValueError(f"moe_layers: with shortcut_moe the MoE is the first block's of a pair (an even index), got blocks {odd}")
            if self.parallel_blocks or self.post_norms or self.moe_out_norm or self.residual_scale != 1.0:
                raise ValueError("shortcut_moe: a pair of pre-norm blocks, not with parallel_blocks, post_norms, moe_out_norm or residual_scale")
        self._check_hyper_connections()
        self._check_block_parts()
        if self.moe_latent is not None:
            check_positive_int("moe_latent", self.moe_latent)
        if self.mla_scales and (self.q_rank is None or self.kv_rank is None):
            raise ValueError("mla_scales: scales multi-latent attention's queries and kv latent, needs q_rank and kv_rank")
        for name in ("longrope_short_factors", "longrope_long_factors"):  # read back from JSON as lists (AttentionConfig checks them)
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.shared_ffn is not None and (isinstance(self.shared_ffn, bool) or not isinstance(self.shared_ffn, int) or self.shared_ffn < 0):
            raise ValueError(f"shared_ffn: expected an int >= 0 or None, got {self.shared_ffn!r}")
        if self.shared_gate and not self.shared_size:
            raise ValueError("shared_gate: needs shared experts (n_shared > 0 or shared_ffn > 0)")
        if self.rope_dim is not None and (isinstance(self.rope_dim, bool) or not isinstance(self.rope_dim, int)
                                          or not 2 <= self.rope_dim <= self.head_dim or self.rope_dim % 2):
            raise ValueError(f"rope_dim: expected an even int in 2..head_dim = {self.head_dim}, or None, got {self.rope_dim!r}")
        coeff = self.index_loss_coeff
        if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or not 0 <= coeff < math.inf:
            raise ValueError(f"index_loss_coeff: expected a finite number >= 0, got {coeff!r}")
        if self.index_topk is None and self.index_topk_blocks is None and not self.csa_layers and coeff != 1.0:
            raise ValueError("index_loss_coeff: the weight of a sparse attention's indexer loss, needs index_topk, index_topk_blocks or csa_layers")
        if self.index_shared_layers is not None and self.index_topk is None:
            raise ValueError("index_shared_layers: blocks reusing an earlier block's choice of keys (DeepSeek sparse attention), needs index_topk")
        if self.index_topk_blocks is None:
            for name, unset in (("index_block_layers", None), ("index_block_size", 128), ("index_local_blocks", 1)):
                if getattr(self, name) != unset:
                    raise ValueError(f"{name}: a knob of block-sparse attention, needs index_topk_blocks")
        if self.index_topk_blocks is not None:
            for name in ("window", "chunk"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: not with block-sparse attention (index_topk_blocks), whose blocks are counted over the whole document")
            if self.alibi:
                raise ValueError("alibi: not with block-sparse attention (index_topk_blocks)")
        self._check_moa()
        self._check_hash()
        self._check_compress()
        self._check_csa()
        if self.local_rope_dim is not None:  # 0 was read as unset
            check_positive_int("local_rope_dim", self.local_rope_dim)
        for name, unset in (("linear_full_rank", False), ("linear_decay_bound", None)):
            if getattr(self, name) is not unset and (self.linear_layers is None or self.linear_kind != "kda"):
                raise ValueError(f"{name}: a knob of Kimi Delta Attention's blocks, needs linear_layers and linear_kind='kda'")
        if self.linear_dt_min != 0.0 and (self.linear_layers is None or self.linear_kind != "mamba2"):
            raise ValueError("linear_dt_min: the floor of Mamba-2's dt, needs linear_layers and linear_kind='mamba2'")
        if self.linear_gate_norm not in GATE_NORMS:
            raise ValueError(f"linear_gate_norm: expected one of {GATE_NORMS} (Mamba-2's output norm after its gate, before it, or none), "
                             f"got {self.linear_gate_norm!r}")
        if self.linear_gate_norm != "after" and (self.linear_layers is None or self.linear_kind != "mamba2"):
            raise ValueError("linear_gate_norm: where Mamba-2's output norm sits, needs linear_layers and linear_kind='mamba2'")
        for name, unset in (("linear_dt_rank", None), ("linear_dt_bc_norm", "none")):
            if getattr(self, name) != unset and (self.linear_layers is None or self.linear_kind != "mamba1"):
                raise ValueError(f"{name}: a knob of Mamba-1's mixer, needs linear_layers and linear_kind='mamba1'")
        if self.parallel_hybrid and (self.linear_layers is None or self.index_topk is not None):
            raise ValueError("parallel_hybrid: softmax attention beside the linear mixer of each linear_layers block, needs linear_layers"
                             + (", not with DeepSeek sparse attention (index_topk)" if self.linear_layers else ""))
        if self.mlp_bias and (self.shortcut_moe or self.dense_beside_moe):
            raise ValueError(f"mlp_bias: biases on the dense blocks' MLPs, not with {'shortcut_moe' if self.shortcut_moe else 'dense_beside_moe'} "
                             "(whose dense MLPs have none)")
        if self.linear_neg_eigval and (self.linear_layers is None or self.linear_kind not in ("gated_deltanet", "kda")):
            raise ValueError("linear_neg_eigval: the delta rule's write strength in [0, 2], needs linear_layers and linear_kind 'gated_deltanet' "
                             "or 'kda'")
        eps = self.linear_norm_eps
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf):
            raise ValueError(f"linear_norm_eps: expected None (norm_eps) or a positive number, got {eps!r}")
        if eps is not None and (self.linear_layers is None or self.linear_kind in ("short_conv", "lightning")):
            raise ValueError("linear_norm_eps: the linear-attention blocks' gated output norm's eps, needs linear_layers and a linear_kind with "
                             "that norm (not 'short_conv' or 'lightning')")
        if self.linear_pre_norms:
            if self.linear_layers is None:
                raise ValueError("linear_pre_norms: the linear-attention blocks' norm placement, needs linear_layers")
            if self.pre_norms and not self.post_norms:
                raise ValueError("linear_pre_norms: the linear-attention blocks as pre-norm blocks beside blocks of another placement, "
                                 "but every block is pre-norm already (pre_norms without post_norms)")
            bad = [name for name in ("parallel_blocks", "shortcut_moe", "dense_beside_moe", "moe_out_norm") if getattr(self, name)]
            if bad or self.normed_residual is not None:
                raise ValueError(f"linear_pre_norms: a block placement of its own, not with {', '.join(bad) or 'normed_residual'}")
        if self.linear_layers is not None and not self.parallel_hybrid:  # a parallel hybrid's linear blocks attend too
            for name in ("window_layers", "chunk_layers", "nope_layers", "sink_layers"):
                both = sorted(set(self.linear_layers) & set(getattr(self, name) or ()))
                if both:
                    raise ValueError(f"{name}: blocks {both} are linear-attention blocks (linear_layers), which do not attend")
            self.linear_attention_config()  # its own checks (heads, dims, taps)
        self.attention_config(local=True)  # its own checks (qk_norm, window and chunk)
        if self.rope_proportion is not None or self.global_k_eq_v or self.local_head_dim is not None:
            self.attention_config()  # the global blocks' (proportional RoPE, values from the keys) where they differ
        if self.rope_proportion is not None and (self.window is not None or self.chunk is not None) and self.local_rope_base is None:
            raise ValueError("rope_proportion: proportional RoPE in the blocks without a window or chunk; those with one need their own plain "
                             "tables, local_rope_base")
        if self.nope_layers is not None:
            self.attention_config(rope=False)  # the NoPE blocks' (the temperature)
        for i in self.index_shared_layers or ():
            if not any(not self.is_index_shared(j) and not self.is_linear(j) for j in range(i)):
                raise ValueError(f"index_shared_layers: block {i} reuses the choice of an earlier block with an indexer, and none is before it")
            if self.is_linear(i):
                raise ValueError(f"index_shared_layers: block {i} is a linear-attention block (linear_layers), which does not attend")
        check_sparsemixer_knobs(self.score, self.k, self.sparsemixer_eps, pre_softmax=self.pre_softmax, n_groups=self.n_groups,
                                topk_groups=self.topk_groups, route_scale=self.route_scale, group_score_topk=self.group_score_topk,
                                route_normalize=self.route_normalize)
        if not isinstance(self.expert_bias_on_logits, bool):
            raise ValueError(f"expert_bias_on_logits: expected a bool, got {self.expert_bias_on_logits!r}")
        if self.expert_bias_on_logits and (self.score != "sigmoid" or not self.expert_bias):
            raise ValueError("expert_bias_on_logits: the expert bias on sigmoid scoring's logits, needs score='sigmoid' and expert_bias=True "
                             f"(got score={self.score!r}, expert_bias={self.expert_bias!r})")
        for name in ("swiglu_limit", "shared_swiglu_limit"):
            if getattr(self, name + "_layers") is not None and getattr(self, name) is None:
                raise ValueError(f"{name}_layers: the blocks that {name} clamps, needs {name}")
        try:
            self.moe_config(every_limit=True)  # its own checks (the SwiGLU options, impl, and route's knobs by route itself), named as these fields
        except ValueError as e:  # all but its last, the refusal of experts with xIELU: its MLPs are dense blocks' only (above)
            if self.mlp_act != "xielu" or not str(e).startswith("mlp_act:"):
                raise
        if self.score == "sparsemixer" and self.expert_bias:
            raise ValueError("expert_bias: sparsemixer routing (score='sparsemixer') takes no expert bias; set expert_bias=False")

    def _check_hash(self) -> None:
        """hash_layers (class docstring)."""
        n_moe = sum(self.is_moe(i) for i in range(self.n_layers))
        check_positive_int("hash_layers", self.hash_layers, 0, n_moe)
        if self.hash_layers:
            for name, bad in (("score", self.score == "sparsemixer"), ("pre_softmax", self.pre_softmax), ("zero_experts", self.zero_experts)):
                if bad:
                    raise ValueError(f"{name}: hash_layers route by a table of token ids (fmoe.ops.hash_route), not with {name}={getattr(self, name)!r}")

    def _check_compress(self) -> None:
        """compress_layers and compress_rate (class docstring); the blocks' own AttentionConfig checks the rest."""
        check_positive_int("compress_rate", self.compress_rate, 2)
        if not self.compress_layers:
            return
        bad = [i for i in self.compress_layers if self.is_linear(i) or self.is_mixer_free(i)]
        if bad:
            raise ValueError(f"compress_layers: heavily compressed attention blocks attend (softmax attention), got blocks {bad} without it")
        self.attention_config(compress=True)  # kv_shared, one kv head, no softcap

    def inert_knobs(self) -> dict[str, str]:
        """The knobs of a feature this model lacks that are set away from their defaults
        (YaRN's without yarn_factor, the linear blocks' without linear_layers, ...): name ->
        why it has no effect. A Hugging Face folder's config may hold them (its scaling turned
        off by an option); a command line that sets one is refused (examples/train_moe.py)."""
        inert = {}
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        indexer = self.index_topk is not None or self.index_topk_blocks is not None or bool(self.csa_layers)
        groups = (
            (self.yarn_factor is not None, "YaRN's", "yarn_factor", ("yarn_original_max_positions", "yarn_beta_fast", "yarn_beta_slow",
                                                                     "yarn_mscale", "yarn_mscale_all_dim", "yarn_truncate")),
            (self.llama3_factor is not None, "Llama 3's RoPE scaling", "llama3_factor",
             ("llama3_low_freq_factor", "llama3_high_freq_factor", "llama3_original_max_positions")),
            (indexer, "a sparse attention's indexer", "index_topk, index_topk_blocks or csa_layers", ("index_heads", "index_head_dim")),
            (bool(self.compress_layers), "heavily compressed attention", "compress_layers", ("compress_rate",)),
            (bool(self.csa_layers), "compressed sparse attention", "csa_layers", ("csa_rate", "csa_topk")),
            (self.linear_layers is not None, "the linear-attention blocks", "linear_layers",
             ("linear_k_heads", "linear_v_heads", "linear_k_dim", "linear_v_dim", "linear_conv", "linear_kind")),
            (self.nope_temperature_floor is not None, "the NoPE blocks' query temperature", "nope_temperature_floor",
             ("nope_temperature_scale", "nope_temperature_kind")),
            (self.query_temperature_floor is not None, "the queries' temperature", "query_temperature_floor", ("query_temperature_scale",)),
            (self.residual_gates, "the residual gates", "residual_gates", ("residual_gate_temperature",)),
        )
        for on, what, needs, names in groups:
            for name in names:
                value = getattr(self, name)
                if not on and (value != defaults[name] or value != value):  # a nan too
                    inert[name] = f"a knob of {what}, needs {needs}"
        return inert

    def _check_csa(self) -> None:
        """csa_layers, csa_rate and csa_topk (class docstring); the blocks' own AttentionConfig checks the rest."""
        check_positive_int("csa_rate", self.csa_rate, 2)
        check_positive_int("csa_topk", self.csa_topk)
        if not self.csa_layers:
            return
        bad = [i for i in self.csa_layers if self.is_linear(i) or self.is_mixer_free(i)]
        if bad:
            raise ValueError(f"csa_layers: compressed sparse attention blocks attend (softmax attention), got blocks {bad} without it")
        both = sorted(set(self.csa_layers) & set(self.compress_layers or ()))
        if both:
            raise ValueError(f"csa_layers: blocks {both} are in compress_layers too (a block is compressed sparse or heavily compressed attention)")
        self.attention_config(csa=True)  # kv_shared, one kv head, q_rank, no other indexer

    def is_compressed(self, i: int) -> bool:
        """Whether trunk block i is a heavily compressed attention block (compress_layers)."""
        return i in (self.compress_layers or ())

    def is_csa(self, i: int) -> bool:
        """Whether trunk block i is a compressed sparse attention block (csa_layers)."""
        return i in (self.csa_layers or ())

    def is_hash(self, i: int) -> bool:
        """Whether trunk block i routes by hashing its tokens' ids: one of the first hash_layers MoE blocks."""
        return self.is_moe(i) and sum(self.is_moe(j) for j in range(i)) < self.hash_layers

    def _check_moa(self) -> None:
        """The mixture of attention heads' knobs (class docstring), and moe_out_bias."""
        coeff = self.moa_aux_coeff
        if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or not 0 <= coeff < math.inf:
            raise ValueError(f"moa_aux_coeff: expected a finite number >= 0, got {coeff!r}")
        if not isinstance(self.moe_out_bias, bool) or (self.moe_out_bias and not any(self.is_moe(i) for i in range(self.n_layers))):
            raise ValueError(f"moe_out_bias: a bias on the MoE blocks' output (a bool; True needs MoE blocks), got {self.moe_out_bias!r}")
        if self.moa_experts is None:
            if coeff != 0.01:
                raise ValueError("moa_aux_coeff: the weight of the attention experts' balance loss, needs moa_experts")
            return  # moa_topk: AttentionConfig's check
        taken = dict(qkv_bias=self.qkv_bias, attn_gate=self.attn_gate, local_heads=self.local_heads is not None,
                     local_kv_heads=self.local_kv_heads is not None, local_head_dim=self.local_head_dim is not None)
        refused = [name for name, on in taken.items() if on]
        if refused:
            raise ValueError(f"{refused[0]}: not with a mixture of attention heads (moa_experts)")

    def _check_depth_scaled_residual(self) -> None:
        if not isinstance(self.depth_scaled_residual, bool):
            raise ValueError(f"depth_scaled_residual: expected a bool, got {self.depth_scaled_residual!r}")
        if self.depth_scaled_residual:
            self._refuse_beside("depth_scaled_residual: the residual adds of sequential trunk blocks", hyper_connections=self.hyper_connections)

    def _check_normed_residual(self) -> None:
        a = self.normed_residual
        if a is None:
            return
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 < a < math.inf:
            raise ValueError(f"normed_residual: expected None or a positive finite number (the normed residual's weight), got {a!r}")
        bad = [name for name in ("parallel_blocks", "hyper_connections", "shortcut_moe", "depth_scaled_residual", "dense_beside_moe", "layer_scalars")
               if getattr(self, name)]
        if bad or not self.pre_norms:
            raise ValueError(f"normed_residual: each sublayer's residual is its pre-norm's output (MiniMax's blocks), needs pre_norms and not "
                             f"{', '.join(bad) if bad else 'pre_norms=False'}")

    def _refuse_beside(self, what: str, **more) -> None:
        """ValueError `what`, not with shortcut_moe, parallel_blocks, residual_scale, the `more`
        knobs (name=on) or MTP modules, naming those that are on."""
        beside = {"shortcut_moe": self.shortcut_moe, "parallel_blocks": self.parallel_blocks, "residual_scale": self.residual_scale != 1.0,
                  **more, "mtp_depth": self.mtp_depth}
        if any(beside.values()):
            found = ", ".join(f"{name}={getattr(self, name)!r}" for name, on in beside.items() if on)
            raise ValueError(f"{what}, not with shortcut_moe, parallel_blocks, residual_scale{''.join(', ' + name for name in more)} or MTP modules "
                             f"(got {found}; MTP: mtp_depth=0, --model.mtp_depth=0)")

    def _check_block_parts(self) -> None:
        """mlp_free_layers: blocks of their mixer alone, neither dense nor MoE, in sequential
        blocks; mixer_free_layers: blocks of their MLP alone, with neither kind of attention nor
        the knobs that place it, not without an MLP too."""
        if self.mlp_free_layers:
            moe = [i for i in self.mlp_free_layers if self.is_moe(i)]
            if moe:
                raise ValueError(f"mlp_free_layers: blocks {moe} are MoE blocks (n_dense = {self.n_dense}, moe_layers = {self.moe_layers}); "
                                 "a block without an MLP is neither dense nor MoE")
            for name in ("parallel_blocks", "shortcut_moe", "layer_scalars"):
                if getattr(self, name):
                    raise ValueError(f"mlp_free_layers: blocks without an MLP, not with {name}")
        if self.mixer_free_layers:
            for name in ("mlp_free_layers", "linear_layers", "window_layers", "chunk_layers", "nope_layers", "sink_layers", "index_shared_layers"):
                both = sorted(set(self.mixer_free_layers) & set(getattr(self, name) or ()))
                if both:
                    raise ValueError(f"mixer_free_layers: blocks {both} are in {name} too; a block without a mixer has no attention to place")
            for name in ("parallel_blocks", "shortcut_moe", "normed_residual", "index_topk"):
                if getattr(self, name) not in (None, False):
                    raise ValueError(f"mixer_free_layers: blocks without a mixer, not with {name}")

    def is_mixer_free(self, i: int) -> bool:
        """Whether trunk block i is its MLP alone, without attention: listed in mixer_free_layers."""
        return self.mixer_free_layers is not None and i in self.mixer_free_layers

    def attends(self, i: int) -> bool:
        """Whether trunk block i has softmax attention: neither linear attention (unless
        parallel_hybrid puts attention beside it) nor mixer-free."""
        return (not self.is_linear(i) or self.parallel_hybrid) and not self.is_mixer_free(i)

    def is_mlp_free(self, i: int) -> bool:
        """Whether trunk block i is its mixer alone, without an MLP: listed in mlp_free_layers."""
        return self.mlp_free_layers is not None and i in self.mlp_free_layers

    def _check_hyper_connections(self) -> None:
        n = self.hyper_connections
        if isinstance(n, bool) or not isinstance(n, int) or n < 0 or n == 1:
            raise ValueError(f"hyper_connections: expected 0 (one residual stream, no hyper-connections) or an int >= 2 (the streams), got {n!r}")
        if self.hc_kind not in HC_KINDS:
            raise ValueError(f"hc_kind: expected one of {', '.join(HC_KINDS)}, got {self.hc_kind!r}")
        m, eps = self.hc_magnitude, self.hc_eps
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m < math.inf:
            raise ValueError(f"hc_magnitude: expected a positive finite number, got {m!r}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
            raise ValueError(f"hc_eps: expected a finite number >= 0, got {eps!r}")
        check_positive_int("hc_sinkhorn_iters", self.hc_sinkhorn_iters)
        if not n:
            changed = [name for name, default in (("hc_kind", "manifold"), ("hc_magnitude", 2.0), ("hc_eps", 1e-6), ("hc_sinkhorn_iters", 20))
                       if getattr(self, name) != default]
            if changed:
                raise ValueError(f"{', '.join(changed)}: knobs of hyper-connections, need hyper_connections >= 2")
            return
        self._refuse_beside("hyper_connections: streams of sequential blocks")

    @property
    def stream_width(self) -> int:
        """The width of the residual stream between blocks: hidden, or n hidden with n
        hyper_connections streams."""
        return self.hidden * max(1, self.hyper_connections)

    def check_micro_batch(self, tokens: int, knob: str) -> None:
        """A ValueError naming `knob` (the script's flag) where micro-batches of `tokens` tokens
        can hold a document past the model's learned positions (abs_positions): the forward
        would stop at the first such document, mid-run."""
        if self.abs_positions is not None and tokens > self.abs_positions:
            raise ValueError(f"{knob}: expected at most {self.abs_positions} tokens, the model's learned positions (abs_positions): a "
                             f"document of a {tokens}-token micro-batch can reach past them, got {tokens}")

    def is_moe(self, i: int) -> bool:
        """Whether trunk block i is a MoE block: listed in moe_layers, or i >= n_dense (with
        shortcut_moe, an even i only: a pair's first block)."""
        if self.shortcut_moe and i % 2:
            return False
        return i in self.moe_layers if self.moe_layers is not None else i >= self.n_dense

    def shortcut(self, i: int) -> Optional[str]:
        """Trunk block i's part in a shortcut-connected MoE pair (shortcut_moe): "out" for a
        pair's first block with the MoE (its output handed on), "in" for the second (it adds
        that output), None for a block of neither (or without shortcut_moe)."""
        if not self.shortcut_moe:
            return None
        if i % 2 == 0:
            return "out" if self.is_moe(i) else None
        return "in" if self.is_moe(i - 1) else None

    def is_linear(self, i: int) -> bool:
        """Whether trunk block i is a linear-attention (Gated DeltaNet) block: listed in linear_layers."""
        return self.linear_layers is not None and i in self.linear_layers

    def is_sliding(self, i: int) -> bool:
        """Whether trunk block i attends over the sliding window: listed in window_layers,
        or every attending trunk block (not linear) when only window is set."""
        return self.window is not None and self.attends(i) and (self.window_layers is None or i in self.window_layers)

    def is_chunked(self, i: int) -> bool:
        """Whether trunk block i attends within its chunk: listed in chunk_layers, or every
        attending trunk block (not linear) when only chunk is set."""
        return self.chunk is not None and self.attends(i) and (self.chunk_layers is None or i in self.chunk_layers)

    def is_local(self, i: int) -> bool:
        """Whether trunk block i attends over the sliding window or within its chunk (the
        context's local mask)."""
        return self.is_sliding(i) or self.is_chunked(i)

    def is_fp8(self, i: Optional[int]) -> bool:
        """Whether trunk block i's GEMMs run in fp8 (fp8, and i in fp8_layers when given);
        i None: the MTP blocks', in fp8 when fp8 is on for every block."""
        if i is None:
            return self.fp8 and self.fp8_layers is None
        return self.fp8 and (self.fp8_layers is None or i in self.fp8_layers)

    def is_index_shared(self, i: int) -> bool:
        """Whether trunk block i reuses an earlier block's choice of keys (index_shared_layers)."""
        return self.index_shared_layers is not None and i in self.index_shared_layers

    def is_index_blocks(self, i: int) -> bool:
        """Whether trunk block i attends by block-sparse attention (index_topk_blocks; in
        index_block_layers where it is set); i None: an MTP block (every one with index_topk_blocks)."""
        if self.index_topk_blocks is None:
            return False
        return i is None or self.index_block_layers is None or i in self.index_block_layers

    def index_source(self, i: int) -> int:
        """The block whose indexer chooses trunk block i's keys: i itself, or for a block of
        index_shared_layers the nearest earlier block with an indexer."""
        return max(j for j in range(i + 1) if not self.is_index_shared(j) and not self.is_linear(j))

    def is_nope(self, i: int) -> bool:
        """Whether trunk block i attends without RoPE: listed in nope_layers, or every block with
        abs_positions (the positions are in the embeddings) or alibi (in the scores' biases)."""
        return self.abs_positions is not None or self.alibi or (self.nope_layers is not None and i in self.nope_layers)

    def _check_alibi(self) -> None:
        """ALiBi's knobs (class docstring): ValueError naming the field."""
        for name in ("alibi", "alibi_scaled"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if not self.alibi:
            if self.alibi_scaled:
                raise ValueError("alibi_scaled: ALiBi's bias times the softmax scale, needs alibi=True")
            return
        others = dict(kv_rank="multi-latent attention", abs_positions="learned absolute positions", nope_layers="NoPE blocks: every block is one",
                      mtp_depth="MTP modules, which rotate", compress_layers="compressed entries: no ALiBi distance to them",
                      csa_layers="compressed entries: no ALiBi distance to them")
        for name, what in others.items():
            if getattr(self, name):
                raise ValueError(f"alibi: ALiBi's biases on grouped-query attention in place of RoPE, not with {name} = {getattr(self, name)!r} ({what})")

    def has_sinks(self, i: Optional[int]) -> bool:
        """Whether trunk block i's attention has sinks (attn_sinks, and i in sink_layers when
        given); i None: the MTP blocks', with sinks when every block has them."""
        return self.attn_sinks and (self.sink_layers is None if i is None else self.sink_layers is None or i in self.sink_layers)

    def heads(self, i: Optional[int]) -> int:
        """Trunk block i's query heads: local_heads in a window's or chunk's block where set,
        else n_heads (i None: the MTP blocks', which attend over every earlier token)."""
        return self.local_heads if self.local_heads is not None and i is not None and self.is_local(i) else self.n_heads

    def layer_head_dim(self, i: Optional[int]) -> int:
        """Trunk block i's head dim: local_head_dim in a window's or chunk's block where set,
        else head_dim (MTP blocks, i None: head_dim)."""
        return self.local_head_dim if self.local_head_dim is not None and i is not None and self.is_local(i) else self.head_dim

    def kv_heads(self, i: Optional[int]) -> int:
        """Trunk block i's kv heads: local_kv_heads in a window's or chunk's block where set,
        else n_kv_heads (i None: the MTP blocks', which attend over every earlier token)."""
        return self.local_kv_heads if self.local_kv_heads is not None and i is not None and self.is_local(i) else self.n_kv_heads

    @property
    def longrope_switches(self) -> bool:
        """Whether LongRoPE's long factors or scale differ from its short ones: a sequence
        that grows past longrope_original_max_positions then changes every key's rotation."""
        if self.longrope_short_factors is None:
            return False
        long = self.longrope_long_factors if self.longrope_long_factors is not None else self.longrope_short_factors
        return tuple(long) != tuple(self.longrope_short_factors) or self.longrope_long_scale != self.longrope_short_scale

    @property
    def n_choices(self) -> int:
        """The router's choices per MoE block: n_experts and the zero_experts after them."""
        return self.n_experts + self.zero_experts

    @property
    def shared_size(self) -> int:
        """The shared experts' FFN size: shared_ffn, or n_shared * ffn_expert."""
        return self.shared_ffn if self.shared_ffn is not None else self.n_shared * self.ffn_expert

    def clamps(self, i: Optional[int], shared: bool = False) -> bool:
        """Whether block i's routed experts take swiglu_limit (shared: its shared experts and
        dense MLPs shared_swiglu_limit): every block without swiglu_limit_layers
        (shared_swiglu_limit_layers), else the trunk blocks it lists (i None: an MTP block)."""
        layers = self.shared_swiglu_limit_layers if shared else self.swiglu_limit_layers
        return layers is None or (i is not None and i in layers)

    def mlp_limit(self, i: Optional[int]) -> Optional[float]:
        """Block i's shared experts' and dense MLPs' SwiGLU clamp (shared_swiglu_limit where
        clamps(i, shared=True); i None: an MTP block)."""
        return self.shared_swiglu_limit if self.clamps(i, shared=True) else None

    def moe_config(self, fp8: Optional[bool] = None, layer: Optional[int] = None, *, every_limit: bool = False) -> MoEConfig:
        """The MoE blocks' config; fp8: theirs (None: the model's fp8); layer: the block's index
        (None: an MTP block), whose SwiGLU limits it carries (clamps); every_limit: both limits
        whatever the layer (to check them)."""
        with _named_as(MOE_FIELDS):
            return MoEConfig(
                n_experts=self.n_experts, k=self.k, score=self.score, pre_softmax=self.pre_softmax, n_groups=self.n_groups, topk_groups=self.topk_groups,
                scale=self.route_scale, group_score_topk=self.group_score_topk, normalize=self.route_normalize, capacity_factor=self.capacity_factor, capacity_policy=self.capacity_policy, impl=self.impl,
                swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit if every_limit or self.clamps(layer) else None, swiglu_offset=self.swiglu_offset,
                shared_swiglu_limit=self.shared_swiglu_limit if every_limit else self.mlp_limit(layer), shared_swiglu_alpha=self.shared_swiglu_alpha,
                shared_swiglu_offset=self.shared_swiglu_offset, weights_on_input=self.route_on_input, fp8=self.fp8 if fp8 is None else fp8,
                fp8_fast_accum=self.fp8_fast_accum and (self.fp8 if fp8 is None else fp8), logit_softcap=self.router_softcap, shared_scale=self.shared_scale,
                sparsemixer_eps=self.sparsemixer_eps, zero_experts=self.zero_experts, bias_on_logits=self.expert_bias_on_logits,
                glu_act=self.mlp_act, norm_eps=self.norm_eps,  # relu2: the experts without a gate
                logit_scale=self.router_scale, expert_out_norm_eps=self.norm_eps if self.post_norm_eps is None else self.post_norm_eps,
            )

    def linear_attention_config(self, fp8: Optional[bool] = None) -> LinearAttentionConfig:
        """The linear-attention blocks' (linear_layers) Gated DeltaNet, or Kimi Delta Attention (linear_kind "kda"), or
        LFM2's short convolution ("short_conv"), MiniMax's lightning attention ("lightning"), Mamba-2's mixer ("mamba2"), or
        Mamba-1's ("mamba1");
        fp8: theirs (None: the model's fp8)."""
        with _named_as(LINEAR_FIELDS):
            return LinearAttentionConfig(n_k_heads=self.linear_k_heads, n_v_heads=self.linear_v_heads, k_head_dim=self.linear_k_dim,
                                         v_head_dim=self.linear_v_dim, conv=self.linear_conv,
                                         # MiniMax's output norm's eps, or OLMo Hybrid's own (linear_norm_eps)
                                         norm_eps=1e-6 if self.linear_kind == "lightning" else (self.linear_norm_eps or self.norm_eps),
                                         impl=self.impl, kind=self.linear_kind,
                                         full_rank=self.linear_full_rank, decay_bound=self.linear_decay_bound,
                                         dt_min=self.linear_dt_min, neg_eigval=self.linear_neg_eigval, gate_norm=self.linear_gate_norm,
                                         dt_rank=(-(-self.hidden // 16) if self.linear_dt_rank is None else self.linear_dt_rank)
                                         if self.linear_kind == "mamba1" else self.linear_dt_rank,
                                         dt_bc_norm=self.linear_dt_bc_norm, fp8=self.fp8 if fp8 is None else fp8)

    def _check_scales_norms_and_gates(self) -> None:
        """router_scale, moe_latent_norm, expert_out_norm, attn_out_norm, mla_norm_eps and the
        residual gates (the class docstring): ValueError naming what is wrong."""
        for name in ("router_scale", "residual_gate_temperature"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name}: expected a positive finite number, got {value!r}")
        eps = self.mla_norm_eps
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf):
            raise ValueError(f"mla_norm_eps: the latent norms' eps, None or a finite number >= 0, got {eps!r}")
        if eps is not None and self.kv_rank is None and self.q_rank is None:
            raise ValueError(f"mla_norm_eps: the eps of the q and kv latents' norms, needs kv_rank or q_rank (got {eps!r})")
        if self.moe_latent_norm and self.moe_latent is None:
            raise ValueError("moe_latent_norm: the norm of a latent MoE's experts' input, needs moe_latent")
        if self.attn_out_norm and self.kv_rank is not None:
            raise ValueError("attn_out_norm: each grouped-query attention head's output normed, not multi-latent attention's (kv_rank)")
        if self.residual_gates:
            bad = [name for name in ("hyper_connections", "shortcut_moe", "parallel_blocks", "depth_scaled_residual") if getattr(self, name)]
            bad += ["normed_residual"] if self.normed_residual is not None else []
            bad += ["residual_scale"] if self.residual_scale != 1.0 else []
            if bad:
                raise ValueError(f"residual_gates: each residual add weighed by its gate, not with {', '.join(bad)}")

    def _check_norm_overrides(self) -> None:
        """post_norm_eps and norm_overrides (the class docstring): ValueError naming what is wrong."""
        eps = self.post_norm_eps
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf):
            raise ValueError(f"post_norm_eps: expected None or a finite number >= 0, got {eps!r}")
        if eps is not None and not (self.post_norms or self.moe_out_norm):
            raise ValueError("post_norm_eps: the post-norms' eps, needs post_norms (or moe_out_norm)")
        if not isinstance(self.norm_overrides, (tuple, list)):
            raise ValueError(f"norm_overrides: expected a tuple of 'role:kind' strings, got {self.norm_overrides!r}")
        object.__setattr__(self, "norm_overrides", tuple(self.norm_overrides))  # a list from a run's config.json
        roles = []
        for entry in self.norm_overrides:
            role, _, kind = entry.partition(":") if isinstance(entry, str) else ("", "", "")
            if role not in NORM_ROLES or kind not in NORM_KINDS:
                raise ValueError(f"norm_overrides: expected 'role:kind' entries, role one of {', '.join(NORM_ROLES)} and kind one of "
                                 f"{', '.join(NORM_KINDS)}, got {entry!r}")
            if role in roles:
                raise ValueError(f"norm_overrides: the {role} norm's kind is given twice")
            roles.append(role)
        if roles and (self.layer_norms or self.norm_bias or not self.norm_weights):
            raise ValueError("norm_overrides: the kinds of RMSNorms with weights, not with layer_norms, norm_bias or norm_weights=False")
        needs = dict(embed=("embed_norm", self.embed_norm), attn_post=("post_norms", self.post_norms),
                     mlp_post=("post_norms or moe_out_norm", self.post_norms or self.moe_out_norm))
        for role in roles:
            if role in needs and not needs[role][1]:
                raise ValueError(f"norm_overrides: the {role} norm's kind, but the model has no such norm (needs {needs[role][0]})")

    def norm_kind(self, role: Optional[str]) -> Optional[str]:
        """The kind norm_overrides gives the norm of `role` (None: none given, the knobs' own)."""
        for entry in self.norm_overrides:
            name, _, kind = entry.partition(":")
            if name == role:
                return kind
        return None

    def block_norms(self, linear: bool = False) -> tuple[bool, bool]:
        """(pre, post): whether a block has its pre-norms (attn_norm, mlp_norm) and its
        post-norms (attn_post_norm, mlp_post_norm); linear: a linear-attention block (with
        linear_pre_norms a pre-norm block whatever pre_norms and post_norms say)."""
        return (True, False) if linear and self.linear_pre_norms else (self.pre_norms, self.post_norms)

    def attention_config(self, *, local: bool = False, rope: bool = True, fp8: Optional[bool] = None, index_shared: bool = False,
                         index_blocks: bool = True, compress: bool = False, csa: bool = False) -> AttentionConfig:
        """The attention of a block that attends over every earlier token, or with local
        over the sliding window or within its chunk (a config whose window or chunk builds
        that mask too: attention_context); rope=False: a NoPE block's (without q/k norms
        unless nope_qk_norm, with the NoPE temperature); fp8: the block's (None: the model's
        fp8); index_shared: a block of index_shared_layers (no indexer of its own);
        index_blocks=False: a block outside index_block_layers (block-sparse attention's
        knobs left out; the context's config keeps them: its dense mask); compress: a block of
        compress_layers (heavily compressed attention, compress_rate); csa: a block of
        csa_layers (compressed sparse attention: csa_rate, csa_topk, its indexer's heads
        rotated as the keys are)."""
        csa_knobs = dict(compress_rate=self.csa_rate, compress_topk=self.csa_topk, index_heads=self.index_heads, index_head_dim=self.index_head_dim,
                         index_interleaved=self.rope_interleaved, index_rope_last=self.rope_last)
        blocks = dict(index_topk_blocks=self.index_topk_blocks, index_block_size=self.index_block_size,
                      index_local_blocks=self.index_local_blocks) if index_blocks and self.index_topk_blocks is not None else {}
        norm = rope or self.nope_qk_norm
        prefix = "query" if self.query_temperature_floor is not None else "nope"
        fields = dict(ATTENTION_FIELDS, temperature_floor=f"{prefix}_temperature_floor", temperature_scale=f"{prefix}_temperature_scale",
                      local_rot_dim="local_rope_dim" if self.local_rope_dim else "local_head_dim",
                      rot_dim="rope_dim" if self.rope_dim is not None else "head_dim")  # no rope_dim: the whole head turns
        if csa:
            fields.update(compress_rate="csa_rate", compress_topk="csa_topk", index_interleaved="rope_interleaved", index_rope_last="rope_last")
        if local:
            fields.update({name: own for name, own in (("n_heads", "local_heads"), ("n_kv_heads", "local_kv_heads"), ("head_dim", "local_head_dim"))
                           if getattr(self, own) is not None})
        with _named_as(fields, body=dict(rot_dim="rope_dim")):  # the message's rot_dim: the field, None or not
            return AttentionConfig(
                n_heads=self.local_heads if local and self.local_heads is not None else self.n_heads,
                n_kv_heads=self.local_kv_heads if local and self.local_kv_heads is not None else self.n_kv_heads,
                head_dim=self.local_head_dim if local and self.local_head_dim is not None else self.head_dim, rope_base=self.rope_base,
                v_scale=self.value_scale, clip_qkv=self.clip_qkv, v_norm=self.v_norm, out_norm=self.attn_out_norm, k_eq_v=self.global_k_eq_v and not local,
                score_softcap=self.attn_softcap,
                rope_proportion=None if local else self.rope_proportion,
                rot_dim=self.rope_dim, interleaved=self.rope_interleaved, rope_last=self.rope_last, reversed=self.rope_reversed, yarn_factor=self.yarn_factor,
                yarn_original_max_positions=self.yarn_original_max_positions, yarn_beta_fast=self.yarn_beta_fast,
                yarn_beta_slow=self.yarn_beta_slow, yarn_mscale=self.yarn_mscale, yarn_mscale_all_dim=self.yarn_mscale_all_dim,
                yarn_truncate=self.yarn_truncate, llama3_factor=self.llama3_factor, llama3_low_freq_factor=self.llama3_low_freq_factor,
                llama3_high_freq_factor=self.llama3_high_freq_factor, llama3_original_max_positions=self.llama3_original_max_positions,
                linear_factor=self.rope_linear_factor, longrope_short_factors=self.longrope_short_factors, longrope_long_factors=self.longrope_long_factors,
                longrope_original_max_positions=self.longrope_original_max_positions, longrope_short_scale=self.longrope_short_scale,
                longrope_long_scale=self.longrope_long_scale,
                qk_norm=self.qk_norm if norm else None, qk_norm_bias=self.qk_norm_bias and norm, qk_norm_after_rope=self.qk_norm_after_rope and norm,
                norm_eps=self.norm_eps,
                impl=self.impl, q_rank=self.q_rank, kv_rank=self.kv_rank, v_dim=self.v_head_dim, window=self.window if local else None,
                latent_scales=((self.hidden / self.q_rank) ** 0.5, (self.hidden / self.kv_rank) ** 0.5) if self.mla_scales else None,
                q_latent_raw=self.q_latent_raw, gate_on_q=self.attn_gate_on_q, latent_norm_eps=1e-6 if self.mla_norm_eps is None else self.mla_norm_eps,
                chunk=self.chunk if local else None, scale=self.attn_scale, rope=rope,
                **self._temperature(rope),
                local_rope_base=self.local_rope_base, local_rot_dim=self.local_rope_dim or self.local_head_dim,
                local_head_dim=None if local else self.local_head_dim,
                zero_centered_norms=self.zero_centered_norms,
                fp8=self.fp8 if fp8 is None else fp8, gate_act=self.attn_gate_act, gate_per_head=self.attn_gate_per_head,
                index_topk=self.index_topk, **(dict(index_heads=self.index_heads, index_head_dim=self.index_head_dim) if self.index_topk is not None or blocks else {}),
                **({} if csa else dict(index_interleaved=self.index_rope_interleaved, index_rope_last=self.index_rope_last)),
                index_norm_eps=self.index_norm_eps, index_shared=index_shared,
                index_loss=(self.index_topk is not None or bool(blocks) or csa) and self.index_loss_coeff > 0 and not index_shared,
                **blocks, moa_experts=self.moa_experts, moa_topk=self.moa_topk, o_groups=self.o_groups, o_rank=self.o_rank,
                kv_shared=self.kv_shared, **(csa_knobs if csa else dict(compress_rate=self.compress_rate if compress else None)),
            )

    def _temperature(self, rope: bool) -> dict:
        """AttentionConfig's query temperature of a block (with or without RoPE)."""
        if self.query_temperature_floor is not None:  # every block's (Mistral 4)
            return dict(temperature_floor=self.query_temperature_floor, temperature_scale=self.query_temperature_scale, temperature_offset=0)
        return dict(temperature_floor=None if rope else self.nope_temperature_floor, temperature_scale=self.nope_temperature_scale,
                    temperature_kind="log" if rope else self.nope_temperature_kind)

    @property
    def any_sliding(self) -> bool:
        """Whether some trunk block attends over the sliding window."""
        return any(self.is_sliding(i) for i in range(self.n_layers))

    def context_config(self) -> AttentionConfig:
        """The AttentionConfig a micro-batch's AttentionContext is built from: the local blocks'
        (both masks) where some block is local, with the global blocks' head dim and
        proportional RoPE for the global tables (local_head_dim the local tables' width,
        local_rot_dim). DeepSeek-V4's (kv_shared) where Triton runs: the masks' rules
        (MaskRows; attention_context)."""
        cfg = self.attention_config(local=self.any_local)
        if not self.any_local or (self.local_head_dim is None and self.rope_proportion is None):
            return cfg
        return dataclasses.replace(cfg, head_dim=self.head_dim, rope_proportion=self.rope_proportion, local_head_dim=self.local_head_dim)

    @property
    def head_vocab(self) -> int:
        """The output head's rows: out_vocab, or vocab_size."""
        return self.vocab_size if self.out_vocab is None else self.out_vocab

    @property
    def any_local(self) -> bool:
        """Whether some trunk block attends over the sliding window or within its chunk."""
        return any(self.is_local(i) for i in range(self.n_layers))


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim, statistics in float32 (weight=False: no weight,
    x / rms(x) alone: NanoChat's); with zero_centered
    x / rms(x) * (1 + weight), the weight 0 at initialisation (Qwen3-Next's), and with prescaled
    as well the gain first, y / rms(y) for y = x (1 + weight) (Muse Spark's); with centered,
    a LayerNorm: (x - mean(x)) / std(x) * weight (Cohere's, DBRX's), + bias with bias
    (Phi-3.5-MoE's; the bias 0 at initialisation). `sequence_parallel`: set by fmoe.parallel
    under tensor parallelism for the norms inside Blocks (a SequenceShard; None otherwise): x
    is then this rank's token shard, and the weight's (bias's) gradient is summed over the tp
    ranks where it is used."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False, centered: bool = False, bias: bool = False, weight: bool = True,
                 prescaled: bool = False):
        super().__init__()
        if prescaled and (not zero_centered or centered or bias or not weight):
            raise ValueError("prescaled: the gain 1 + weight before the norm (Muse Spark's), needs zero_centered and a weight, no centering or bias")
        self.eps = eps
        self.zero_centered = zero_centered
        self.prescaled = prescaled
        self.centered = centered
        self.weight = None if not weight else nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.sequence_parallel = None

    @classmethod
    def of(cls, cfg: "TransformerConfig", role: Optional[str] = None) -> "RMSNorm":
        """A block's, the final, the embeddings' or an MTP module's norm of the model cfg (its
        layer_norms, norm_bias, zero_centered_norms, norm_weights); role (NORM_ROLES, None:
        another norm): the norm's place, for cfg.norm_overrides and cfg.post_norm_eps."""
        eps = cfg.post_norm_eps if role in ("attn_post", "mlp_post") and cfg.post_norm_eps is not None else cfg.norm_eps
        kind = cfg.norm_kind(role)
        if kind is None:
            return cls(cfg.hidden, eps, cfg.zero_centered_norms, cfg.layer_norms, cfg.norm_bias, cfg.norm_weights)
        return cls(cfg.hidden, eps, zero_centered=kind in ("zero_centered", "prescaled"), weight=kind != "unit", prescaled=kind == "prescaled")

    def forward(self, x):
        sp = self.sequence_parallel
        if self.prescaled:  # the gain first (Muse Spark's input-scaled norm)
            return prescaled_rms_norm(x, self.weight if sp is None else sp.weight(self.weight), self.eps)
        if x.dtype in (torch.bfloat16, torch.float16) and not self.centered:  # the same values, x kept in its own dtype for the backward
            return rms_norm_saving_input(x, None if self.weight is None else self.weight if sp is None else sp.weight(self.weight),
                                         self.eps, zero_centered=self.zero_centered,
                                         bias=None if self.bias is None else self.bias if sp is None else sp.weight(self.bias))
        # float32 statistics whatever x's dtype
        x32 = x.float()
        if self.centered:  # a LayerNorm
            x32 = x32 - x32.mean(-1, keepdim=True)
        y = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            weight = (self.weight if sp is None else sp.weight(self.weight)).float()
            y = y * (weight + 1.0 if self.zero_centered else weight)
        if self.bias is not None:
            y = y + (self.bias if sp is None else sp.weight(self.bias)).float()
        return y.to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """An RMSNorm whose output y is gated by a low-rank function of itself (A.X-K2's
    GatedRMSNorm; TransformerConfig.norm_gate_rank): y * sigmoid(silu(y gate_down) gate_up),
    gate_down [dim, rank] and gate_up [rank, dim], the sigmoid in float32. Under tensor
    parallelism, like an RMSNorm, it runs on this rank's token shard with its weights'
    gradients summed over tp."""

    def __init__(self, dim: int, eps: float, rank: int):
        super().__init__(dim, eps)
        self.gate_down = nn.Parameter(torch.empty(dim, rank))
        self.gate_up = nn.Parameter(torch.empty(rank, dim))
        init_parameters(self, None, prefix="norm")

    def forward(self, x):
        y = super().forward(x)
        sp = self.sequence_parallel
        down, up = (w if sp is None else sp.weight(w) for w in (self.gate_down, self.gate_up))
        gate = F.silu(y @ down.to(y.dtype)) @ up.to(y.dtype)
        return (y * torch.sigmoid(gate.float())).to(y.dtype)


class HyperConnection(KeepsFloat32):
    """The weights of hyper-connections (TransformerConfig.hyper_connections) for one
    attention or MLP over n residual streams x [T, n H] (stream s the columns s H .. (s+1) H),
    or (head=True) the last collapse of the streams before the final norm.

    Per token, in float32: m = (x fn^T) / rms(x) ([T, M], rms over the n H channels, eps
    cfg.norm_eps), split into logits of n pre weights, n post weights and (kind "manifold")
    n x n mixing weights; scale [2] or [3] (one per kind of weight) and base [M]:

        pre  = sigmoid(scale_0 m_pre + base_pre) + eps                  [T, n]
        post = magnitude sigmoid(scale_1 m_post + base_post) (+ eps: "independent")
        comb = Sinkhorn(softmax_rows(scale_2 m_comb + base_comb) + eps) [T, n, n] ("manifold")

    Sinkhorn: columns then rows normalised to sum 1 (each sum + eps), sinkhorn_iters times
    in all, the columns first and last: a doubly stochastic matrix, so the mixing keeps the
    streams' scale. The sublayer reads h = sum_s pre_s x_s [T, H] (forward), and its output
    y [T, H] goes back into every stream (add): x'_s = post_s y + x_s ("independent") or
    post_s y + sum_j comb[j, s] x_j ("manifold"). The head: pre alone (fn [n, n H], base [n],
    scale [1]), h = sum_s pre_s x_s.

    fn [M, n H] (M = 2 n, or 2 n + n^2 with "manifold"), base [M] and scale are float32 and
    stay so when the model is cast, as the router does (their sums need it); the streams
    keep their dtype. Initialised (Transformer.reset_parameters) with fn Normal(0, init_std),
    scale 0.01, the pre bias -log(n - 1) (pre ~ 1/n) and the other biases 0 (post ~
    magnitude / 2, comb ~ uniform): with equal streams and magnitude 2 the block starts near
    a one-stream block (exactly one with the scales and eps 0). `sequence_parallel`: set by
    fmoe.parallel under tensor parallelism for those inside Blocks, which then see this
    rank's token shard (their gradients summed over tp)."""

    _FLOAT32 = ("fn", "base", "scale")

    def __init__(self, cfg: TransformerConfig, *, head: bool = False):
        super().__init__()
        n = cfg.hyper_connections
        self.n, self.hidden, self.head, self.kind = n, cfg.hidden, head, None if head else cfg.hc_kind
        self.eps, self.norm_eps, self.magnitude, self.sinkhorn_iters = cfg.hc_eps, cfg.norm_eps, cfg.hc_magnitude, cfg.hc_sinkhorn_iters
        M = n if head else 2 * n + (n * n if self.kind == "manifold" else 0)
        self.fn = nn.Parameter(torch.empty(M, n * cfg.hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(M, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(1 if head else 3 if self.kind == "manifold" else 2, dtype=torch.float32))
        self.sequence_parallel = None
        init_parameters(self, cfg, prefix="hc_head" if head else "attn_hc")

    def _params(self):
        sp = self.sequence_parallel
        return [p if sp is None else sp.weight(p) for p in (self.fn, self.base, self.scale)]

    def forward(self, x_TS: torch.Tensor):
        """x [T, n H] -> (h [T, H] in x's dtype, post [T, n] float32, comb [T, n, n] float32
        or None); the head: h alone."""
        fn, base, scale = self._params()
        n, H = self.n, self.hidden
        x32 = x_TS.float()
        mix_TM = (x32 @ fn.t()) * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.norm_eps)
        pre_Tn = torch.sigmoid(mix_TM[:, :n] * scale[0] + base[:n]) + self.eps
        h_TH = torch.einsum("tn,tnh->th", pre_Tn, x32.view(-1, n, H)).to(x_TS.dtype)
        if self.head:
            return h_TH
        post_Tn = self.magnitude * torch.sigmoid(mix_TM[:, n:2 * n] * scale[1] + base[n:2 * n])
        if self.kind == "independent":
            return h_TH, post_Tn + self.eps, None
        logits_Tnn = mix_TM[:, 2 * n:].view(-1, n, n) * scale[2] + base[2 * n:].view(n, n)
        comb_Tnn = torch.softmax(logits_Tnn, dim=-1) + self.eps
        comb_Tnn = comb_Tnn / (comb_Tnn.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb_Tnn = comb_Tnn / (comb_Tnn.sum(dim=-1, keepdim=True) + self.eps)
            comb_Tnn = comb_Tnn / (comb_Tnn.sum(dim=-2, keepdim=True) + self.eps)
        return h_TH, post_Tn, comb_Tnn

    def add(self, x_TS: torch.Tensor, y_TH: torch.Tensor, post_Tn: torch.Tensor, comb_Tnn: Optional[torch.Tensor]) -> torch.Tensor:
        """The streams after the sublayer: x [T, n H] and its output y [T, H] with forward's
        post and comb -> [T, n H] in x's dtype (class docstring; float32 sums)."""
        n, H = self.n, self.hidden
        x_TnH = x_TS.float().view(-1, n, H)
        if comb_Tnn is not None:
            x_TnH = torch.einsum("tjs,tjh->tsh", comb_Tnn, x_TnH)
        out = x_TnH + post_Tn[:, :, None] * y_TH.float()[:, None, :]
        return out.reshape(x_TS.shape).to(x_TS.dtype)

    def extra_repr(self) -> str:
        return f"streams={self.n}, hidden={self.hidden}" + (", head" if self.head else f", kind={self.kind}")


class Attention(KeepsFloat32):
    """Parameters of an attention block; forward calls fmoe.layers.attention.

    Owns grouped-query attention's wq, wk, wv, wo (optional biases bq, bk, bv and qk norm
    weights q_norm, k_norm), or multi-latent attention's (fmoe.layers.mla_shapes), and either
    kind's optional output bias bo and attention sinks, under the fmoe.layers names. Under tensor parallelism fmoe.parallel splits the heads over the
    tp ranks and sets `tensor_parallel` (a HeadShard; None otherwise): the weights every
    rank holds whole then get their gradients summed over tp, and a qk norm over the whole
    projection averages its statistic over tp.

    DeepSeek sparse attention (cfg.index_topk) trains its indexer by the indexer's loss
    (fmoe.layers.index_loss), whose gradient times `index_loss_weight` (cfg.index_loss_coeff;
    the loop sets it per step, Transformer.set_index_loss_weight) the backward adds through
    the attention output (fmoe.layers.attach_loss): the model's loss does not include
    it, and only the indexer's weights receive it. `index_loss` keeps the last forward's
    value (detached; None when that forward computed none: no gradients, or no indexer).
    Under tensor parallelism every tp rank computes the whole loss (its target over every
    rank's heads) and attaches 1/tp of it: the indexer's replicated weights sum the ranks'
    gradients. Block-sparse attention (cfg.index_topk_blocks) likewise (fmoe.layers.
    block_index_loss), its indexer's parameters frozen without a loss (index_loss_coeff 0);
    under tensor parallelism each rank attaches its own heads' share, and `index_loss` keeps
    the sum over the ranks.

    A mixture of attention heads (cfg.moa_experts) owns wq [E, H, G D], wo [E, G Dv, H] and
    its router moa_router [H, E] (float32 through casts, as a MoE's router); the router's
    switch loss (stats["moa_aux_loss"]) times `moa_aux_weight` (cfg.moa_aux_coeff; the loop
    sets it per step, Transformer.set_moa_aux_weight) is added in the backward as the
    indexer's is, its value kept in `moa_aux_loss`."""

    _FLOAT32 = ("moa_router", "compress_bias", "index_compress_bias")

    def __init__(self, cfg: TransformerConfig, *, local: bool = False, rope: bool = True, fp8: Optional[bool] = None,
                 index_shared: bool = False, sinks: Optional[bool] = None, index_blocks: bool = True, compress: bool = False, csa: bool = False):
        super().__init__()
        self.cfg = cfg.attention_config(local=local, rope=rope, fp8=fp8, index_shared=index_shared, index_blocks=index_blocks, compress=compress,
                                        csa=csa)
        sinks = cfg.attn_sinks if sinks is None else sinks  # this block's (TransformerConfig.has_sinks)
        # DeepSeek sparse attention: the key of this layer's choice of keys in the context (AttentionContext.index_choices),
        # whether a later block reuses it (then it is left there), and the choice this one reuses (a block of
        # index_shared_layers); set by Transformer
        self.index_key, self.index_keep, self.index_source = id(self), False, None
        self.tensor_parallel = None  # fmoe.parallel's HeadShard under tp > 1 (class docstring)
        self.index_loss_weight, self.index_loss = cfg.index_loss_coeff, None  # DeepSeek sparse attention's indexer loss
        self.moa_aux_weight, self.moa_aux_loss = cfg.moa_aux_coeff, None  # a mixture of attention heads' balance loss
        # ALiBi (cfg.alibi): the slopes of this block's heads, constants computed in forward (the rank's slice under tp),
        # times the softmax scale with cfg.alibi_scaled
        self.alibi_heads = self.cfg.n_heads if cfg.alibi else None
        self.alibi_scale = softmax_scale(self.cfg) if cfg.alibi_scaled else 1.0
        if cfg.kv_rank is not None:  # multi-latent attention: fmoe.layers names and shapes
            self.names = []
            for kind in (*mla_shapes(cfg.hidden, self.cfg), index_shapes(cfg.hidden, self.cfg)):
                for name, shape in kind.items():
                    init = torch.ones if name.endswith("norm") else torch.empty  # norms one at initialisation
                    setattr(self, name, nn.Parameter(init(shape)))
                    self.names.append(name)
            self._extras(cfg, sinks)
            return
        D = self.cfg.head_dim  # this block's head dim (TransformerConfig.layer_head_dim)
        G, Dv = self.cfg.n_kv_heads, cfg.v_head_dim or D  # this block's kv heads; the value head dim
        N = self.cfg.n_heads  # this block's query heads (TransformerConfig.heads)
        H, q, kv = cfg.hidden, N * D, G * D
        E = self.cfg.moa_experts  # a mixture of attention heads: each expert's query and output projections
        if E is None:  # wq [H, N D], or a q latent's wq_a, wq_b and its norm q_a_norm (one at initialisation; DeepSeek-V4's)
            for name, shape in gqa_q_shapes(H, self.cfg).items():
                setattr(self, name, nn.Parameter(torch.empty(shape)))
            if self.cfg.q_rank is not None:
                self.q_a_norm = nn.Parameter(torch.ones(self.cfg.q_rank))
        else:
            self.wq = nn.Parameter(torch.empty(E, H, G * D))
        self.wk = nn.Parameter(torch.empty(H, kv))
        if self.cfg.has_wv:  # else the values are the keys' projection (k_eq_v) or the keys (kv_shared)
            self.wv = nn.Parameter(torch.empty(H, G * Dv))
        self.names = ["wq", "wk", "wv", "wo"] if self.cfg.has_wv else ["wq", "wk", "wo"]
        if self.cfg.q_rank is not None:
            self.names[:1] = ["wq_a", "q_a_norm", "wq_b"]
        if E is None:  # wo [N Dv, H], or the grouped output projection's wo_a and wo (fmoe.layers.out_shapes)
            for name, shape in out_shapes(H, self.cfg).items():
                setattr(self, name, nn.Parameter(torch.empty(shape)))
            self.names += ["wo_a"] if self.cfg.o_groups is not None else []
        else:
            self.wo = nn.Parameter(torch.empty(E, G * Dv, H))
        if E is not None:
            self.moa_router = nn.Parameter(torch.empty(H, E, dtype=torch.float32))
            self.names.append("moa_router")
        if cfg.qkv_bias:  # zero at initialisation (Transformer.reset_parameters)
            self.bq, self.bk = nn.Parameter(torch.empty(q)), nn.Parameter(torch.empty(kv))
            self.names += ["bq", "bk"]
            if self.cfg.has_wv:
                self.bv = nn.Parameter(torch.empty(G * Dv))
                self.names.append("bv")
        norms = qk_norm_shapes(self.cfg)  # one at initialisation ("rms" has no weights, "head_k" k_norm alone)
        for name, shape in norms.items():
            setattr(self, name, nn.Parameter(torch.ones(shape)))
            self.names.append(name)
        for name, shape in norms.items() if self.cfg.qk_norm_bias else ():  # the LayerNorms' biases, zero at initialisation
            setattr(self, name + "_bias", nn.Parameter(torch.zeros(shape)))
            self.names.append(name + "_bias")
        # block-sparse attention's indexer (its norms one at initialisation), trained by its loss alone; frozen without it
        # (index_loss_coeff 0): its choice of blocks has no gradient, and a weight that gets none is none of the optimizer's
        # (nor of FSDP2's reduce-scatter, which would hand it zeros to decay)
        for name, shape in index_shapes(H, self.cfg).items():
            setattr(self, name, nn.Parameter((torch.ones if name.endswith("norm") else torch.empty)(shape), requires_grad=self.cfg.index_loss))
            self.names.append(name)
        for name, shape in compress_shapes(H, self.cfg).items():  # compressed attention's compressor (its bias float32); CSA's indexer
            # trained by its loss alone, frozen without it, as above
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=torch.float32 if name.endswith("compress_bias") else None),
                                             requires_grad=self.cfg.index_loss or not name.startswith("index_")))
            self.names.append(name)
        self._extras(cfg, sinks)

    def _extras(self, cfg: TransformerConfig, sinks: bool) -> None:
        """The output bias bo [H] (o_bias) and the attention sinks [n_heads] (sinks: this
        block's, TransformerConfig.has_sinks), zero at initialisation
        (Transformer.reset_parameters), and the output gate wg [H, n_heads Dv] (attn_gate;
        [H, n_heads] with attn_gate_per_head) with its bias per head bg [n_heads] (attn_gate_bias,
        zero at initialisation), n_heads this block's; then every parameter's start
        (init_parameters)."""
        N = self.cfg.n_heads
        if cfg.o_bias:
            self.bo = nn.Parameter(torch.empty(cfg.hidden))
            self.names.append("bo")
        if sinks:
            self.sinks = nn.Parameter(torch.empty(N))
            self.names.append("sinks")
        if cfg.attn_gate:
            rows = q_in(self.cfg) if cfg.attn_gate_on_q else cfg.hidden  # the gate's input: x, or wq_b's (A.X-K2's)
            self.wg = nn.Parameter(torch.empty(rows, N if cfg.attn_gate_per_head else N * (cfg.v_head_dim or self.cfg.head_dim)))
            self.names.append("wg")
        if cfg.attn_gate_bias:
            self.bg = nn.Parameter(torch.empty(N))
            self.names.append("bg")
        init_parameters(self, cfg, prefix="attn")  # the last of __init__ (both kinds): a model's reset_parameters sets its own start

    def forward(self, x_TH, ctx: AttentionContext):
        params = {n: _local(getattr(self, n)) for n in self.names}
        choice = None
        if self.cfg.index_shared:  # the keys an earlier layer's indexer chose over this context
            choices = ctx.index_choices or {}
            if self.index_source not in choices:
                raise ValueError(f"ctx: block {self.index_key} attends to the keys block {self.index_source} chose (index_shared_layers), which this "
                                 f"forward has not run over this context (a pipeline stage without block {self.index_source}?)")
            choice = choices[self.index_source]
        tp = self.tensor_parallel
        if self.alibi_heads is not None:  # this rank's heads, a contiguous run
            local = self.cfg.n_heads
            first = 0 if tp is None else tp.mesh.get_local_rank() * local
            params["alibi"] = alibi_slopes(self.alibi_heads, device=x_TH.device)[first:first + local] * self.alibi_scale
        if tp is None:
            y_TH, stats = attention(x_TH, params, self.cfg, ctx, index_choice=choice)
        else:
            params.update({n: tp.share(params[n]) if n == "bo" else tp.weight(params[n]) for n in tp.replicated})  # bo: added once
            params = tp.kv_columns(params, self.cfg.head_dim, self.cfg.v_dim or self.cfg.head_dim)  # fewer kv heads than ranks: this rank's
            y_TH, stats = attention(x_TH, params, self.cfg, ctx, heads_mean=tp.mean, index_choice=choice)
        if self.cfg.moa_experts is not None:  # the attention experts' balance: its gradient in the backward, its value kept
            self.moa_aux_loss = None
            if "moa_aux_loss" in stats.keys():
                # under tp every rank routes all T tokens with the whole router and computes the same loss, and the
                # router (replicated, HeadShard.weight) sums the ranks' gradients: each rank attaches its 1/tp
                y_TH = attach_loss(y_TH, stats["moa_aux_loss"] * (self.moa_aux_weight / (1 if tp is None else tp.mesh.size())))
                self.moa_aux_loss = stats["moa_aux_loss"].detach()
        if self.index_keep and ctx.index_choices is not None:  # for the blocks that reuse it
            ctx.index_choices[self.index_key] = stats["index_choice"]
        if self.cfg.index_loss:
            self.index_loss = None
            if "index_loss" in stats.keys():  # the indexer's loss: its gradient in the backward, its value kept
                loss = stats["index_loss"]
                # under tp DeepSeek sparse attention's (and CSA's) every rank computes the same loss, and the indexer's weights
                # (replicated, HeadShard.weight) sum the ranks' gradients: each rank attaches its 1/tp; block-sparse
                # attention's each rank its own heads' share, whole, their sum the value kept
                blocks = self.cfg.index_topk_blocks is not None
                weight = self.index_loss_weight / (1 if tp is None or blocks else tp.mesh.size())
                y_TH = attach_loss(y_TH, loss * weight)
                loss = loss.detach()
                self.index_loss = tp.sum(loss.reshape(1, 1)).reshape(()) if blocks and tp is not None else loss
        return y_TH


class LinearAttention(nn.Module):
    """Parameters of a Gated DeltaNet block's mixer (linear attention); forward calls
    fmoe.layers.linear_attention. Owns wq, wk [H, Nk Dk], wv, wz [H, Nv Dv], wb, wa [H, Nv],
    the convolution's taps conv_q, conv_k [K, Nk Dk], conv_v [K, Nv Dv], A_log, dt_bias
    [Nv], the gated output norm out_norm [Dv] and wo [Nv Dv, H] (linear_attention_shapes;
    Kimi Delta Attention's, linear_kind "kda": wf_a, wf_b, wz_a, wz_b, dt_bias [N Dk] instead
    of wa, wz and dt_bias [Nv] (linear_full_rank: wf, wz [H, N D]); LFM2's short convolution's, "short_conv": wb, wc, wv [H, C],
    conv_v [K, C], wo [C, H]; Mamba-2's, "mamba2": wa its dt, the convolutions' biases conv_q_bias,
    conv_k_bias, conv_v_bias, and D [Nv]; lightning attention's, "lightning": wq, wk, wv, wz, out_norm [N D], wo)."""

    def __init__(self, cfg: TransformerConfig, *, fp8: Optional[bool] = None, layer: int = 0):
        super().__init__()
        self.cfg = cfg.linear_attention_config(fp8)
        self.tensor_parallel = None  # fmoe.parallel's HeadShard under tp > 1 (LinearAttentionParallel)
        # lightning attention's decay: a constant of the block's depth and every head (the rank's slice under tp)
        self.layer, self.n_layers, self.heads = layer, cfg.n_layers, self.cfg.n_v_heads
        self.names = []
        for name, shape in linear_attention_shapes(cfg.hidden, self.cfg).items():
            setattr(self, name, nn.Parameter(torch.ones(shape) if name == "out_norm" else torch.empty(shape)))
            self.names.append(name)
        init_parameters(self, cfg, prefix="attn")

    def forward(self, x_TH, ctx: AttentionContext):
        params = {n: _local(getattr(self, n)) for n in self.names}
        heads_mean = heads_sum = None
        if self.tensor_parallel is not None:  # the output norm's weight (and KDA's down projections): every rank's heads use them
            params.update({n: self.tensor_parallel.weight(params[n]) for n in self.tensor_parallel.replicated})
            heads_mean = self.tensor_parallel.mean if self.cfg.kind == "lightning" else None  # its norm spans every head
            heads_sum = self.tensor_parallel.sum if self.cfg.kind == "mamba1" else None  # its dt, B and C read every channel
        if self.cfg.kind == "lightning":
            local = self.cfg.n_v_heads  # this rank's heads, a contiguous run
            first = 0 if self.tensor_parallel is None else self.tensor_parallel.mesh.get_local_rank() * local
            params["decay"] = lightning_decay(self.heads, self.layer, self.n_layers, device=x_TH.device)[first:first + local]
        return linear_attention(x_TH, params, self.cfg, ctx, heads_mean=heads_mean, heads_sum=heads_sum)[0]


class ResidualGate(KeepsFloat32):
    """A residual add weighed channel by channel by a learned gate (Muse Spark's
    post_attention_residual_gate / post_feedforward_residual_gate; TransformerConfig.residual_gates):
    for the stream x and the sublayer's output y [T, H], in float32,

        w = gate / temperature,  beta = sigmoid(w),  alpha = sqrt(max(sigmoid(-w) (1 + beta), eps))
        x' = alpha x + beta y    (in x's dtype)

    gate [H] float32 (it stays so when the model is cast, as the router does), Normal(0,
    init_std) at initialisation (Transformer.reset_parameters): beta near 1/2, alpha near
    sqrt(3)/2. eps 1e-3 (Muse Spark's). `sequence_parallel`: set by fmoe.parallel under tensor
    parallelism (x is then this rank's token shard; the gate's gradient summed over tp)."""

    _FLOAT32 = ("gate",)

    def __init__(self, hidden: int, temperature: float, eps: float = 1e-3):
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(hidden, dtype=torch.float32))
        self.temperature, self.eps = temperature, eps
        self.sequence_parallel = None

    def forward(self, x_TH: torch.Tensor, y_TH: torch.Tensor) -> torch.Tensor:
        gate = self.gate if self.sequence_parallel is None else self.sequence_parallel.weight(self.gate)
        w = gate.float() / self.temperature
        beta = torch.sigmoid(w)
        alpha = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1.0 + beta), min=self.eps))
        return (alpha * x_TH.float() + beta * y_TH.float()).to(x_TH.dtype)


class Block(nn.Module):
    """Residual block: attention (over cfg.window or within cfg.chunk with local; without RoPE unless rope;
    Gated DeltaNet's linear attention with linear),
    then a dense SwiGLU or an MoE; each branch x + post_norm(f(pre_norm(x))) (with
    cfg.normed_residual a: a pre_norm(x) + post_norm(f(pre_norm(x))), MiniMax's), with the
    pre-norms attn_norm / mlp_norm and the post-norms attn_post_norm / mlp_post_norm
    (cfg.block_norms: pre_norms and post_norms, a linear block's with linear_pre_norms;
    mlp_post_norm also with cfg.moe_out_norm in a MoE block),
    each an RMSNorm or absent (None). fp8: its GEMMs in fp8
    (None: cfg.fp8; TransformerConfig.is_fp8). shortcut (cfg.shortcut_moe;
    TransformerConfig.shortcut): "out", a pair's first block: its MLP input also feeds a
    dense SwiGLU `dense` of cfg.ffn_dense, added here, while the MoE's output is handed on
    beside the residual (its output [T, 2H]); "in", the pair's second: its input [T, 2H],
    it adds the MoE's output after its MLP's. With cfg.hyper_connections n its input and
    output are the n streams [T, n H]: the attention and the MLP each read their weighted
    sum and add their output back (HyperConnection: attn_hc, mlp_hc). mlp=False: the
    attention alone (cfg.mlp_free_layers; mlp, mlp_norm, mlp_post_norm and mlp_hc None);
    a linear block of cfg.parallel_hybrid also holds softmax attention, attn_beside, whose
    output is added to its linear mixer's (None in every other block);
    mixer=False: the MLP alone (cfg.mixer_free_layers; attn, attn_norm, attn_post_norm and
    attn_hc None)."""

    def __init__(self, cfg: TransformerConfig, moe: bool, *, local: bool = False, rope: bool = True, linear: bool = False,
                 fp8: Optional[bool] = None, index_shared: bool = False, sinks: Optional[bool] = None, shortcut: Optional[str] = None,
                 depth: Optional[int] = None, mlp: bool = True, mixer: bool = True, index_blocks: bool = True, hashed: bool = False,
                 compress: bool = False, csa: bool = False):
        super().__init__()
        def norm(on: bool, gated: bool = False, role: Optional[str] = None) -> Optional[RMSNorm]:
            if not on:
                return None
            return GatedRMSNorm(cfg.hidden, cfg.norm_eps, cfg.norm_gate_rank) if gated and cfg.norm_gate_rank else RMSNorm.of(cfg, role)

        if not mixer and not mlp:
            raise ValueError("mixer / mlp: a block holds a mixer, an MLP or both, got neither")
        pre, post = cfg.block_norms(linear)
        self.attn_norm, self.attn_post_norm = norm(mixer and pre, gated=True), norm(mixer and post, role="attn_post")
        fp8 = cfg.fp8 if fp8 is None else fp8
        if not mixer:  # the MLP alone (cfg.mixer_free_layers: Nemotron-H's MLP layers with no mixer layer before them)
            self.attn = None
        elif linear:
            self.attn = LinearAttention(cfg, fp8=fp8, layer=depth or 0)
        else:
            self.attn = Attention(cfg, local=local, rope=rope, fp8=fp8, index_shared=index_shared, sinks=sinks, index_blocks=index_blocks,
                                  compress=compress, csa=csa)
        # cfg.parallel_hybrid: softmax attention beside the linear mixer, of the same normed input, the outputs summed (Falcon-H1's)
        self.attn_beside = Attention(cfg, local=local, rope=rope, fp8=fp8, sinks=sinks) if linear and mixer and cfg.parallel_hybrid else None
        # a parallel block's MLP reads the attention's normed input (attn_norm)
        self.mlp_norm = norm(mlp and pre and (not cfg.parallel_blocks or cfg.parallel_norms), gated=moe)
        self.mlp_post_norm = norm(mlp and (post or (moe and cfg.moe_out_norm)), role="mlp_post")
        self.parallel = cfg.parallel_blocks
        if moe and not mlp:
            raise ValueError("mlp: a MoE block has an MLP (mlp=False: the mixer alone)")
        if hashed and not moe:
            raise ValueError("hashed: a MoE block's routing by its tokens' ids, needs moe=True")
        dense_limit = cfg.mlp_limit(depth)  # the dense MLPs' SwiGLU clamp: the shared experts' (shared_swiglu_limit)
        glu = dict(alpha=cfg.shared_swiglu_alpha, offset=cfg.shared_swiglu_offset)  # ... and their gate's gain, up's offset
        if not mlp:  # the mixer alone (cfg.mlp_free_layers: Nemotron-H's mixer layers without an MLP after them)
            self.mlp = None
        elif moe:
            self.mlp = MoE(cfg.hidden, cfg.ffn_expert, cfg.moe_config(fp8, depth), shared_ffn=cfg.shared_size, shared_gate=cfg.shared_gate,
                           expert_bias=cfg.expert_bias and not hashed, hash_vocab=cfg.vocab_size if hashed else 0, router_bias=cfg.router_bias, expert_biases=cfg.expert_biases,
                           router_norm=cfg.router_norm, expert_scale=cfg.router_expert_scale, latent=cfg.moe_latent or 0,
                           latent_norm=cfg.moe_latent_norm, expert_out_norm=cfg.expert_out_norm, out_bias=cfg.moe_out_bias)
            self.mlp.experts.recompute = cfg.ac == "experts"
        else:
            self.mlp = DenseMLP(cfg.hidden, cfg.ffn_dense, cfg.impl, fp8=fp8, act=cfg.mlp_act, bias=cfg.mlp_bias, limit=dense_limit, **glu)
        if shortcut not in (None, "out", "in") or (shortcut is not None and (not cfg.shortcut_moe or (shortcut == "out") != moe)):
            raise ValueError(f"shortcut: expected None, or with cfg.shortcut_moe 'out' (a MoE block) or 'in' (a dense one), got {shortcut!r}")
        self.shortcut = shortcut
        self.dense = DenseMLP(cfg.hidden, cfg.ffn_dense, cfg.impl, fp8=fp8, act=cfg.mlp_act, limit=dense_limit, **glu) if shortcut == "out" else None
        # Gemma 4's MoE blocks: a dense MLP beside the MoE, its output normed by dense_post_norm, the MoE's input by
        # moe_norm and its output by moe_post_norm (TransformerConfig.dense_beside_moe)
        self.beside = DenseMLP(cfg.hidden, cfg.ffn_dense, cfg.impl, fp8=fp8, act=cfg.mlp_act, limit=dense_limit, **glu) if moe and cfg.dense_beside_moe else None
        if self.beside is not None:
            self.dense_post_norm, self.moe_norm, self.moe_post_norm = (RMSNorm.of(cfg) for _ in range(3))
        if cfg.layer_scalars:  # Gemma 4's scale of the block's output (a checkpoint's constant, not trained)
            self.register_buffer("layer_scalar", torch.ones(1), persistent=True)
        self.ac = cfg.ac
        self.residual_scale = cfg.residual_scale
        if cfg.depth_scaled_residual and depth is None:
            raise ValueError("depth: the block's index in the trunk, needed with cfg.depth_scaled_residual")
        # depth_scaled_residual: (the residual's, the branch's) weights of the attention's add and of the MLP's, the 2i + 2-th and 2i + 3-th adds
        self.residual_weights = ([(((n - 1) / n) ** 0.5, n ** -0.5) for n in (2 * depth + 2, 2 * depth + 3)]
                                 if cfg.depth_scaled_residual else None)
        # Muse Spark's residual gates: each add weighed channel by channel (ResidualGate)
        self.attn_residual_gate = ResidualGate(cfg.hidden, cfg.residual_gate_temperature) if cfg.residual_gates and mixer else None
        self.mlp_residual_gate = ResidualGate(cfg.hidden, cfg.residual_gate_temperature) if cfg.residual_gates and mlp else None
        self.normed_residual = cfg.normed_residual  # (the normed residual's, the branch's) weights of both adds
        if cfg.normed_residual is not None:
            self.residual_weights = [(cfg.normed_residual, cfg.residual_scale)] * 2
        # hyper-connections: the attention's and the MLP's weights over the streams
        self.attn_hc = HyperConnection(cfg) if cfg.hyper_connections and mixer else None
        self.mlp_hc = HyperConnection(cfg) if cfg.hyper_connections and mlp else None

    def forward(self, x_TH, ctx: AttentionContext, token_mask: Optional[torch.Tensor] = None, token_ids: Optional[torch.Tensor] = None):
        """x [T, H] -> (x [T, H], the MoE stats or None for a dense block); a shortcut pair's
        first block returns [T, 2H] and its second takes it, and with hyper-connections x is
        the streams [T, n H] in and out (class docstring). token_mask:
        None, or [T] bool, False on padding, which the MoE does not route (MoE.forward).
        token_ids: [T] the tokens' ids, which a hashed MoE block routes by (MoE.forward; needed
        there, unread elsewhere)."""
        if self.ac == "full":
            return recompute(self._block, x_TH, ctx, token_mask, token_ids)
        return self._block(x_TH, ctx, token_mask, token_ids)

    def _attend(self, x_TH, ctx):
        return self._attend_normed(_normed(self.attn_norm, x_TH), ctx)

    def _attend_normed(self, h_TH, ctx):
        y_TH = self.attn(h_TH, ctx)
        if self.attn_beside is not None:  # a parallel hybrid's attention beside the linear mixer
            y_TH = y_TH + self.attn_beside(h_TH, ctx)
        return _normed(self.attn_post_norm, y_TH)

    def _residual(self, x_TH, y_TH, add: int = 0):
        """x + y (y x residual_scale); with depth_scaled_residual the block's add-th (0: the
        attention's, 1: the MLP's) weighted sum of the two; with residual_gates its gate's
        (ResidualGate)."""
        if self.residual_weights is not None:
            keep, branch = self.residual_weights[add]
            return x_TH * keep + y_TH * branch
        gate = self.mlp_residual_gate if add else self.attn_residual_gate
        if gate is not None:  # Muse Spark's: weighed channel by channel
            return gate(x_TH, y_TH)
        return x_TH + (y_TH if self.residual_scale == 1.0 else y_TH * self.residual_scale)

    def _block(self, x_TH, ctx, token_mask=None, token_ids=None):
        routing = (token_mask, token_ids)  # what the MoE reads of the tokens (MoE.forward)
        if self.attn_hc is not None or self.mlp_hc is not None:
            return self._hc_block(x_TH, ctx, routing)
        if self.attn is None:  # the MLP alone
            return self._mlp_branch(x_TH, _normed(self.mlp_norm, x_TH), routing)
        carry_TH = None
        if self.shortcut == "in":  # the residual, then the pair's MoE output
            x_TH, carry_TH = x_TH.chunk(2, dim=-1)
        if self.parallel:  # attention and MLP of one normed input (or each of its own, parallel_norms: GPT-NeoX's), both added to x (Cohere's)
            h_TH = _normed(self.attn_norm, x_TH)
            y_TH = recompute(self._attend_normed, h_TH, ctx) if self.ac == "attention" else self._attend_normed(h_TH, ctx)
            return self._mlp_branch(self._residual(x_TH, y_TH), h_TH if self.mlp_norm is None else self.mlp_norm(x_TH), routing)
        if self.normed_residual is not None:  # MiniMax's: each residual is its sublayer's normed input, x a
            h_TH = self.attn_norm(x_TH)
            x_TH = self._residual(h_TH, recompute(self._attend_normed, h_TH, ctx) if self.ac == "attention" else self._attend_normed(h_TH, ctx))
            h_TH = x_TH if self.mlp is None else self.mlp_norm(x_TH)
            return self._mlp_branch(h_TH, h_TH, routing, carry_TH)
        x_TH = self._residual(x_TH, recompute(self._attend, x_TH, ctx) if self.ac == "attention" else self._attend(x_TH, ctx))
        return self._mlp_branch(x_TH, _normed(self.mlp_norm, x_TH), routing, carry_TH)

    def _hc_block(self, x_TS, ctx, routing=(None, None)):
        """With hyper-connections: the streams x [T, n H] -> (x' [T, n H], the MoE stats or
        None); the attention and the MLP each read their weighted sum of the streams and add
        their output back (HyperConnection)."""
        if self.attn is not None:
            h_TH, post, comb = self.attn_hc(x_TS)
            y_TH = recompute(self._attend, h_TH, ctx) if self.ac == "attention" else self._attend(h_TH, ctx)
            x_TS = self.attn_hc.add(x_TS, y_TH, post, comb)
        if self.mlp is None:
            return x_TS, None
        h_TH, post, comb = self.mlp_hc(x_TS)
        y_TH, stats = self._mlp_out(_normed(self.mlp_norm, h_TH), routing)
        return self.mlp_hc.add(x_TS, y_TH, post, comb), stats

    def _mlp_out(self, h_TH, routing=(None, None), x_TH=None):
        """post_norm(mlp(h)) [T, H] of the MLP's input h, and the MoE stats (None for a dense MLP);
        beside a dense MLP (dense_beside_moe), post_norm(dense_post_norm(dense(h)) +
        moe_post_norm(moe(moe_norm(x)))), the router reading the block's stream x itself.
        routing: (token_mask, token_ids), MoE.forward's."""
        token_mask, token_ids = routing
        if self.beside is not None:
            y, stats = self.mlp(self.moe_norm(x_TH), token_mask, route_x=x_TH, token_ids=token_ids)
            return self.mlp_post_norm(self.dense_post_norm(self.beside(h_TH)) + self.moe_post_norm(y)), stats
        if isinstance(self.mlp, MoE):
            y, stats = self.mlp(h_TH, token_mask, token_ids=token_ids)
            return _normed(self.mlp_post_norm, y), stats
        return _normed(self.mlp_post_norm, self.mlp(h_TH)), None

    def _mlp_branch(self, x_TH, h_TH, routing=(None, None), carry_TH=None):
        """x + post_norm(mlp(h)): the block's end, h the MLP's input (its own pre-norm's output,
        or a parallel block's one normed input) -> (x [T, H], the MoE stats or None); a
        shortcut pair's first block: ([x + dense(h) | moe(h)] [T, 2H], stats; no post-norms
        there); its second adds carry [T, H], the pair's MoE output, last. A block without
        an MLP (mlp None) ends at x."""
        if self.mlp is None:
            return x_TH, None
        y_TH, stats = self._mlp_out(h_TH, routing, x_TH)
        if self.dense is not None:
            return torch.cat([x_TH + self.dense(h_TH), y_TH], dim=-1), stats
        x_TH = self._residual(x_TH, y_TH, 1)
        if "layer_scalar" in self._buffers:  # Gemma 4's: the whole stream
            x_TH = x_TH * self.layer_scalar.to(x_TH.dtype)
        return (x_TH if carry_TH is None else x_TH + carry_TH), stats


def _normed(norm: Optional[RMSNorm], x_TH: torch.Tensor) -> torch.Tensor:
    return x_TH if norm is None else norm(x_TH)


class MTPModule(nn.Module):
    """h' = W_proj [norm(emb); norm(h)], then one block (SPEC.md 5)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.emb_norm = RMSNorm.of(cfg)
        self.hidden_norm = RMSNorm.of(cfg)
        self.proj = nn.Parameter(torch.empty(2 * cfg.hidden, cfg.hidden))
        self.block = Block(cfg, moe=any(cfg.is_moe(i) for i in range(cfg.n_layers)), fp8=cfg.is_fp8(None), sinks=cfg.has_sinks(None))
        self.out_norm = RMSNorm.of(cfg) if cfg.mtp_norm else None
        init_parameters(self, cfg, prefix="mtp.0", recurse=False)  # proj (the block's own are the block's)

    def forward(self, emb_TH, h_TH, ctx: AttentionContext, token_mask: Optional[torch.Tensor] = None):
        x_TH = torch.cat([self.emb_norm(emb_TH), self.hidden_norm(h_TH)], dim=-1) @ self.proj
        return self.block(x_TH, ctx, token_mask)


@dataclasses.dataclass(frozen=True)
class BatchContext:
    """What depends only on a micro-batch, built once per micro-batch (Transformer.context)
    and passed to every layer. attention[0]: the trunk's AttentionContext; attention[d]:
    MTP depth d's (its own positions, the trunk's mask)."""

    attention: tuple[AttentionContext, ...]


@dataclasses.dataclass(frozen=True)
class PipelineChunk:
    """The part of the model one pipeline chunk holds (set by fmoe.parallel.pipeline_chunk):
    stage `stage` of `n_stages` (counting virtual stages), trunk blocks `layers`; the first
    stage also holds the embedding, the last the final norm, the head and the MTP modules
    (and a copy of the embedding when there are MTP modules)."""

    stage: int
    n_stages: int
    layers: range

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.n_stages - 1


class LayerElsewhere(nn.Module):
    """Stands in a pipeline chunk for a trunk block another stage holds (keeping every
    block's index, so parameter names are the whole model's); no parameters, never run."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"block {self.index} is held by another pipeline stage")

    def extra_repr(self) -> str:
        return f"block {self.index}: another stage"


class KVCache:
    """The keys and values of the tokens so far of `batch` sequences, per trunk layer: what
    Transformer.decode attends over and appends to, so that a new token costs one token's
    forward pass rather than the whole sequence's.

    k [n_full, batch * max_tokens, G, D], v [n_full, batch * max_tokens, G, Dv] for the
    n_full layers that attend over every earlier token (G = n_kv_heads, D = head_dim, Dv =
    v_head_dim or head_dim; a store whose layers differ in kv heads, local_kv_heads, holds
    the most, each layer using its first TransformerConfig.kv_heads(i)),
    keys after RoPE: sequence b owns the rows [b max_tokens, (b + 1) max_tokens), of which
    the first lengths[b] are filled. The sliding-window layers (cfg.window narrower than
    max_tokens) keep only the window: k_window / v_window [n_window, batch * window, G, D],
    a ring in which sequence b's token at position p sits in row b window + p % window, so
    their memory does not grow with the sequence (gpt-oss: half the layers, a window of 128).
    Chunked layers (cfg.chunk narrower than max_tokens) keep a ring of one chunk alike, `window`
    being the chunk: the keys a query sees, those of its own chunk up to itself, are among
    the newest chunk-many (Llama 4: three layers in four, chunks of 8192).
    `full_layers` and `window_layers` list the layers of each store. Linear-attention layers
    (cfg.linear_layers, Gated DeltaNet) keep a state of fixed size instead, `linear_layers`:
    conv [n_linear, batch, K - 1, 2 Nk Dk + Nv Dv] (the last K - 1 tokens' q, k, v
    projections, which the causal convolution reads; a short convolution's: its Nv Dv gated
    inputs) and state [n_linear, batch, Nv, Dk, Dv] (float32, the gated delta rule's; a
    short convolution leaves it as it is): a sequence there continues from its last token or
    restarts from 0, never goes back (decode refuses it). Multi-latent attention
    keeps its latents instead (AttentionContext.latents): k [.., 1, kv_rank + rope_dim] (the
    normed latent, then the rotated key) and v = k[..., :kv_rank], a view: kv_rank + rope_dim
    numbers per token and layer where the expanded keys and values would take n_heads
    (head_dim + v_head_dim). Shared key-value heads (cfg.kv_shared) keep the keys alone, v a
    view of k (the values are the keys): half a GQA cache's bytes; with DeepSeek sparse attention (cfg.index_topk) each row also
    holds the token's indexer key, its last index_head_dim channels. Make one with Transformer.kv_cache (the model's device and
    dtype), or here for a TransformerConfig. `length` is the one sequence's length of a
    cache of batch 1; setting it (or reset()) starts over. With sliding-window layers a
    sequence goes back one token at most (the token's row held a key out of its window), or
    starts over from 0: the ring no longer holds the keys a shorter length needs, and
    decode refuses it. A model whose LongRoPE switches (TransformerConfig.longrope_switches)
    also keeps each sequence's token ids, tokens [batch, max_tokens] int64 (None otherwise):
    decode recomputes a sequence from them when it grows past the original positions (or
    continues within them after going back from past them).
    Heavily compressed attention layers (cfg.compress_layers, `compress_layers`) also keep
    each sequence's compressed entries, entries [n_compress, batch * (max_tokens // m), D]
    (sequence b's runs in rows b (max_tokens // m) + j), and its open run's compressor inputs,
    run [n_compress, batch, m, 2 D] (c | g of positions m floor(L / m) .. L - 1): a sequence
    continues from its last token or restarts from 0, never goes back (decode refuses it).
    Compressed sparse attention layers (cfg.csa_layers, `csa_layers`, runs of m = csa_rate)
    keep each sequence's entries beside its indexer's, csa_entries [n_csa, batch * (max_tokens
    // m), D + index_head_dim], and both compressors' inputs of its last complete run and its
    open run, csa_run [n_csa, batch, 2 m, 2 W] (c | g, W = 2 D + 2 index_head_dim; positions
    m (floor(L / m) - 1) .. L - 1: an entry overlaps the run before it); likewise never back.
    """

    def __init__(self, cfg: TransformerConfig, max_tokens: int, *, batch: int = 1, device=None, dtype: torch.dtype = torch.float32):
        check_positive_int("max_tokens", max_tokens)
        check_positive_int("batch", batch)
        # v is k's latent (multi-latent attention), or k itself (kv_shared: the values are the keys): written with k
        self.v_in_k = cfg.kv_rank is not None or cfg.kv_shared
        self.window_layers = self.ring_layers(cfg, max_tokens)
        self.window = self.ring_length(cfg) if self.window_layers else None  # the sliding window, or the chunk
        self.linear_layers = tuple(i for i in range(cfg.n_layers) if cfg.is_linear(i))
        self.full_layers = tuple(i for i in range(cfg.n_layers) if i not in self.window_layers and cfg.attends(i))
        self.mixer_free_layers = tuple(i for i in range(cfg.n_layers) if cfg.is_mixer_free(i))  # nothing cached
        # each layer's kv heads (TransformerConfig.kv_heads; one latent row under multi-latent attention); a store whose
        # layers differ in them holds the most, a layer using its first ones
        self.heads = {i: cfg.kv_heads(i) if cfg.kv_rank is None else 1 for i in range(cfg.n_layers)}
        # each layer's key and value channels per head (TransformerConfig.layer_head_dim: local_head_dim's layers have
        # fewer); a store whose layers differ in them holds the most, a layer using its first ones
        if cfg.kv_rank is None:  # block-sparse attention's blocks: the indexer's key too, its channels spread over the kv heads
            extra = {i: -(-cfg.index_head_dim // cfg.kv_heads(i)) if cfg.is_index_blocks(i) else 0 for i in range(cfg.n_layers)}
            self.dims = {i: (cfg.layer_head_dim(i) + extra[i], cfg.v_head_dim or cfg.layer_head_dim(i)) for i in range(cfg.n_layers)}
        else:  # the latent is both the key's first kv_rank channels and the value (then DSA's indexer key)
            self.dims = dict.fromkeys(range(cfg.n_layers), (cfg.kv_rank + cfg.rope_dim + (cfg.index_head_dim if cfg.index_topk is not None else 0),
                                                            cfg.kv_rank))
        for store, layers, rows in (("", self.full_layers, batch * max_tokens), ("_window", self.window_layers, batch * (self.window or 0))):
            heads = max((self.heads[i] for i in layers), default=1)
            D, v_dim = (max((self.dims[i][j] for i in layers), default=self.dims[0][j]) for j in (0, 1))
            k, v = self._store(len(layers), rows, (heads, D), v_dim, self.v_in_k, device, dtype)
            setattr(self, "k" + store, k)
            setattr(self, "v" + store, v)
        lin = cfg.linear_attention_config()
        self.conv = torch.zeros(len(self.linear_layers), batch, lin.conv - 1, lin.conv_channels, device=device, dtype=dtype)
        self.state = torch.zeros(len(self.linear_layers), batch, lin.n_v_heads, lin.k_head_dim, lin.v_head_dim, device=device)
        self.max_tokens, self.batch = max_tokens, batch
        # heavily compressed attention layers: each sequence's entries (max_tokens // m rows) and its open run's c | g
        self.compress_layers, self.compress_rate = tuple(i for i in range(cfg.n_layers) if cfg.is_compressed(i)), cfg.compress_rate
        n_c, m, D = len(self.compress_layers), cfg.compress_rate, cfg.head_dim
        self.entries = torch.zeros(n_c, batch * (max_tokens // m), D, device=device, dtype=dtype)
        self.run = torch.zeros(n_c, batch, m, 2 * D, device=device, dtype=dtype)
        # compressed sparse attention layers: each sequence's entries beside its indexer's (max_tokens // m rows), and the c | g
        # of its last complete run and its open run (both compressors' inputs)
        self.csa_layers, self.csa_rate = tuple(i for i in range(cfg.n_layers) if cfg.is_csa(i)), cfg.csa_rate
        n_s, m_s, W = len(self.csa_layers), cfg.csa_rate, 2 * cfg.head_dim + 2 * cfg.index_head_dim
        self.csa_entries = torch.zeros(n_s, batch * (max_tokens // m_s), D + cfg.index_head_dim, device=device, dtype=dtype)
        self.csa_run = torch.zeros(n_s, batch, 2 * m_s, 2 * W, device=device, dtype=dtype)
        self.tokens = torch.zeros(batch, max_tokens, dtype=torch.int64, device=device) if cfg.longrope_switches else None
        self.lengths = [0] * batch
        # each sequence's length after its last decode call, what the rings and the linear states hold: a ring layer's
        # sequence goes back one token at most, a linear layer's none
        self.decoded_lengths = [0] * batch

    @property
    def dtype(self) -> torch.dtype:
        """What its keys, values and linear layers' conv inputs are stored in: the model's compute dtype (model.kv_cache)."""
        return self.conv.dtype

    @property
    def n_layers(self) -> int:
        """The model's layers this cache serves: those with a store or states, and those without a mixer (nothing cached)."""
        return len({*self.full_layers, *self.window_layers, *self.linear_layers, *self.mixer_free_layers})  # a parallel hybrid's in two

    @staticmethod
    def ring_layers(cfg: TransformerConfig, max_tokens: int) -> tuple[int, ...]:
        """The layers whose cache of max_tokens tokens per sequence is a ring: the sliding-window
        (or chunked) layers, when the window (the chunk) is narrower than max_tokens."""
        length = KVCache.ring_length(cfg)
        return tuple(i for i in range(cfg.n_layers) if length is not None and length < max_tokens and cfg.is_local(i))

    @staticmethod
    def ring_length(cfg: TransformerConfig) -> Optional[int]:
        """The rows per sequence of a local layer's ring: the sliding window, or the chunk (None: neither)."""
        return cfg.window if cfg.window is not None else cfg.chunk

    @staticmethod
    def _store(n_layers: int, rows: int, row: tuple, v_dim: int, v_in_k: bool, device, dtype):
        k = torch.zeros(n_layers, rows, *row, device=device, dtype=dtype)
        return k, (k[..., :v_dim] if v_in_k else torch.zeros(n_layers, rows, row[0], v_dim, device=device, dtype=dtype))

    @property
    def nbytes(self) -> int:
        """The bytes the cache holds (keys and values of every layer and sequence)."""
        stores = (self.k, self.k_window) if self.v_in_k else (self.k, self.v, self.k_window, self.v_window)
        tokens = () if self.tokens is None else (self.tokens,)
        return sum(t.numel() * t.element_size() for t in (*stores, self.conv, self.state, self.entries, self.run, self.csa_entries,
                                                                 self.csa_run, *tokens))

    @property
    def length(self) -> int:
        """The filled tokens of the one sequence (a cache of batch 1)."""
        return self.lengths[self._only()]

    @length.setter
    def length(self, value: int) -> None:
        self.lengths[self._only()] = value

    def _only(self) -> int:
        """0, the one sequence's index; ValueError for a cache of several."""
        if self.batch != 1:
            raise ValueError(f"cache.length: the cache holds {self.batch} sequences; use cache.lengths[b]")
        return 0

    def reset(self, seqs=None) -> None:
        """Start the sequences `seqs` (default: all; an int, or a list of them) over, empty
        (their rows are overwritten as they fill again)."""
        seq_list = list(range(self.batch)) if seqs is None else [seqs] if isinstance(seqs, int) and not isinstance(seqs, bool) else seqs
        if not isinstance(seq_list, (list, tuple, range)) or any(isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self.batch
                                                                 for b in seq_list):
            raise ValueError(f"seqs: expected None, or sequence indices in [0, {self.batch}) (an int or a list of them), got {seqs!r}")
        for b in seq_list:
            self.lengths[b] = 0

    def _check_new(self, layer: int, k_TGD: torch.Tensor, v_TGD: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor) -> None:
        for name, new, cached, dim in (("k", k_TGD, k_store, self.dims[layer][0]), ("v", v_TGD, v_store, self.dims[layer][1])):
            row = (self.heads[layer], dim)  # the layer's heads and channels of the store's
            if tuple(new.shape[1:]) != row or new.dtype != cached.dtype or new.device != cached.device:
                raise ValueError(f"cache.{name}: holds {cached.dtype} [.., {', '.join(map(str, row))}] for layer {layer} on {cached.device}, "
                                 f"the layer gave {new.dtype} {list(new.shape)} on {new.device} (make the cache with model.kv_cache)")

    def write(self, layer: int, rows: torch.Tensor, n_keys: int, k_TGD: torch.Tensor, v_TGD: torch.Tensor):
        """Writes full-attention layer `layer`'s keys k [T, G, D] and values v [T, G, Dv] of
        the T new tokens into their rows (rows [T] int64 of this cache's row index) and returns
        the layer's first n_keys rows (views, no copy): every filled row of the sequences
        being decoded, and rows of other sequences or unfilled ones that the decode mask
        hides. Transformer.decode binds layer, rows and n_keys as each layer's
        AttentionContext.gather_kv and advances `lengths` once every layer has been written."""
        j, G, (D, Dv) = self.full_layers.index(layer), self.heads[layer], self.dims[layer]
        self._check_new(layer, k_TGD, v_TGD, self.k, self.v)
        k, v = self.k[j, :, :G, :D], self.v[j, :, :G, :Dv]
        k.index_copy_(0, rows, k_TGD)
        if not self.v_in_k:
            v.index_copy_(0, rows, v_TGD)
        return k[:n_keys], v[:n_keys]

    def compress(self, layer: int, seqs: list[int], T: int, q_seq: torch.Tensor, q_pos: torch.Tensor, c_TD: torch.Tensor, g_TD: torch.Tensor,
                 entries: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        """Heavily compressed attention layer `layer` in a decode call (AttentionContext.compressed):
        each sequence b of `seqs` takes its T new tokens' c, g [T, D] (rows s T .. (s + 1) T of
        c_TD, g_TD; padding rows after them unread) after its open run's (positions m floor(L / m)
        .. L - 1, L = lengths[b]); the runs they complete become entries (entries(c, g, first
        positions)) in its rows b (max_tokens // m) + j, the rest the open run. Returns (every
        sequence's entries [batch max_tokens // m, D], keep [Q, that] bool): query q (of sequence
        q_seq[q] at position q_pos[q]) sees its sequence's runs j with (j + 1) m <= q_pos + 1.
        A compressed sparse attention layer's (csa_layers; AttentionContext.compressed) runs
        overlap: its c, g [T, W] hold both its compressors' inputs, each completed run's entry
        is made from the previous run's tokens beside its own, and the entries beside the
        indexer's are every sequence's [batch max_tokens // m, D + index_head_dim]."""
        sparse = layer in self.csa_layers
        if sparse:  # csa_run[b]: the last complete run (rows 0 .. m - 1; stale before the first), then the open run
            j, m = self.csa_layers.index(layer), self.csa_rate
            run, store = self.csa_run[j], self.csa_entries[j]
        else:  # run[b]: the open run
            j, m = self.compress_layers.index(layer), self.compress_rate
            run, store = self.run[j], self.entries[j]
        per, D, kept = self.max_tokens // m, c_TD.shape[-1], m if sparse else 0
        new_TC = torch.cat([c_TD, g_TD], dim=-1).to(run.dtype)
        for s, b in enumerate(seqs):
            L = self.lengths[b]
            tokens = torch.cat([run[b, :kept + L % m], new_TC[s * T:(s + 1) * T]])  # (the last complete run,) the open run, the new tokens
            k, r = (tokens.shape[0] - kept) // m, L // m  # the runs the new tokens complete, the first of them
            if k:
                runs = tokens[:kept + k * m].view(-1, m, 2 * D)
                positions = torch.arange(r * m, (r + k) * m, m, device=c_TD.device)
                if sparse:  # each completed run after the one before it
                    pairs = torch.cat([runs[:-1], runs[1:]], dim=1)
                    made = entries(pairs[..., :D], pairs[..., D:], positions, positions > 0)
                else:
                    made = entries(runs[..., :D], runs[..., D:], positions)
                store[b * per + r:b * per + r + k] = made.to(store.dtype)
            run[b, :tokens.shape[0] - k * m] = tokens[k * m:]
        col = torch.arange(store.shape[0], device=c_TD.device)
        return store, (col[None] // per == q_seq[:, None]) & ((col[None] % per + 1) * m <= q_pos[:, None] + 1)

    def linear_states(self, layer: int, seqs: list[int], tokens: Optional[int] = None) -> LinearStates:
        """Linear-attention layer `layer`'s states of the sequences `seqs` (copies, in that
        order; zeros for a sequence of length 0, which starts over), for decode to continue
        and put back with write_linear; tokens: the call's tokens before its padding
        (LinearStates.tokens)."""
        j = self.linear_layers.index(layer)
        index = torch.tensor(seqs, device=self.conv.device)
        fresh = torch.tensor([self.lengths[b] == 0 for b in seqs], device=self.conv.device)
        conv, state = self.conv[j].index_select(0, index), self.state[j].index_select(0, index)
        return LinearStates(conv.masked_fill(fresh[:, None, None], 0), state.masked_fill(fresh[:, None, None, None], 0), tokens)

    def write_linear(self, layer: int, seqs: list[int], states: LinearStates) -> None:
        """The states after a decode call's tokens (linear_attention's) into their sequences' rows."""
        j = self.linear_layers.index(layer)
        index = torch.tensor(seqs, device=self.conv.device)
        self.conv[j].index_copy_(0, index, states.conv.to(self.conv.dtype))
        self.state[j].index_copy_(0, index, states.state)

    def write_window(self, layer: int, ring_rows: torch.Tensor, new_rows: Optional[torch.Tensor], k_TGD: torch.Tensor, v_TGD: torch.Tensor):
        """Sliding-window layer `layer`'s keys and values, with the T new tokens' k [T, G, D]
        and v [T, G, Dv] put into its ring: the rows ring_rows [R] int64 of the ring get the
        new tokens new_rows [R] (None: all T, in order). With new_rows None (one new token per
        sequence: its row held a key that has left the window) they are written first and
        the ring itself is returned (views, no copy); otherwise the ring's rows before the
        write, followed by the T new tokens' (a copy: the prompt's early queries may need keys
        that its later tokens overwrite). Transformer.decode binds the rows (and the index
        of each returned row, kv_index, in its mask)."""
        j, G, (D, Dv) = self.window_layers.index(layer), self.heads[layer], self.dims[layer]
        self._check_new(layer, k_TGD, v_TGD, self.k_window, self.v_window)
        ring_k, ring_v = self.k_window[j, :, :G, :D], self.v_window[j, :, :G, :Dv]
        if new_rows is None:
            keys, values = ring_k, ring_v
        else:
            keys = torch.cat([ring_k, k_TGD])
            values = keys[..., :ring_v.shape[-1]] if self.v_in_k else torch.cat([ring_v, v_TGD])
            k_TGD, v_TGD = k_TGD.index_select(0, new_rows), v_TGD.index_select(0, new_rows)
        ring_k.index_copy_(0, ring_rows, k_TGD)
        if not self.v_in_k:
            ring_v.index_copy_(0, ring_rows, v_TGD)
        return keys, values


def _bound_per_layer(k_TGD, v_TGD):
    """The gather_kv of decode's shared contexts, replaced by each layer's cache write."""
    raise RuntimeError("decode binds each layer's gather_kv to its cache rows")


def _unpadded(n: int, gather_kv, k_TGD, v_TGD):
    """gather_kv of the first n new tokens' keys and values (decode's padding dropped)."""
    return gather_kv(k_TGD[:n], v_TGD[:n])


BATCH_KEYS = ("input_ids", "labels", "loss_mask", "positions", "cu_seqlens")
MTP_KEYS = ("mtp_input_ids", "mtp_labels", "mtp_loss_mask", "mtp_positions")


def _refuse_autocast(x: torch.Tensor) -> None:
    """A ValueError under torch.autocast on x's device: the reference model computes in its
    parameters' dtype (its attention refused the autocast inputs, naming a weight)."""
    if torch.is_autocast_enabled(x.device.type):
        raise ValueError("torch.autocast: the reference Transformer computes in its parameters' dtype, not under autocast: cast it "
                         "(model.to(torch.bfloat16): its router and expert biases stay float32) or use FSDP2's mixed precision "
                         "(fmoe.parallel.parallelize(model, meshes, param_dtype=torch.bfloat16)); fmoe.model.MoE and DenseMLP run under "
                         "autocast in a model of your own")


class Transformer(nn.Module):
    """The reference MoE decoder; see the module docstring."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden))
        # learned absolute positions [P, H] (cfg.abs_positions: GPT-Neo's wpe), added to the embeddings
        self.pos_embed = nn.Parameter(torch.empty(cfg.abs_positions + cfg.abs_position_offset, cfg.hidden)) if cfg.abs_positions else None
        self.blocks = nn.ModuleList(Block(cfg, moe=cfg.is_moe(i), local=cfg.is_local(i), rope=not cfg.is_nope(i), linear=cfg.is_linear(i),
                                          fp8=cfg.is_fp8(i), index_shared=cfg.is_index_shared(i), sinks=cfg.has_sinks(i),
                                          shortcut=cfg.shortcut(i), depth=i, mlp=not cfg.is_mlp_free(i), mixer=not cfg.is_mixer_free(i),
                                          index_blocks=cfg.is_index_blocks(i), hashed=cfg.is_hash(i), compress=cfg.is_compressed(i),
                                          csa=cfg.is_csa(i))
                                    for i in range(cfg.n_layers))
        for i, block in enumerate(self.blocks):  # DeepSeek sparse attention: each block's choice of keys by its index, and the one it reuses
            if isinstance(block.attn, Attention):
                block.attn.index_key = i
                if cfg.is_index_shared(i):
                    block.attn.index_source = cfg.index_source(i)
                    self.blocks[block.attn.index_source].attn.index_keep = True
        self.embed_norm = RMSNorm.of(cfg, "embed") if cfg.embed_norm else None  # on the trunk's embeddings (NanoChat's)
        self.norm = RMSNorm.of(cfg, "final")
        # hyper-connections: the streams' last collapse, before the final norm
        self.hc_head = HyperConnection(cfg, head=True) if cfg.hyper_connections else None
        # [V, H], linear_cross_entropy's layout; with tie_embeddings the head is the embedding
        self.head = None if cfg.tie_embeddings else nn.Parameter(torch.empty(cfg.head_vocab, cfg.hidden))
        self.head_bias = nn.Parameter(torch.zeros(cfg.head_vocab)) if cfg.head_bias else None
        self.mtp = nn.ModuleList(MTPModule(cfg) for _ in range(cfg.mtp_depth))
        # context parallelism (cp > 1): fmoe.parallel.parallelize sets a ContextParallel,
        # whose attention_kwargs(token_index) give attention_context its CP arguments
        self.context_parallel = None
        # pipeline parallelism: fmoe.parallel.pipeline_chunk keeps one stage's layers and
        # sets a PipelineChunk (first, last); the forward then runs only those (forward)
        self.pipeline_chunk = None
        # FSDP2 mixed precision: fmoe.parallel.parallelize sets the dtype the blocks compute
        # in (its param_dtype), which kv_cache gives the cache; None: the parameters' dtype
        self.compute_dtype = None
        self.reset_parameters()

    def reset_parameters(self, seed: Optional[int] = None) -> None:
        """Normal(0, init_std) matrices, output projections (attention wo, MLP w_down) also
        divided by sqrt(2 * n_layers) (GPT-2: the residual stream sums 2 per block), norms 1
        (0 where zero-centred: zero_centered_norms, norm_overrides), every bias, the attention sinks and the expert-bias
        buffers 0; in linear-attention blocks, each kind as its reference starts: the
        convolution's taps Normal(0, 1/sqrt(3 K)) (torch's Conv1d's spread), the output norm
        and the skip D 1, the convolutions' biases 0, and
            gated_deltanet (FLA's GatedDeltaNet)   A uniform in [0, 16], dt = softplus(dt_bias)
                                                   log-uniform in [0.001, 0.1]
            mamba2 (mamba_ssm's Mamba2)            A uniform in [1, 16], dt log-uniform in [0.001, 0.1]
            kda (FLA's KimiDeltaAttention)         A uniform in [1, 16], dt_bias 0
            mamba1 (Mamba's)                       A = 1 .. N in every channel (S4D-real), dt
                                                   log-uniform in [0.001, 0.1]
        (A_log = log A; a uniform drawn as the normal's CDF of init_value). The router stays
        float32 (MoE owns it). A hashed MoE's table (hash_layers): random_hash_table of a
        generator seeded by (seed, its name).
        Hyper-connections (HyperConnection): fn Normal(0, init_std), scale 0.01, the pre
        biases -log(n - 1), the others 0. A model of one's own (a subclass holding torch
        modules) starts by the same rules: torch's norms (TORCH_NORMS, whatever their names)
        gain 1, bias 0 and fresh running statistics, every parameter named bias 0, any other
        Normal(0, init_std); a subclass that wants other starts overrides reset_parameters,
        calling this one first (fmoe.parallel.materialize calls the override).

        The values are a function of `seed` and each parameter's name only (init_value), so
        the full weights are the same bit for bit on any mesh: a parameter that is a DTensor
        (sharded by fmoe.parallel, possibly built on the meta device and materialised with
        fmoe.parallel.materialize) gets its own shard of the same full tensor, generated
        one parameter at a time. seed None: torch.initial_seed() (what torch.manual_seed
        set). Parameters still on the meta device are left alone.
        """
        init_parameters(self, self.cfg, seed)

    def _index_attentions(self) -> list[Attention]:
        """The attention modules with an indexer loss (DeepSeek sparse attention's, block-sparse attention's), this chunk's."""
        return [m for m in self.modules() if isinstance(m, Attention) and m.cfg.index_loss]

    def set_index_loss_weight(self, weight: float) -> None:
        """The weight of every sparse attention layer's indexer loss in the next
        backward passes (Attention.index_loss_weight; cfg.index_loss_coeff at first): the
        loop sets index_loss_coeff / n_micro each step, so that the step's gradients average
        the micro-batches' losses as they do the balancing losses'."""
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < math.inf:
            raise ValueError(f"weight: expected a finite number >= 0, got {weight!r}")
        for m in self._index_attentions():
            m.index_loss_weight = weight

    def index_loss_sum(self) -> Optional[torch.Tensor]:
        """The sum over this model's (this pipeline chunk's) sparse attention layers
        of their indexer losses in the last forward (float32 scalar, detached); None when no
        layer computed one (no such layers, no gradients, or index_loss_coeff 0)."""
        losses = [m.index_loss for m in self._index_attentions() if m.index_loss is not None]
        return torch.stack(losses).sum() if losses else None

    def moa_attentions(self) -> dict[str, Attention]:
        """The attention modules that are a mixture of attention heads (cfg.moa_experts) by
        name, this model's (this pipeline chunk's)."""
        return {n: m for n, m in self.named_modules() if isinstance(m, Attention) and m.cfg.moa_experts is not None}

    def set_moa_aux_weight(self, weight: float) -> None:
        """The weight of every attention router's balance loss in the next backward passes
        (Attention.moa_aux_weight; cfg.moa_aux_coeff at first): the loop sets moa_aux_coeff /
        (attention blocks x n_micro) each step, the mean over blocks and micro-batches."""
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < math.inf:
            raise ValueError(f"weight: expected a finite number >= 0, got {weight!r}")
        for m in self.moa_attentions().values():
            m.moa_aux_weight = weight

    def moa_aux_loss_sum(self) -> Optional[torch.Tensor]:
        """The sum over this model's (this pipeline chunk's) attention routers of their balance
        losses in the last forward (float32 scalar, detached); None when none computed one (no
        mixture of attention heads, or no gradients)."""
        losses = [m.moa_aux_loss for m in self.moa_attentions().values() if m.moa_aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

    def moe_layers(self) -> dict[str, MoE]:
        """The MoE modules by the key their stats carry in forward's output: "layer_{i}"
        for trunk block i, "mtp_{d}" for MTP depth d (e.g. for the expert-bias update)."""
        layers = {f"layer_{i}": b.mlp for i, b in enumerate(self.blocks) if isinstance(getattr(b, "mlp", None), MoE)}
        layers.update({f"mtp_{d}": m.block.mlp for d, m in enumerate(self.mtp, start=1) if isinstance(m.block.mlp, MoE)})
        return layers

    def check_batch(self, batch) -> None:
        """ValueError naming what a micro-batch lacks for this model: make_batch's entries
        (the MTP rows with mtp_depth), their shapes, and a context-parallel split exactly
        when the model is context parallel. Shapes and keys alone, no value read: what
        context() checks first; fmoe.parallel.Pipeline checks every micro-batch with it
        before its schedule runs, on every rank (a stage's refusal inside the schedule
        reached the other stages as a closed connection)."""
        keys = BATCH_KEYS + (MTP_KEYS if self.cfg.mtp_depth else ())
        missing = [key for key in keys if key not in batch.keys()]
        if missing:
            raise ValueError(f"batch: missing {missing} (fmoe.train.data.make_batch(tokens, cu_seqlens, mtp_depth={self.cfg.mtp_depth}) makes them)")
        T = batch["input_ids"].shape[0]
        for key in BATCH_KEYS[:4]:
            if batch[key].shape != (T,):
                raise ValueError(f"batch[{key!r}]: expected shape ({T},) like input_ids, got {tuple(batch[key].shape)}")
        D = self.cfg.mtp_depth
        for key in MTP_KEYS if D else ():
            if batch[key].shape != (D, T):
                raise ValueError(f"batch[{key!r}]: expected shape ({D}, {T}): one row per MTP depth (mtp_depth = {D}), got {tuple(batch[key].shape)}")
        split = "token_index" in batch.keys()
        if split != (self.context_parallel is not None):
            raise ValueError("batch: a context-parallel model takes the batch split by fmoe.parallel.split_batch (with token_index), "
                             f"and only such a model does; got {'a split' if split else 'an unsplit'} batch, context_parallel={self.context_parallel}")

    def context(self, batch) -> BatchContext:
        """The micro-batch's BatchContext: RoPE tables of the trunk's positions and of every
        MTP depth's, and one attention mask from cu_seqlens, on the batch's device. Reads no
        value on the host; build it once per micro-batch, after the batch has moved."""
        self.check_batch(batch)
        cfg = self.cfg.context_config()  # both masks when some block is local
        split = "token_index" in batch.keys()
        cp = self.context_parallel.attention_kwargs(batch["token_index"]) if split else {}
        trunk = attention_context(batch["cu_seqlens"], batch["positions"], cfg, **cp)
        full = dataclasses.replace(cfg, window=None, chunk=None)  # the MTP blocks attend to every earlier token
        # the trunk's mask, and its additive copies (AttentionContext.additive_masks: one for every layer)
        depths = [dataclasses.replace(attention_context(batch["cu_seqlens"], batch["mtp_positions"][d], full, mask=trunk.mask, **cp),
                                      additive_masks=trunk.additive_masks) for d in range(self.cfg.mtp_depth)]
        return BatchContext((trunk, *depths))

    def _lm_loss(self, h_TH, labels, loss_mask, norm=None):
        # the labels were checked where the batch was made: no host sync here
        labels = torch.where(loss_mask.bool(), labels, torch.full_like(labels, -100))
        V = self.cfg.head_vocab
        # no host read: a RuntimeError where the check runs (on the device), not a NaN loss
        torch._assert_async(((labels == -100) | ((labels >= 0) & (labels < V))).all(),
                            f"labels: a counted label outside 0..{V - 1}, the output head's rows" + (" (out_vocab)" if self.cfg.out_vocab else " (vocab_size)"))
        loss_sum = linear_cross_entropy(self._head_input(h_TH, norm), self.output_weight(), labels, reduction="sum", check=False, impl=self.cfg.impl,
                                        bias=self.head_bias, softcap=self.cfg.logit_softcap)
        return loss_sum, (labels != -100).sum()  # the rows the sum counts (a label of -100 under loss_mask counts in neither)

    def _embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of token ids [...] -> [..., H], x embed_scale, rounded to their dtype
        first with round_embed_scale (a 0-dim CPU tensor: no device copy) (F.embedding: a
        deterministic backward on CPU, unlike indexing)."""
        h = F.embedding(ids, self.embed)
        if self.cfg.embed_scale == 1.0:
            return h
        return h * (torch.tensor(self.cfg.embed_scale, dtype=h.dtype) if self.cfg.round_embed_scale else self.cfg.embed_scale)

    def _trunk_input(self, ids: torch.Tensor, positions: torch.Tensor, check: bool = True) -> torch.Tensor:
        """The first block's input of token ids [T] at positions [T]: their embeddings [T, H]
        (plus pos_embed's rows of their positions with cfg.abs_positions; check: a ValueError
        for a position past it, else an assert on the device, a RuntimeError, no host read; through embed_norm with
        cfg.embed_norm), or with hyper_connections n copies side by side [T, n H] (the streams)."""
        if not check:  # forward's batch: no host read, a RuntimeError where the check runs (on the device), not in the embedding
            torch._assert_async(((ids >= 0) & (ids < self.cfg.vocab_size)).all(), f"input_ids: an id outside 0..{self.cfg.vocab_size - 1} (vocab_size)")
        h_TH = self._embedding(ids)
        if self.pos_embed is not None:
            P, offset = self.cfg.abs_positions, self.cfg.abs_position_offset
            if check and positions.numel() and int(positions.max()) >= P:
                raise ValueError(f"positions: up to {int(positions.max())}, past the {P} learned positions (abs_positions); shorter documents")
            if not check:  # no host read: a RuntimeError where the check runs (on the device)
                torch._assert_async((positions < P).all(), f"positions past the {P} learned positions (abs_positions)")
            h_TH = h_TH + F.embedding(positions + offset if offset else positions, self.pos_embed)
        if self.embed_norm is not None:
            h_TH = self.embed_norm(h_TH)
        return h_TH.repeat(1, self.cfg.hyper_connections) if self.cfg.hyper_connections else h_TH

    def _head_input(self, h_TH: torch.Tensor, norm=None) -> torch.Tensor:
        """What the output head multiplies: the final norm (or an MTP module's own) of h (the
        trunk's output; with hyper_connections its streams [T, n H] collapsed by hc_head
        first), / logit_divisor."""
        if self.hc_head is not None:
            h_TH = self.hc_head(h_TH)
        x = (self.norm if norm is None else norm)(h_TH)
        return x if self.cfg.logit_divisor == 1.0 else x / self.cfg.logit_divisor

    def output_weight(self) -> torch.Tensor:
        """The output head [V, H] (V: cfg.head_vocab): `head`, or the embedding with tie_embeddings."""
        return self.embed if self.cfg.tie_embeddings else self.head

    def logits(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The trunk's next-token logits [T, V] (float32) of packed documents, for evaluation
        and parity checks (the training forward never builds them).

        input_ids [T] int64; cu_seqlens [n+1] int32 (0, ..., T); positions [T] (default:
        each document's 0, 1, ...). The whole model: on one process, or parallelized by
        fmoe.parallel.parallelize over FSDP2, tensor and expert parallelism (every rank calls
        it with the same tokens; T a multiple of tp), not a pipeline chunk or context parallel."""
        from fmoe.ops import positions_from_cu_seqlens

        self._check_whole("logits")
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 1 or input_ids.dtype not in (torch.int64, torch.int32):
            got = f"{input_ids.dtype} {list(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids: expected [T] int64 token ids (packed documents, cu_seqlens their bounds), got {got}")
        _refuse_autocast(input_ids)
        if input_ids.numel():  # one host read, as cu_seqlens' below
            lo, hi = torch.stack(torch.aminmax(input_ids)).tolist()
            if lo < 0 or hi >= self.cfg.vocab_size:
                raise ValueError(f"input_ids: expected ids in 0..{self.cfg.vocab_size - 1} (vocab_size), got {lo}..{hi}")
        cu_seqlens = torch.as_tensor(cu_seqlens)
        if (cu_seqlens.ndim != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64) or not cu_seqlens.numel()
                or int(cu_seqlens[-1]) != input_ids.shape[0] or int(cu_seqlens[0]) != 0):
            raise ValueError(f"cu_seqlens: expected 0, ..., T = {input_ids.shape[0]} for input_ids [T], got {cu_seqlens.tolist()}")
        cu_seqlens = cu_seqlens.to(device=input_ids.device, dtype=torch.int32)
        if positions is None:
            positions = positions_from_cu_seqlens(cu_seqlens)
        elif not isinstance(positions, torch.Tensor) or positions.shape != input_ids.shape:
            got = list(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
            raise ValueError(f"positions: expected [T] = [{input_ids.shape[0]}], one per token of input_ids, got {got}")
        ctx = attention_context(cu_seqlens, positions, self.cfg.context_config())
        h_TH = self._trunk_input(input_ids, positions)
        for block in self.blocks:
            h_TH, _ = block(h_TH, ctx, token_ids=input_ids)
        return self._head(h_TH)

    def _check_whole(self, what: str) -> None:
        if self.pipeline_chunk is not None or self.context_parallel is not None:
            raise ValueError(f"model: {what} needs the whole model on one process (not a pipeline chunk, not context parallel)")

    def _head(self, h_TH: torch.Tensor) -> torch.Tensor:
        """The final norm and the output head (and its bias): float32 logits [T, V], capped
        with logit_softcap."""
        x = self._head_input(h_TH)
        logits = x @ self.output_weight().t() if self.head_bias is None else torch.addmm(self.head_bias, x, self.output_weight().t())
        cap = self.cfg.logit_softcap
        return logits.float() if cap is None else torch.tanh(logits.float() / cap) * cap

    def kv_cache(self, max_tokens: int, batch: int = 1, *, device=None) -> KVCache:
        """An empty KVCache of `batch` sequences of up to max_tokens tokens each, on the
        model's device (or `device`: "meta" sizes one, its nbytes, allocating nothing), in the
        dtype it computes in (its parameters', or FSDP2's param_dtype under
        fmoe.parallel.parallelize). Under tensor parallelism it holds this rank's kv
        heads (n_kv_heads / tp, or the one its query heads read where there are fewer kv heads
        than tp ranks; multi-latent attention's latents are every rank's) and the states of its
        linear-attention heads."""
        # the heads this rank's attention and linear attention compute (the model's where it has none)
        i, local = next(((i, a.cfg) for i, b in enumerate(self.blocks) for a in (getattr(b, "attn", None), getattr(b, "attn_beside", None))
                         if isinstance(a, Attention)), (None, self.cfg))  # a parallel hybrid's attention beside its linear mixer too
        linear = next((b.attn.cfg for b in self.blocks if isinstance(getattr(b, "attn", None), LinearAttention)), self.cfg.linear_attention_config())
        # the tp ranks the heads split over (whole heads, each count divisible): block i's heads over this rank's
        tp = (self.cfg.heads(i) if i is not None else self.cfg.n_heads) // local.n_heads
        heads = dict(n_heads=self.cfg.n_heads // tp, n_kv_heads=max(1, self.cfg.n_kv_heads // tp), linear_k_heads=linear.n_k_heads,
                     linear_v_heads=linear.n_v_heads)  # fewer kv heads than tp ranks: each rank caches its query heads' one
        for name in ("local_kv_heads", "local_heads"):
            if getattr(self.cfg, name) is not None:
                heads[name] = max(1, getattr(self.cfg, name) // tp)
        cfg = dataclasses.replace(self.cfg, **heads) if any(getattr(self.cfg, k) != v for k, v in heads.items()) else self.cfg
        return KVCache(cfg, max_tokens, batch=batch, device=self.embed.device if device is None else device,
                       dtype=self.compute_dtype or self.embed.dtype)

    def _token_multiple(self) -> int:
        """The number a forward's token count must divide by: the tp ranks' (sequence
        parallelism splits the tokens between the tensor-parallel regions), else 1."""
        shard = next((b.attn.tensor_parallel for b in self.blocks if getattr(getattr(b, "attn", None), "tensor_parallel", None) is not None), None)
        return 1 if shard is None else shard.mesh.size()

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, cache: KVCache, seqs=None) -> torch.Tensor:
        """The next-token logits (float32) of new tokens that continue sequences in `cache`,
        whose keys and values it appends to the cache: a prompt in one call, then a token
        per call. Inference: no autograd.

        input_ids [T] int64: T new tokens of one sequence, `seqs` (an int, default 0) ->
            logits [T, V], at positions cache.lengths[seqs], ..., + T - 1.
        input_ids [S, T] int64: T new tokens for each of S distinct sequences `seqs` (a list
            of S ints, default every one of the cache's, S = cache.batch) -> logits [S, T, V].
            Prompts of different lengths: one call per sequence, then steps of all together.

        Each sequence attends to its own tokens only: equals the rows of logits(...) of each
        whole sequence, as long as no capacity_factor drops tokens (a capacity counts the
        tokens of one call). Reads the cache's lengths on the host, never a device value.
        LongRoPE: a sequence's keys rotate by the short factors while it is at most
        longrope_original_max_positions long and by the long ones past that, as in the whole
        sequence's forward; the call that takes a sequence past it, or that continues a
        sequence rewound from past it (cache.lengths set lower) and stays within it,
        recomputes the sequence from its cached token ids (KVCache.tokens), as one prompt.

        The whole model, as logits: on one process, or parallelized by fmoe.parallel.
        parallelize over FSDP2, tensor and expert parallelism (a model larger than one device),
        every rank calling decode with the same tokens and a cache of its own from
        model.kv_cache (under tp: this rank's n_kv_heads / tp heads). Under tp a call's S T
        tokens are padded to a multiple of tp with copies of the last one, whose keys are not
        cached and whose logits are dropped (with a capacity_factor they count in it too)."""
        self._check_whole("decode")
        if not isinstance(cache, KVCache):
            raise ValueError(f"cache: expected a KVCache (model.kv_cache(max_tokens)), got {type(cache).__name__}")
        if cache.n_layers != self.cfg.n_layers:
            raise ValueError(f"cache: holds {cache.n_layers} layers, the model has {self.cfg.n_layers}")
        rings = KVCache.ring_layers(self.cfg, cache.max_tokens)
        if (cache.window_layers, cache.window) != (rings, KVCache.ring_length(self.cfg) if rings else None):
            raise ValueError(f"cache: made for sliding-window (chunked) layers {list(cache.window_layers)} of window (chunk) {cache.window}, the model's differ "
                             "(make the cache with model.kv_cache)")
        linear = tuple(i for i in range(self.cfg.n_layers) if self.cfg.is_linear(i))
        full = tuple(i for i in range(self.cfg.n_layers) if i not in rings and self.cfg.attends(i))
        if (cache.linear_layers, cache.full_layers) != (linear, full):  # another model's states: a layer would read none, or another's
            raise ValueError(f"cache: made for linear-attention layers {list(cache.linear_layers)} and attention layers {list(cache.full_layers)}, "
                             f"the model's are {list(linear)} and {list(full)} (make the cache with model.kv_cache)")
        if self.cfg.longrope_switches and cache.tokens is None:
            raise ValueError("cache: made without the token ids that the model's LongRoPE recomputes a sequence from past its original positions "
                             "(make the cache with model.kv_cache)")
        if not isinstance(input_ids, torch.Tensor):  # a list of ids: torch.tensor(ids) on the model's device
            raise ValueError(f"input_ids: expected a tensor [T] or [S, T] int64, got {type(input_ids).__name__}")
        _refuse_autocast(input_ids)  # before any layer writes: a linear layer's states took the refused tokens in
        if input_ids.ndim not in (1, 2) or input_ids.shape[-1] < 1 or input_ids.shape[0] < 1 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids: expected [T] or [S, T] int64 with S, T >= 1, got {input_ids.dtype} {list(input_ids.shape)}")
        computes = self.compute_dtype or self.embed.dtype
        if cache.dtype != computes:  # checked before any layer writes (a linear layer's states were cast into it)
            raise ValueError(f"cache: holds {cache.dtype}, the model computes in {computes} (make the cache with model.kv_cache)")
        # no host read: an id out of range stops here (a RuntimeError naming it; on CUDA where the check runs), not in the embedding
        torch._assert_async(((input_ids >= 0) & (input_ids < self.cfg.vocab_size)).all(),
                            f"input_ids: an id outside 0..{self.cfg.vocab_size - 1} (vocab_size)")
        seq_list = self._decoded_seqs(input_ids, cache, seqs)
        T, M, device = input_ids.shape[-1], cache.max_tokens, input_ids.device
        for b in seq_list:
            L = cache.lengths[b]
            if isinstance(L, bool) or not isinstance(L, int) or not 0 <= L <= cache.decoded_lengths[b]:  # rows never written, or no row
                raise ValueError(f"cache.lengths[{b}]: expected 0..{cache.decoded_lengths[b]}, the tokens decoded into sequence {b} "
                                 f"(fewer goes back, 0 starts over), got {L!r}")
            if cache.lengths[b] + T > M:
                raise ValueError(f"input_ids: {T} more tokens after {cache.lengths[b]} of sequence {b} exceed the cache's max_tokens = {M}")
            if cache.window_layers and 0 < cache.lengths[b] < cache.decoded_lengths[b] - 1:
                raise ValueError(f"cache.lengths[{b}]: {cache.lengths[b]} tokens after {cache.decoded_lengths[b]}: the sliding-window (chunked) layers keep only "
                                 f"the newest {cache.window} tokens' keys, so a sequence goes back one token at most, or restarts from 0 (cache.reset)")
            if (cache.compress_layers or cache.csa_layers) and 0 < cache.lengths[b] != cache.decoded_lengths[b]:
                raise ValueError(f"cache.lengths[{b}]: {cache.lengths[b]} tokens after {cache.decoded_lengths[b]}: the compressed attention layers "
                                 "keep only the entries and the open run after the last token, so a sequence continues from there or restarts from 0 "
                                 "(cache.reset)")
            if cache.linear_layers and 0 < cache.lengths[b] != cache.decoded_lengths[b]:
                raise ValueError(f"cache.lengths[{b}]: {cache.lengths[b]} tokens after {cache.decoded_lengths[b]}: the linear-attention layers keep only the "
                                 "state after the last token, so a sequence continues from there or restarts from 0 (cache.reset)")
        if self.cfg.longrope_switches:  # a sequence going past the original positions, or back below them: every key's rotation changes
            L = self.cfg.longrope_original_max_positions
            crossing = [b for b in seq_list if 0 < cache.lengths[b] <= L < cache.lengths[b] + T  # its cached keys short, now long
                        or 0 < cache.lengths[b] and cache.lengths[b] + T <= L < cache.decoded_lengths[b]]  # rewound: long, now short
            if crossing:
                return self._decode_past_longrope(input_ids, cache, seq_list, crossing)
        # the new tokens are queries at their rows of the cache (sequence b's slot of M rows
        # is a document) against the cache's first n_keys rows: attention_context's
        # context-parallel form, the cache standing in for the gather of every rank's keys
        # and the document mask hiding other sequences' rows and the unfilled ones. Multi-
        # latent attention caches latents: one new token per sequence attends in the
        # absorbed form (latent keys of kv_rank + rope_dim channels, the dense mask); more
        # (a prompt) expand every cached latent per head and attend in the ordinary form,
        # with the model's mask (FlexAttention's block mask on CUDA).
        positions_host = [cache.lengths[b] + t for b in seq_list for t in range(T)]
        rows_host = [b * M + cache.lengths[b] + t for b in seq_list for t in range(T)]
        n_keys, n = max(rows_host) + 1, len(rows_host)
        # under tensor parallelism the tokens split evenly over the tp ranks: pad with copies
        # of the last token (same position and row in the mask, so the same attention), whose
        # keys are not written and whose outputs are dropped
        pad = -n % self._token_multiple()
        ids = input_ids.reshape(-1)
        if pad:
            ids = torch.cat([ids, ids[-1:].expand(pad)])
        positions = torch.tensor(positions_host + positions_host[-1:] * pad, device=device)
        q_seq = torch.tensor([b for b in seq_list for _ in range(T)] + seq_list[-1:] * pad, device=device)  # each query's sequence
        queries = torch.tensor(rows_host + rows_host[-1:] * pad, device=device)  # each query's row: its index in the mask
        rows = queries[:n]
        cu = torch.tensor([*range(0, n_keys, M), n_keys], dtype=torch.int32, device=device)
        cfg, mla = self.cfg.context_config(), self.cfg.kv_rank is not None
        absorbed = mla and T == 1
        if absorbed:
            cfg = dataclasses.replace(cfg, impl="torch")
        contexts = {}  # local ring or not -> the context (its gather_kv bound per layer below)
        if cache.full_layers:  # with rings, the local layers' window (chunk) mask is theirs: none here
            contexts[False] = attention_context(cu, positions, dataclasses.replace(cfg, window=None, chunk=None) if cache.window_layers else cfg,
                                                token_index=queries, kv_index=torch.arange(n_keys, device=device), gather_kv=_bound_per_layer)
        if cache.window_layers:
            contexts[True], window_kv = self._window_context(cache, seq_list, T, positions, queries, rows_host, cfg)
        h_TH = self._trunk_input(ids, positions)
        for i, block in enumerate(self.blocks):
            if block.attn is None:  # an MLP alone: nothing cached
                h_TH, _ = block(h_TH, AttentionContext(None, None, None), token_ids=ids)
                continue
            states = None
            if i in cache.linear_layers:  # the states its tokens continue, then the states after them
                states = cache.linear_states(i, seq_list, tokens=n)  # the padding's rows (tp) continue nothing
                if block.attn_beside is None:
                    h_TH, _ = block(h_TH, AttentionContext(None, None, None, linear_states=states), token_ids=ids)
                    cache.write_linear(i, seq_list, states)
                    continue
            ring = i in cache.window_layers
            kv = functools.partial(cache.write_window, i, *window_kv) if ring else functools.partial(cache.write, i, rows, n_keys)
            if pad:
                kv = functools.partial(_unpadded, n, kv)
            compressed = (functools.partial(cache.compress, i, seq_list, T, q_seq, positions)
                          if i in cache.compress_layers or i in cache.csa_layers else None)
            layer_ctx = dataclasses.replace(contexts[ring], gather_kv=kv, latents=None if not mla else "absorbed" if absorbed else "expanded",
                                            linear_states=states, compressed=compressed)  # a parallel hybrid's: both its keys and its states
            h_TH, _ = block(h_TH, layer_ctx, token_ids=ids)
            if states is not None:
                cache.write_linear(i, seq_list, states)
        for j, b in enumerate(seq_list):
            if cache.tokens is not None:
                cache.tokens[b, cache.lengths[b]:cache.lengths[b] + T] = input_ids.reshape(-1, T)[j]
            cache.lengths[b] += T
            cache.decoded_lengths[b] = cache.lengths[b]
        logits = self._head(h_TH[:n])
        return logits if input_ids.ndim == 1 else logits.view(len(seq_list), T, -1)

    def _decode_past_longrope(self, input_ids: torch.Tensor, cache: KVCache, seq_list: list[int], crossing: list[int]) -> torch.Tensor:
        """decode's logits where the sequences `crossing` go past LongRoPE's original positions
        in this call (or stay within them after a rewind from past them): each of those
        restarts and takes its cached tokens and the new ones as one prompt (its keys all
        rotated as the whole sequence's), the others continue together."""
        T = input_ids.shape[-1]
        rows = input_ids.reshape(-1, T)
        out: list[Optional[torch.Tensor]] = [None] * len(seq_list)
        rest = [j for j, b in enumerate(seq_list) if b not in crossing]
        if rest:
            logits = self.decode(rows[rest], cache, seqs=[seq_list[j] for j in rest])
            for i, j in enumerate(rest):
                out[j] = logits[i]
        for j, b in enumerate(seq_list):
            if b in crossing:
                prefix = cache.tokens[b, :cache.lengths[b]].to(input_ids.device)
                cache.reset([b])
                out[j] = self.decode(torch.cat([prefix, rows[j].to(prefix.dtype)]), cache, seqs=b)[-T:]
        return out[0] if input_ids.ndim == 1 else torch.stack(out)

    @staticmethod
    def _window_context(cache: KVCache, seq_list: list[int], T: int, positions, rows, rows_host: list[int], cfg):
        """The attention context of the sliding-window (or chunked) layers' rings in a decode
        call, and the rows that KVCache.write_window binds. Each ring row's key gets the index (kv_index)
        of its token's row in the full layers' layout, b M + position, so that the document
        mask over the M-row slots and the window over those indices hold as for the full
        layers; rows of no token here (unfilled, or of sequences not decoded) get the index
        batch M, a document of its own that no query is in. One new token per sequence is
        written before the attention (its row's old key is out of the window, or of an earlier
        chunk); a prompt attends over the ring's old rows and its own keys, then writes its
        newest W. cfg's window or chunk masks the ring's keys by those indices."""
        M, W, device = cache.max_tokens, cache.window, positions.device
        before = T == 1
        lengths = torch.tensor(cache.lengths) + int(before)
        slots = torch.arange(W)
        held = lengths[:, None] - 1 - (lengths[:, None] - 1 - slots).remainder(W)  # [batch, W]: the position each row holds
        decoded = torch.zeros(cache.batch, dtype=torch.bool)
        decoded[seq_list] = True
        dead = cache.batch * M
        kv_host = torch.where((held >= 0) & decoded[:, None], torch.arange(cache.batch)[:, None] * M + held, dead).reshape(-1)
        if not before:
            kv_host = torch.cat([kv_host, torch.tensor(rows_host)])
        kept = range(max(0, T - W), T)  # the new tokens that stay in the ring
        ring_rows = torch.tensor([b * W + (cache.lengths[b] + t) % W for b in seq_list for t in kept], device=device)
        new_rows = None if before else torch.tensor([i * T + t for i in range(len(seq_list)) for t in kept], device=device)
        cu = torch.tensor([*range(0, dead + 1, M), dead + 1], dtype=torch.int32, device=device)
        ctx = attention_context(cu, positions, cfg, token_index=rows, kv_index=kv_host.to(device), gather_kv=_bound_per_layer, window_only=True)
        return ctx, (ring_rows, new_rows)

    @staticmethod
    def _decoded_seqs(input_ids: torch.Tensor, cache: KVCache, seqs) -> list[int]:
        """decode's sequences, checked: [seqs] for input_ids [T], the S of seqs for [S, T]."""
        if input_ids.ndim == 1:
            seq = 0 if seqs is None else seqs
            if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < cache.batch:
                raise ValueError(f"seqs: expected one sequence index in [0, {cache.batch}) for input_ids [T], got {seqs!r}")
            return [seq]
        seq_list = list(range(cache.batch)) if seqs is None else seqs
        if (not isinstance(seq_list, (list, tuple)) or len(set(seq_list)) != len(seq_list)
                or any(isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < cache.batch for b in seq_list)):
            raise ValueError(f"seqs: expected distinct sequence indices in [0, {cache.batch}) for input_ids [S, T], got {seqs!r}")
        if len(seq_list) != input_ids.shape[0]:
            raise ValueError(f"input_ids: {input_ids.shape[0]} rows for the {len(seq_list)} sequences {list(seq_list)} (one row each)")
        return list(seq_list)

    def forward(self, batch, ctx: Optional[BatchContext] = None, hidden: Optional[torch.Tensor] = None):
        """One packed micro-batch; no device->host sync.

        Args:
            batch: a mapping (fmoe.train.data.make_batch's TensorDict) with input_ids,
                labels [T] int64 (next-token labels), loss_mask [T] (True where a label
                counts), positions [T], cu_seqlens [n+1] int32, and with mtp_depth D > 0
                mtp_input_ids, mtp_labels, mtp_loss_mask, mtp_positions [D, T] (row d-1 for
                MTP depth d). make_batch checks the offsets and shapes; here, on the device
                (no host read: a RuntimeError where the check runs), input_ids against
                vocab_size and the counted labels against the head's rows.
                An optional token_mask [T] bool (make_batch's, False on padding): the MoE
                layers do not route the padding (fmoe.layers.moe's token_mask).
            ctx: self.context(batch), built once per micro-batch; None builds it here.
            hidden: for a pipeline chunk that is not the first (fmoe.parallel.pipeline_chunk
                set `pipeline_chunk`): the previous stage's output [T, H] ([T, n H], the streams,
                with hyper_connections n); None otherwise.
        Returns:
            (losses, stats) TensorDicts. losses: "lm_sum" (float32 sum of cross-entropy over
            valid tokens), "lm_tokens" (their count), and "mtp_{d}_sum" / "mtp_{d}_tokens".
            stats: "layer_{i}" -> the MoE stats of block i (fmoe.layers.moe), and
            "mtp_{d}" for MTP blocks with experts.
            A pipeline chunk runs only the blocks it holds (the others are placeholders):
            the first embeds input_ids, one that is not the last returns (hidden [T, H] or the
            streams [T, n H], stats) instead, its output for the next stage; the last returns the losses.
        """
        _refuse_autocast(batch["input_ids"])
        if ctx is None:
            ctx = self.context(batch)
        elif not isinstance(ctx, BatchContext) or len(ctx.attention) != 1 + self.cfg.mtp_depth:
            raise ValueError(f"ctx: expected model.context(batch) (a BatchContext for {self.cfg.mtp_depth} MTP depths), got {type(ctx).__name__}")
        chunk = self.pipeline_chunk
        if (chunk is None or chunk.first) != (hidden is None):
            raise ValueError("hidden: expected the previous stage's output for a pipeline chunk that is not the first, "
                             f"and None otherwise; got {'None' if hidden is None else 'a tensor'} (pipeline_chunk={chunk})")
        if hidden is None:
            h_TH = self._trunk_input(batch["input_ids"], batch["positions"], check=False)
        else:
            h_TH = hidden
        stats = {}
        token_mask = batch["token_mask"] if "token_mask" in batch.keys() else None  # padding: not routed
        for i, block in enumerate(self.blocks):
            if isinstance(block, LayerElsewhere):  # held by another pipeline stage
                continue
            h_TH, layer_stats = block(h_TH, ctx.attention[0], token_mask, batch["input_ids"])
            if layer_stats is not None:
                stats[f"layer_{i}"] = layer_stats
        if chunk is not None and not chunk.last:
            return h_TH, TensorDict(stats, batch_size=[])
        lm_sum, lm_tokens = self._lm_loss(h_TH, batch["labels"], batch["loss_mask"])
        losses = {"lm_sum": lm_sum, "lm_tokens": lm_tokens}
        for d, module in enumerate(self.mtp, start=1):
            emb_TH = self._embedding(batch["mtp_input_ids"][d - 1])
            h_TH, layer_stats = module(emb_TH, h_TH, ctx.attention[d], token_mask)
            if layer_stats is not None:
                stats[f"mtp_{d}"] = layer_stats
            losses[f"mtp_{d}_sum"], losses[f"mtp_{d}_tokens"] = self._lm_loss(h_TH, batch["mtp_labels"][d - 1], batch["mtp_loss_mask"][d - 1],
                                                                              module.out_norm)
        return TensorDict(losses, batch_size=[]), TensorDict(stats, batch_size=[])
