"""Tensor parallelism with sequence parallelism (Megatron-style, on DTensor).

    parallelize_module(model, meshes.tp_mesh, tensor_parallel_plan(model))

A block's matrices are split over the tp ranks so that each rank computes a slice of the
heads (attention) or of the FFN columns (SwiGLU) and the output is a sum over ranks
(Megatron-LM, Shoeybi et al. 2019, section 3):

    attention   wq, wk, wv [H, heads*D]  Shard(1)  (whole heads; n_heads and n_kv_heads % tp == 0)
                (fewer kv heads than tp, tp % n_kv_heads == 0: wk, wv, bk, bv replicated, each rank
                computing the one kv head its query heads read, HeadShard.kv_head: multi-query
                attention, Megatron's replicated kv heads)
                wo [heads*D, H]          Shard(0)
                bq, bk, bv [heads*D]     Shard(0)
                sinks [heads]            Shard(0); bo [H] replicated (bo / tp per rank)
                wg [H, heads*Dv]         Shard(1)  (the output gate, with its heads; either kind)
                wo_a [g, N*Dv/g, r]      Shard(0)  (the grouped output projection: whole groups of a rank's
                                         heads, o_groups % tp == 0; wo [g*r, H] Shard(0) by its groups' rows)
                moa: wq [E, H, G*D]      Shard(2), wo [E, G*D, H] Shard(1) (a mixture of attention
                                         heads: each expert's by its kv heads); moa_router replicated
                q_norm, k_norm           [D] replicated (qk_norm="head"); [heads*D] Shard(0)
                                         (qk_norm="proj", the mean square averaged over tp)
    multi-latent wq or wq_b, wkv_b       Shard(1)  (per-head up projections)
    attention   wo                       Shard(0)
                wq_a, wkv_a, q_a_norm,   replicated (the latents of all T tokens on every
                kv_a_norm                rank; HeadShard sums their gradients over tp)
    SwiGLU      w_gate, w_up [H, F]      Shard(1)
                w_down [F, H]            Shard(0)
    linear      wq, wk, wv, wz, wb, wa,  Shard(1)  (whole heads: n_k_heads and n_v_heads % tp == 0;
    attention   conv_q, conv_k, conv_v             a rank's value heads read its key heads)
                A_log, dt_bias [Nv]      Shard(0)
                wo [Nv*Dv, H]            Shard(0)
                out_norm [Dv]            replicated (the gated output norm, per head)
                (kind "kda": wz_b, wf_b  Shard(1), dt_bias [N*Dk] Shard(0); wz_a, wf_a
                replicated, their gradients summed over tp; with full_rank wz, wf Shard(1);
                kind "lightning": out_norm [N*Dv] Shard(0), its mean square over tp;
                kind "mamba2": out_norm [Nv*Dv], the conv biases and D Shard(0) too;
                kind "mamba1": its C channels: wv, wz, conv_v, wa Shard(1), wdt, wk, wq,
                A_log, conv_v_bias, dt_bias, D Shard(0), dt, B and C's projections summed over
                tp (HeadShard.sum), the norms on them replicated)
    hyper-      attn_hc, mlp_hc's        replicated (per token, on the token shard, like the
    connections fn, base, scale          norms; their gradients summed over tp)

The parameters become DTensors over the tp mesh (so FSDP2 composes with them and DCP can
reshard them); the module computes on their local shards.

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4.2.2) is what tp > 1 means here: between the parallel regions
the residual stream, the norms and the MoE block (router, routed experts) work on this
rank's contiguous T/tp slice of the micro-batch's packed tokens (dim 0 of [T, H]), so what
they keep for the backward is divided by tp instead of repeated on every tp rank. Every
change of layout is a DTensor redistribution over the 1-D tp mesh, no hand-written
collective:

    where                          forward                      backward
    first Block's input            Replicate -> Shard(0): slice  all-gather
    Attention / DenseMLP input     Shard(0) -> Replicate:        reduce-scatter
                                   all-gather (gather_from_sp)   (of the partial gradients)
    Attention / DenseMLP output    Partial -> Shard(0):          all-gather
                                   reduce-scatter (reduce_scatter_to_sp)
    last Block's output            Shard(0) -> Replicate:        slice
                                   all-gather

The Blocks of one nn.ModuleList (the trunk) pass the token-sharded residual stream from one
to the next: the first splits its input, the last gathers its output (ShardTokens), so the
embedding before and the final norm, head and LM loss after stay replicated (full T on every
tp rank, as without tp); a Block outside a ModuleList (an MTP module's) splits and gathers
itself, after its module's replicated norms and projection. The attention context (RoPE
tables, mask) stays full-T: attention runs on the gathered tokens. The MoE's shared experts
are a DenseMLP region like the dense MLP; its routed experts see each token once, on the
rank that holds it (no tp split inside fmoe.parallel.ExpertParallel). Their weights stay
whole on every tp rank and get each rank's partial gradient: with this plan alone the
experts' SequenceShard sums those over tp, as it does the router's; under
fmoe.parallel.parallelize FSDP2 sums them over the expert data mesh edp, which holds the tp
ranks, as under expert parallelism (parallelize leaves the experts out of the plan).

Parameters that stay replicated over tp but are used on a token shard (the norms and the
hyper-connections' weights inside Blocks, the MoE router and shared-expert gate) get a partial gradient on each tp rank:
SequenceShard.weight (copy_to_tp) sums it over tp where the weight is used, so their
gradients are whole and alike on every tp rank, as before. The MoE's capacity drop
(cfg.capacity_factor) looks at the micro-batch's whole T tokens (SequenceShard.
drop_by_capacity gathers the routes), so N processes drop what one process drops. The MoE
stats (router logits, aux scores and counts, tokens_per_expert) are per token shard: the
losses over them add up per-rank shares (fmoe.parallel.seq_load_balancing_loss_split,
z_loss_split; load_balancing_loss with counts summed over tp) and the counts are summed over
the ranks (all_reduce_counts), see examples/train_moe.py.

T must be divisible by tp (even shards; ShardTokens raises a ValueError otherwise).

Legend: T tokens (T/tp on a rank between the regions), H hidden, D head dim, F FFN size,
E experts, k slots per token.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from fmoe.model import (Attention, Block, DenseMLP, GroupedExperts, HyperConnection, LinearAttention, MoE, ResidualGate, RMSNorm,
                        TransformerConfig)
from fmoe.ops import drop_by_capacity
from fmoe.ops.routing import Routes, keep_slots
from fmoe.parallel.expert import copy_to_tp, gather_tokens, split_tokens


def gather_from_sp(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """x [T/tp, ...] (this rank's tokens) -> [T, ...] every rank's, in tp rank order
    (Shard(0) -> Replicate: an all-gather); backward reduce-scatters the gradient, which the
    parallel region after it computes in partial sums (Shard(0) <- Partial)."""
    return DTensor.from_local(x, mesh, [Shard(0)], run_check=False).redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])


def reduce_scatter_to_sp(y: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """y [T, ...] partial sums on each tp rank -> this rank's rows [T/tp, ...] of their sum
    (Partial -> Shard(0): a reduce-scatter); backward all-gathers the gradient."""
    return DTensor.from_local(y, mesh, [Partial()], run_check=False).redistribute(mesh, [Shard(0)]).to_local()


@dataclasses.dataclass(frozen=True)
class SequenceShard:
    """What a module that sees only this rank's T/tp tokens needs (set as its
    `sequence_parallel` attribute by SequenceParallelModule; fmoe.model's RMSNorm and MoE
    read it): this rank's tokens are the contiguous rows [r T/tp, (r+1) T/tp) of the
    micro-batch, r = this rank's index in `mesh` (the 1-D tp mesh)."""

    mesh: DeviceMesh

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        """w itself, whose gradient (a sum over this rank's tokens) is summed over the tp
        ranks in the backward (copy_to_tp): a replicated weight used on a token shard."""
        return copy_to_tp(w, self.mesh)

    def rows(self, n: int) -> slice:
        """This rank's rows [r n, (r + 1) n) of the micro-batch, n = T/tp."""
        start = self.mesh.get_local_rank() * n
        return slice(start, start + n)

    def local_rows(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """This rank's n rows of x [T, ...] (rows), the micro-batch's per-token values (a
        MoE's token_mask) alike on every tp rank."""
        if x.shape[0] != n * self.mesh.size():
            raise ValueError(f"x: expected the micro-batch's {n * self.mesh.size()} rows ({n} per tp rank), got {x.shape[0]}")
        return x[self.rows(n)]

    def drop_by_capacity(self, routes: Routes, n_experts: int, capacity_factor: float, *, policy: str = "probs") -> Routes:
        """fmoe.ops.drop_by_capacity over the whole micro-batch, this rank's rows.

        routes: this rank's Routes (weights float32 [T/tp, k], experts [T/tp, k]). The tp
        ranks' routes are all-gathered (one collective, without autograd; float64 holds the
        float32 weights and the ids exactly), the drop runs on the T tokens as in one
        process (capacity ceil(T k / E * capacity_factor), the same slots kept), and this
        rank's rows of its keep mask apply to the local routes (gradients reach the kept
        weights). Returns Routes of the local shapes.
        """
        return drop_by_capacity_over_ranks(routes, n_experts, capacity_factor, policy=policy,
                                           gather=functools.partial(gather_rows, mesh=self.mesh), rows=self.rows(routes.weights.shape[0]))


def gather_rows(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Every rank's x [T_local, ...] stacked in rank order, [ranks T_local, ...] (an
    all-gather over the 1-D mesh; no autograd)."""
    return DTensor.from_local(x, mesh, [Shard(0)], run_check=False).full_tensor()


def drop_by_capacity_over_ranks(routes: Routes, n_experts: int, capacity_factor: float, *, policy: str, gather, rows) -> Routes:
    """fmoe.ops.drop_by_capacity over a micro-batch whose tokens are split over ranks, this
    rank's rows: what one process drops. routes: this rank's Routes (weights float32
    [T_local, k], experts [T_local, k]); gather(packed [T_local, 2 k] float64) -> [T, 2 k]
    every rank's, in token order (float64 holds the float32 weights and the ids exactly;
    no autograd); rows: this rank's rows of the T (a slice or an index tensor). The keep
    mask applies to the local routes, so gradients reach the kept weights. Returns Routes
    of the local shapes (SequenceShard.drop_by_capacity over tp, ContextCapacityDrop over
    cp and tp)."""
    weights_TK, experts_TK = routes
    k = weights_TK.shape[1]
    every = gather(torch.cat([weights_TK.detach().double(), experts_TK.double()], dim=1))
    kept_TK = drop_by_capacity(Routes(every[:, :k].to(weights_TK.dtype), every[:, k:].to(experts_TK.dtype)), n_experts,
                               capacity_factor, policy=policy, check=False).experts
    return keep_slots(routes, kept_TK[rows] >= 0)


class SequenceParallelModule(ParallelStyle):
    """A module whose parameters stay replicated over tp but which runs on this rank's token
    shard (RMSNorm, HyperConnection, ResidualGate inside a Block; MoE: router, shared gate, capacity
    drop): sets its `sequence_parallel` attribute to SequenceShard(tp mesh). Its input is not
    changed."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not hasattr(module, "sequence_parallel"):
            raise ValueError(f"module: {type(module).__name__} has no sequence_parallel attribute (fmoe.model's RMSNorm, HyperConnection, ResidualGate, "
                             "MoE and GroupedExperts have one)")
        if module.sequence_parallel is not None:
            raise ValueError(f"module: {type(module).__name__} is already sequence parallel (tensor-parallelised twice?)")
        module.sequence_parallel = SequenceShard(device_mesh)
        return module


class ShardTokens(ParallelStyle):
    """The edges of a run of token-sharded modules: split_input turns the module's first
    positional input, [T, ...] alike on every tp rank, into this rank's [T/tp, ...] slice
    (backward: all-gather); gather_output turns its output (or the output's first element,
    for a tuple) from [T/tp, ...] back into [T, ...] (backward: this rank's slice of the
    gradient, which the replicated code after it makes alike on every tp rank). ValueError
    unless T is divisible by tp."""

    def __init__(self, *, split_input: bool = True, gather_output: bool = True):
        super().__init__()
        self.split_input, self.gather_output = split_input, gather_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()

        def split(m, args):
            T = args[0].shape[0]
            if T % tp:
                raise ValueError(f"x: the micro-batch's T = {T} tokens do not split evenly over tp = {tp} ranks "
                                 f"(sequence parallelism): make T (tokens_per_micro_batch) a multiple of tp")
            return (split_tokens(args[0], device_mesh), *args[1:])

        def gather(m, args, out):
            if isinstance(out, tuple):
                return (gather_tokens(out[0], device_mesh), *out[1:])
            return gather_tokens(out, device_mesh)

        if self.split_input:
            module.register_forward_pre_hook(split)
        if self.gather_output:
            module.register_forward_hook(gather)
        return module


class _ShardedRegion(ParallelStyle):
    """Shard the named parameters of a module over the tp mesh (dim per name, _shard_dims)
    and wrap its forward in gather_from_sp (first positional input) / reduce_scatter_to_sp
    (output)."""

    shard_dims: dict[str, int] = {}
    where = ""  # the module's name in the model, for messages (tensor_parallel_plan sets it)

    def _shard_dims(self, module: nn.Module) -> dict[str, int]:
        return self.shard_dims

    def _label(self, module: nn.Module) -> str:
        """The module's class and, where known, its name in the model: "DenseMLP 'blocks.1.moe.shared'"."""
        return f"{type(module).__name__} {self.where!r}" if self.where else type(module).__name__

    def _check(self, module: nn.Module, tp: int) -> None:
        for name, dim in self._shard_dims(module).items():
            size = getattr(module, name).shape[dim]
            if size % tp:
                raise ValueError(f"tp: {self._label(module)}: its {name} has {size} rows/cols on dim {dim}, not divisible by tp = {tp}")

    def _configure(self, module: nn.Module, mesh: DeviceMesh) -> None:
        """Adjust the module's per-rank configuration (head counts)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        self._check(module, tp)
        for name, dim in self._shard_dims(module).items():
            param = getattr(module, name)
            if isinstance(param, DTensor):
                raise ValueError(f"module: {type(module).__name__}.{name} is already a DTensor (tensor-parallelised twice?)")
            sharded = distribute_tensor(param.data, device_mesh, [Shard(dim)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        self._configure(module, device_mesh)
        module.register_forward_pre_hook(lambda m, args: (gather_from_sp(args[0], device_mesh), *args[1:]))
        module.register_forward_hook(lambda m, args, out: reduce_scatter_to_sp(out, device_mesh))
        return module


@dataclasses.dataclass(frozen=True)
class HeadShard:
    """What an Attention whose heads are split over the tp ranks needs beyond its sharded
    weights (set as its `tensor_parallel` attribute by AttentionParallel; fmoe.model's
    Attention reads it), and a LinearAttention's or a DenseMLP's (SwiGLUParallel: xIELU's
    scalars, b_down). Every rank runs the region on all T tokens for its own heads (or FFN columns).

    replicated: the names of the parameters every tp rank holds whole and uses for its own
        heads only (a per-head qk norm [D]; multi-latent attention's down projections
        wq_a, wkv_a and their latent norms; xIELU's scalars, for its own FFN columns), or
        adds once over the ranks (the output biases bo and b_down: share()): weight() sums
        their gradients over tp.
    kv_head: with fewer kv heads than tp ranks, the one kv head this rank's query heads read
        (its wk, wv columns: kv_columns); None when the kv heads are split like the others.
    """

    mesh: DeviceMesh
    replicated: tuple[str, ...] = ()
    kv_head: Optional[int] = None

    def kv_columns(self, params: dict, head_dim: int, v_dim: int) -> dict:
        """Grouped-query attention with fewer kv heads than tp ranks (AttentionParallel): wk, wv
        [H, G D] and their biases, which every rank holds whole (replicated), cut to this rank's
        kv head `kv_head` (the one its query heads read), after weight() so that their
        gradients, each rank's slice, are summed over tp; params as they are otherwise."""
        if self.kv_head is None:
            return params
        g, out = self.kv_head, dict(params)
        for name, width in (("wk", head_dim), ("wv", v_dim), ("bk", head_dim), ("bv", v_dim)):
            if out.get(name) is not None:
                out[name] = out[name][..., g * width:(g + 1) * width]
        return out

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        """w itself; its gradient (this rank's heads' share) is summed over the tp ranks."""
        return copy_to_tp(w, self.mesh)

    def share(self, bias: torch.Tensor) -> torch.Tensor:
        """bias / tp, its gradient summed over the tp ranks: an output bias (a replicated name)
        that each rank adds before the ranks' outputs are summed, so that the sum holds it once."""
        return self.weight(bias) / self.mesh.size()

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """The average over the tp ranks of per-token statistics x [T, n] (each rank's over
        its heads, every rank the same number of channels): the statistics over every head.
        An all-reduce; its backward all-reduces the gradient. Used by the qk norm over the
        whole projection (qk_norm="proj"), whose channels the ranks split: q's and k's mean
        squares in one call."""
        return self.sum(x) / self.mesh.size()

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the tp ranks of per-token partial products x [T, n] (each rank's over
        its channels): Mamba-1's dt, B and C, projected from every channel. An all-reduce;
        its backward all-reduces the gradient."""
        total = DTensor.from_local(x, self.mesh, [Partial()], run_check=False).redistribute(self.mesh, [Replicate()])
        return total.to_local(grad_placements=[Partial()])


class _HeadsRegion(_ShardedRegion):
    """A region split over tp by whole heads: its cfg's head counts (_head_counts: the cfg
    fields, head_counts unless the module's kind says otherwise) divisible by tp, and divided
    by it on each rank; the parameters it does not shard every rank holds whole
    (HeadShard.replicated: their gradients summed over tp).

    knobs: the TransformerConfig field each head count was set by where it has another name
    (a refusal names what the user set): the window's or chunk's blocks' local_heads and
    local_kv_heads (tensor_parallel_plan passes them), linear attention's linear_k_heads and
    linear_v_heads; a count not in it is named as its cfg field."""

    head_counts: tuple[str, ...] = ()
    knobs: dict[str, str] = {}

    def __init__(self, knobs: Optional[dict[str, str]] = None):
        if knobs:
            self.knobs = {**self.knobs, **knobs}

    def _head_counts(self, module) -> tuple[str, ...]:
        return self.head_counts

    replicate_kv = False  # AttentionParallel: fewer kv heads than tp ranks, decided from the module's whole config before it is split

    def _check(self, module, tp):
        counts = {name: getattr(module.cfg, name) for name in self._head_counts(module) if not (self.replicate_kv and name == "n_kv_heads")}
        if any(n % tp for n in counts.values()):
            *rest, last = [f"{self.knobs.get(name, name)} = {n}" for name, n in counts.items()]
            listed, each = (f"{', '.join(rest)} and {last}", "both " if len(rest) == 1 else "all ") if rest else (last, "")
            raise ValueError(f"tp: {self._label(module)}: its {listed} must {each}be divisible by tp = {tp}")
        super()._check(module, tp)

    def _configure(self, module, mesh):
        tp = mesh.size()
        kv_head = None
        counts = {name: getattr(module.cfg, name) // tp for name in self._head_counts(module)}
        if self.replicate_kv:  # each rank's query heads read one kv head, which it computes from the whole wk, wv
            G = module.cfg.n_kv_heads
            kv_head, counts["n_kv_heads"] = mesh.get_local_rank() // (tp // G), 1
        module.cfg = dataclasses.replace(module.cfg, **counts)
        replicated = tuple(n for n in module.names if n not in self._shard_dims(module))
        module.tensor_parallel = HeadShard(mesh, replicated, kv_head)


class AttentionParallel(_HeadsRegion):
    """Attention heads split over tp (whole heads: n_heads and n_kv_heads divisible by tp;
    fewer kv heads G than tp, tp % G == 0, as multi-query attention has: wk, wv and their
    biases replicated, each rank computing the one kv head its query heads read,
    HeadShard.kv_head, their gradients summed over tp; not with qk_norm "proj" or
    "head_layer", a mixture of attention heads or block-sparse attention).

    Grouped-query attention: wq, wk, wv Shard(1), wo Shard(0); the biases bq, bk, bv
    Shard(0) with their columns; qk_norm="head" weights [D] replicated (HeadShard.weight),
    qk_norm="proj" weights Shard(0), their mean square averaged over tp (HeadShard.mean);
    qk_norm="head_layer" weights [heads, D] (and biases) Shard(0) with their heads; qk_norm="layer"
    weights and biases [D] replicated; block-sparse attention's indexer (index_topk_blocks): its
    query heads index_wq Shard(1) with their kv heads, index_wk and its norms replicated.
    Multi-latent attention: the per-head up projections wq (or wq_b) and wkv_b Shard(1), wo
    Shard(0); the latent down projections wq_a, wkv_a and the norms kv_a_norm, q_a_norm
    replicated (each rank computes the latents of all T tokens, HeadShard.weight). A mixture
    of attention heads (moa_experts): each expert's wq [E, H, G D] Shard(2) and wo [E, G D, H]
    Shard(1) by their kv heads (a rank's heads g k + j are its kv heads' slots), wk, wv
    Shard(1), the router moa_router replicated (every rank routes all T tokens alike, its
    gradient summed over tp; the balance loss, the same on every rank, attached 1/tp by
    each: fmoe.model.Attention). Either kind: attention sinks and the output gate's bias bg [n_heads] Shard(0) with their heads; the output bias bo [H]
    replicated, each rank adding bo / tp before the ranks' outputs are summed."""

    def _apply(self, module, device_mesh):
        self.replicate_kv = self._replicates_kv(module, device_mesh.size())  # from the whole config, before _configure splits it
        return super()._apply(module, device_mesh)

    def _replicates_kv(self, module, tp: int) -> bool:
        """Grouped-query attention with fewer kv heads G than tp ranks, tp % G == 0 (multi-query
        attention: DeepSeek-V4's one key head): wk, wv and their biases stay whole on every rank."""
        cfg = module.cfg
        G = cfg.n_kv_heads
        if cfg.kv_rank is not None or G >= tp or tp % G:
            return False
        taken = [knob for knob, on in (("qk_norm", cfg.qk_norm in ("proj", "head_layer")), ("moa_experts", cfg.moa_experts is not None),
                                       ("index_topk_blocks", cfg.index_topk_blocks is not None)) if on]
        if taken:
            knob = self.knobs.get("n_kv_heads", "n_kv_heads")  # local_kv_heads in a window's or chunk's block where set
            raise ValueError(f"tp: {knob} = {G} < tp = {tp}: the kv heads are replicated, each rank computing its query heads' one; not with "
                             f"{taken[0]} {getattr(cfg, taken[0])!r} (whose weights follow the kv heads)")
        return True

    def _shard_dims(self, module):
        if self.replicate_kv:  # wk, wv and their biases whole on every rank (HeadShard.kv_columns)
            return {n: d for n, d in self._gqa_dims(module).items() if n not in ("wk", "wv", "bk", "bv")}
        return self._gqa_dims(module)

    def _gqa_dims(self, module):
        cfg = module.cfg
        if cfg.kv_rank is not None:
            dims = {"wq" if cfg.q_rank is None else "wq_b": 1, "wkv_b": 1, "wo": 0}
        elif cfg.moa_experts is not None:  # a mixture of attention heads: each expert's query and output projections by their kv heads
            dims = {"wq": 2, "wk": 1, "wv": 1, "wo": 1}
        else:
            # k_eq_v, kv_shared: no wv; a q latent (q_rank, DeepSeek-V4's): wq_b by heads, wq_a and q_a_norm replicated
            dims = {"wq" if cfg.q_rank is None else "wq_b": 1, "wk": 1, "wo": 0, **({"wv": 1} if cfg.has_wv else {})}
            dims.update({n: 0 for n in ("bq", "bk", "bv") if getattr(module, n, None) is not None})
        if getattr(module, "sinks", None) is not None:
            dims["sinks"] = 0
        if getattr(module, "wg", None) is not None:  # the output gate: its columns with their heads
            dims["wg"] = 1
        if getattr(module, "bg", None) is not None:  # the gate's bias per head
            dims["bg"] = 0
        if cfg.qk_norm in ("proj", "head_layer"):  # never with multi-latent attention; Cohere's [heads, D] with their heads
            dims.update(q_norm=0, k_norm=0, **(dict(q_norm_bias=0, k_norm_bias=0) if cfg.qk_norm_bias else {}))  # Chameleon's biases too
        if cfg.index_topk_blocks is not None:  # block-sparse attention: the indexer's query heads with their kv heads
            dims["index_wq"] = 1
        if cfg.o_groups is not None:  # the grouped output projection: a rank's groups of its heads, and their rows of wo
            dims["wo_a"] = 0
        return dims

    head_counts = ("n_heads", "n_kv_heads")

    def _head_counts(self, module) -> tuple[str, ...]:
        # block-sparse attention's indexer has a head per kv head: split with them; the output projection's groups with their heads
        return (self.head_counts + (("index_heads",) if module.cfg.index_topk_blocks is not None else ())
                + (("o_groups",) if module.cfg.o_groups is not None else ()))


class LinearAttentionParallel(_HeadsRegion):
    """Gated DeltaNet's heads split over tp (whole heads: n_k_heads and n_v_heads divisible
    by tp; value head h reads key head h // (Nv / Nk), so a rank's contiguous value heads read
    its contiguous key heads): the projections and the convolution's taps by their columns,
    A_log, dt_bias by their heads, wo by its rows; the gated output norm's weight [Dv]
    replicated (HeadShard.weight sums its gradient over tp). Lightning attention's norm over
    every head's channels: its weight [N Dv] by its heads, the mean square averaged over tp
    (HeadShard.mean), each rank's decays its own heads' (fmoe.model.LinearAttention). Mamba-1's (kind "mamba1", one group
    of B and C): its channels alone split, dt's, B's and C's projections from them summed over tp (HeadShard.sum), the
    norms on them replicated. Every rank runs the layer on all
    T tokens (the documents of the micro-batch) for its heads; the outputs are summed."""

    head_counts = ("n_k_heads", "n_v_heads")
    knobs = {"n_k_heads": "linear_k_heads", "n_v_heads": "linear_v_heads"}  # fmoe.model.LinearAttention's (TransformerConfig.linear_attention_config)

    def _head_counts(self, module) -> tuple[str, ...]:
        # Mamba-1's one group of B and C, which every rank holds: its channels alone are split
        return ("n_v_heads",) if module.cfg.kind == "mamba1" else self.head_counts

    def _shard_dims(self, module):
        if module.cfg.kind == "mamba1":  # the channels: x's and z's columns, the taps, x_proj's rows (summed over tp), dt_proj's columns
            return dict(wv=1, wz=1, conv_v=1, conv_v_bias=0, wdt=0, wk=0, wq=0, wa=1, dt_bias=0, A_log=0, D=0, wo=0)
        if module.cfg.kind == "short_conv":  # LFM2's: the channels (its heads) of the gates, the input and the taps, wo by its rows
            return dict(wb=1, wc=1, wv=1, conv_v=1, wo=0)
        if module.cfg.kind == "lightning":  # MiniMax's: the output norm's weight by its heads' channels, its mean square over tp
            return dict(wq=1, wk=1, wv=1, wz=1, out_norm=0, wo=0)
        if module.cfg.kind == "mamba2":  # the norm per group of key heads: a rank's groups whole, their weight with them
            norm = {} if module.cfg.gate_norm == "none" else dict(out_norm=0)  # Falcon-H1's gate alone: no norm
            return dict(wq=1, wk=1, wv=1, wz=1, wa=1, conv_q=1, conv_k=1, conv_v=1, conv_q_bias=0, conv_k_bias=0, conv_v_bias=0, A_log=0,
                        dt_bias=0, D=0, **norm, wo=0)
        if module.cfg.kind == "kda" and module.cfg.full_rank:  # Ling's: the decay's and the gate's projections by their heads
            return dict(wq=1, wk=1, wv=1, wz=1, wb=1, wf=1, conv_q=1, conv_k=1, conv_v=1, A_log=0, dt_bias=0, wo=0)
        if module.cfg.kind == "kda":  # the low-rank pairs' second halves by their heads; wf_a, wz_a replicated
            return dict(wq=1, wk=1, wv=1, wz_b=1, wb=1, wf_b=1, conv_q=1, conv_k=1, conv_v=1, A_log=0, dt_bias=0, wo=0)
        return dict(wq=1, wk=1, wv=1, wz=1, wb=1, wa=1, conv_q=1, conv_k=1, conv_v=1, A_log=0, dt_bias=0, wo=0)


class SwiGLUParallel(_ShardedRegion):
    """A dense SwiGLU (dense MLP or shared experts) split over its FFN columns (an MLP without
    a gate, mlp_act "relu2" or "xielu": w_up and w_down alone; the biases b_gate, b_up with
    their columns). xIELU's two learned scalars act on every column, and the output bias
    b_down [H] is added once: each rank holds them whole (adding b_down / tp before the
    ranks' outputs are summed), and their gradients, each rank's share, are summed over tp
    (HeadShard.weight, the module's tensor_parallel)."""

    shard_dims = {"w_gate": 1, "w_up": 1, "w_down": 0, "b_gate": 0, "b_up": 0}

    def _shard_dims(self, module):
        return {name: dim for name, dim in self.shard_dims.items() if getattr(module, name, None) is not None}

    def _configure(self, module, mesh):
        replicated = (("xielu_alpha_p", "xielu_alpha_n") if getattr(module, "act", None) == "xielu" else ()) + \
            (("b_down",) if getattr(module, "b_down", None) is not None else ())
        if replicated:
            module.tensor_parallel = HeadShard(mesh, replicated=replicated)


def _block_edges(model: nn.Module, name: str, block: Block) -> tuple[bool, bool]:
    """(first, last) of `block` in its run: the Blocks of one nn.ModuleList run one after
    the other; a Block elsewhere is a run of its own."""
    parent = model.get_submodule(name.rpartition(".")[0]) if name else None
    if not isinstance(parent, nn.ModuleList):
        return True, True
    run = [m for m in parent if isinstance(m, Block)]
    return block is run[0], block is run[-1]


def _attention_knobs(model: nn.Module, attention: Attention) -> dict[str, str]:
    """The TransformerConfig knobs an Attention's head counts were set by where they have
    other names: a window's or chunk's block's local_heads and local_kv_heads, where the
    model's config sets them (TransformerConfig.attention_config(local=True))."""
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, TransformerConfig) or (attention.cfg.window is None and attention.cfg.chunk is None):
        return {}
    return {field: knob for field, knob in (("n_heads", "local_heads"), ("n_kv_heads", "local_kv_heads")) if getattr(cfg, knob) is not None}


def _planless_modules(block: Block) -> list[tuple[str, nn.Module]]:
    """(name in the block, module) of each module inside a Block that the plan does not cover
    and that holds parameters: a module that is not fmoe's (torch's nn.RMSNorm or nn.Linear,
    an attention of one's own), outside every module the plan gives a style to. fmoe's other
    modules and parameterless ones of torch (a dropout, a container) are looked into."""
    covered = (Attention, LinearAttention, DenseMLP, MoE, RMSNorm, HyperConnection, ResidualGate, GroupedExperts)
    found, stack = [], list(block.named_children())
    while stack:
        name, module = stack.pop()
        if isinstance(module, covered):
            continue
        if type(module).__module__.split(".")[0] != "fmoe" and next(module.parameters(), None) is not None:
            found.append((name, module))
            continue
        stack.extend((f"{name}.{child_name}", child) for child_name, child in module.named_children())
    return sorted(found, key=lambda item: item[0])


def tensor_parallel_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The parallelize_module plan for fmoe's reference model, or any module tree whose
    Attention, DenseMLP and MoE modules sit in fmoe.model Blocks (module docstring):

        every Attention                   AttentionParallel (heads)
        every LinearAttention             LinearAttentionParallel (heads)
        every DenseMLP (dense MLPs,       SwiGLUParallel (FFN columns)
        MoE blocks' shared experts)
        every MoE, its routed experts     SequenceParallelModule (replicated weights on a
        (GroupedExperts), every RMSNorm,  token shard, their gradients summed over tp; the
        HyperConnection and ResidualGate  MoE's capacity drop)
        in a Block
        the first / last Block of each    ShardTokens (split the input / gather the output)
        nn.ModuleList of Blocks, a Block
        outside one (both)

    Routed experts are not split (fmoe.parallel.shard_experts shards them over ep / etp);
    fmoe.parallel.parallelize leaves them out of the plan, its FSDP2 summing their gradients.
    RMSNorms outside Blocks (a final norm, MTP modules' norms) stay replicated. ValueError
    for an Attention, DenseMLP or MoE outside every Block: sequence parallelism needs to
    know where the token shards begin and end (apply ShardTokens in your own plan); and for a
    module of one's own with parameters inside a Block (torch's nn.RMSNorm in place of
    fmoe's, an attention of one's own): it would run on the rank's T/tp token shard with no
    plan, seeing a share of the tokens and getting a share of its gradients. A hook of one's
    own on a Block sees the token shard too (not checked).
    """
    blocks = {name: m for name, m in model.named_modules() if isinstance(m, Block)}

    def in_block(name: str) -> bool:
        return any(b == "" or name.startswith(b + ".") for b in blocks)

    for block_name, block in blocks.items():
        for name, module in _planless_modules(block):
            where = f"{block_name}.{name}" if block_name else name
            raise ValueError(f"model: {type(module).__name__} {where!r} inside a fmoe.model.Block is a module of one's own with parameters, "
                             "which tensor parallelism has no plan for: each tp rank runs a Block on its T/tp token shard (sequence "
                             "parallel), so it would see that share of the tokens and its weights would get that rank's share of their "
                             "gradients, without a word; use fmoe.model's modules there (RMSNorm, Attention, DenseMLP, MoE) or tp = 1")
    plan = {}
    for name, module in model.named_modules():
        if isinstance(module, (Attention, LinearAttention, DenseMLP, MoE)) and not in_block(name):
            raise ValueError(f"model: {type(module).__name__} {name!r} is not inside a fmoe.model.Block; sequence parallelism "
                             "splits tokens at Blocks: put it in one (a Block's attn or mlp), or build your own plan with this plan's "
                             "styles (fmoe.parallel: ShardTokens at the edges of the token-sharded run, AttentionParallel, "
                             "LinearAttentionParallel, SwiGLUParallel for dense MLPs and a MoE's shared experts, SequenceParallelModule "
                             "for a MoE and the norms inside the run)")
        if isinstance(module, Attention):
            plan[name] = AttentionParallel(_attention_knobs(model, module))
        elif isinstance(module, LinearAttention):
            plan[name] = LinearAttentionParallel()
        elif isinstance(module, DenseMLP):  # dense blocks' MLPs and MoE blocks' shared experts
            plan[name] = SwiGLUParallel()
        elif isinstance(module, MoE) or (isinstance(module, (RMSNorm, HyperConnection, ResidualGate, GroupedExperts)) and in_block(name)):
            plan[name] = SequenceParallelModule()
        elif isinstance(module, Block):
            first, last = _block_edges(model, name, module)
            if first or last:
                plan[name] = ShardTokens(split_input=first, gather_output=last)
    for name, style in plan.items():
        if isinstance(style, _ShardedRegion):
            style.where = name
    return plan
