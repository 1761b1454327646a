"""Pipeline parallelism for the reference model on torch.distributed.pipelining.

    layers = stage_layers(n_layers=8, n_stages=4)           # [range(0, 2), range(2, 4), ...]
    pipe = Pipeline(cfg, meshes, schedule="1f1b", virtual=1, loss_fn=..., tokens=T, device=..., dtype=...,
                    parallelize=..., materialize=...)
    for chunk in pipe.chunks: ...                          # this rank's Transformers (pruned)
    logged, counts = pipe.step(micro_batches)              # forward + backward of one step

The pp axis is the outermost of fmoe.parallel.build_meshes: each pipeline stage is a full
dp_replicate x dp_shard x cp x tp world of its own, with the expert view folded within it.

The split. The trunk's n_layers blocks are cut into pp x virtual stages of consecutive
blocks (`stage_layers`: an even split, the first stages taking one more when it does not
divide, or explicit sizes). Stage 0 also holds the embedding; the last stage the final
norm, the head (and with them the LM loss) and the MTP modules, which need the embedding
too: the last stage holds a copy of it, with the same initial values (a function of the
seed and the name "embed", fmoe.model.init_value), whose gradient is summed with the first
stage's every step (`Pipeline.sync_tied_grads`), so both copies take the same optimizer
steps. Each stage is a `fmoe.model.Transformer` built whole on the meta device and pruned
(`pipeline_chunk`): the blocks of other stages are replaced by placeholders, so parameter
names (and checkpoint keys, initial values) are those of the whole model, and a checkpoint
saved at any pp loads at any other. Rank r holds stages r, r + pp, ..., r + (virtual - 1) pp.

The schedule. torch.distributed.pipelining's PipelineStage and schedules run the
micro-batches of one optimizer step: `gpipe`, `1f1b`, `interleaved_1f1b` and `looped_bfs`
(torch's zero-bubble and DualPipeV schedules were tried and left out: SCHEDULES says why).
The step's micro-batches are the schedule's micro-batches; each stage's module reads
its micro-batch (positions, cu_seqlens, labels, MTP rows) from the step's list by the
micro-batch index the schedule passes along (a keyword argument, chunked like the inputs),
and builds its own context. Stage 0's input is the micro-batch's token ids, the others' the
previous stage's hidden state [T, H] (in the compute dtype; [T, n H], the n streams, with
hyper_connections). The last stage returns the micro-batch's loss, already divided by the step's global valid-token counts: gradients are
not scaled by the schedule (scale_grads=False), and the loss is still a sum over tokens
divided by the step's count.

Balancing losses of middle stages. Only the last stage's output reaches a loss, so a
stage's own balancing losses (sequence aux, switch aux, z-loss of its MoE layers) are
attached to its output with `attach_loss`: the identity in the forward, and in the backward
the incoming gradient plus a gradient of 1 for the attached loss (Megatron's
MoEAuxLossAutoScaler does the same), so their gradients reach the router when the
pipeline's backward reaches the stage.

FSDP2 inside a stage: each stage's module (StageModule, holding the pruned Transformer)
is fully_shard-ed over the stage's dense data mesh (no parameters of its own; the units
inside are parallelize's), so the schedule drives FSDP as torch intends: gradients
accumulate unsharded over the step's micro-batches and are reduce-scattered once, after
the last backward.

Limits (ValueErrors naming the knob): more stages than trunk layers; schedules' constraints
on the micro-batch count (1F1B needs at least as many micro-batches per data-parallel rank
as stages; interleaved 1F1B a multiple of its rounds, max(1, n // pp)); single-stage
schedules take virtual = 1, the looped ones virtual >= 2.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fmoe.layers import attach_loss
from fmoe.model import LayerElsewhere, PipelineChunk, Transformer, TransformerConfig
from fmoe.ops.checks import check_positive_int
from fmoe.parallel.mesh import Meshes

# name -> (torch schedule class name, stages per rank: "one" | "loop"). torch's
# zero-bubble schedules (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble,
# ScheduleDualPipeV) were tried with torch 2.13 and are not offered: they split each backward
# into input and weight gradients (stage_backward_input / stage_backward_weight), and with
# this model (FSDP2 units inside the stage, custom autograd functions) the weight gradients
# came out wrong (interleaved_zb: step-1 gradient norm 3.53 where one process has 5.12) or
# the V ones failed ("can't steal_bwd_input if this stage doesn't have backward").
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "one"),
    "1f1b": ("Schedule1F1B", "one"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", "loop"),
}


def stage_layers(n_layers: int, n_stages: int, layers_per_stage: Optional[Sequence[int]] = None) -> list[range]:
    """The trunk blocks of each pipeline stage, in stage order: consecutive ranges covering
    range(n_layers). Even by default (the first n_layers % n_stages stages take one more
    block), or the explicit sizes `layers_per_stage` (one positive int per stage, summing to
    n_layers). ValueError naming the knob for more stages than layers or bad sizes.

    >>> stage_layers(5, 2)
    [range(0, 3), range(3, 5)]
    """
    for name, value in (("n_layers", n_layers), ("n_stages", n_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if layers_per_stage is None:
        if n_stages > n_layers:
            raise ValueError(f"pp: {n_stages} pipeline stages (pp x pp_virtual) for {n_layers} trunk layers (n_layers): "
                             "every stage needs at least one layer")
        base, extra = divmod(n_layers, n_stages)
        sizes = [base + (s < extra) for s in range(n_stages)]
    else:
        sizes = list(layers_per_stage) if hasattr(layers_per_stage, "__iter__") else None
        if sizes is None or len(sizes) != n_stages or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes) or sum(sizes) != n_layers:
            raise ValueError(f"layers_per_stage: expected {n_stages} positive ints (one per stage, pp x pp_virtual) "
                             f"summing to n_layers = {n_layers}, got {layers_per_stage if sizes is None else sizes!r}")
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def rank_stages(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """The stage indices rank `pp_rank` holds, in order: r, r + pp, ..., r + (virtual - 1) pp."""
    check_positive_int("pp", pp)
    check_positive_int("virtual", virtual)
    check_positive_int("pp_rank", pp_rank, 0, pp - 1)
    return [pp_rank + v * pp for v in range(virtual)]


def pipeline_chunk(model: Transformer, chunk: PipelineChunk) -> Transformer:
    """Prune `model` (a whole Transformer, best built on the meta device) in place to the
    part `chunk` holds, and set model.pipeline_chunk: blocks outside chunk.layers become
    LayerElsewhere placeholders; the embedding stays on the first stage (and on the last
    when there are MTP modules); the final norm, head (with hyper-connections' hc_head) and
    MTP modules on the last. Call it before fmoe.parallel.parallelize. Returns model."""
    if not isinstance(model, Transformer):
        raise ValueError(f"model: expected a fmoe.model.Transformer, got {type(model).__name__}")
    if not isinstance(chunk, PipelineChunk):
        raise ValueError(f"chunk: expected a fmoe.model.PipelineChunk, got {type(chunk).__name__}")
    for name in ("stage", "n_stages"):
        if isinstance(getattr(chunk, name), bool) or not isinstance(getattr(chunk, name), int):
            raise ValueError(f"chunk: expected an int {name}, got {getattr(chunk, name)!r}")
    if chunk.n_stages < 1 or not 0 <= chunk.stage < chunk.n_stages:
        raise ValueError(f"chunk: expected stage in 0..n_stages - 1 and n_stages >= 1, got stage {chunk.stage} of {chunk.n_stages}")
    n = len(model.blocks)
    if not isinstance(chunk.layers, range) or not chunk.layers or chunk.layers.start < 0 or chunk.layers.stop > n or chunk.layers.step != 1:
        raise ValueError(f"chunk: expected a non-empty range of consecutive layers within range({n}), got {chunk.layers}")
    _check_stage(model.cfg, chunk.layers)
    for i in range(n):
        if i not in chunk.layers:
            model.blocks[i] = LayerElsewhere(i)
    if not chunk.first and not (chunk.last and (model.cfg.mtp_depth or model.cfg.tie_embeddings)):
        model.embed = None
    if not chunk.first:
        model.embed_norm = None  # the trunk's input alone (the MTP modules norm their embeddings with their own)
        model.pos_embed = None  # learned positions (abs_positions): the trunk's input alone
    if not chunk.last:
        model.norm = None
        model.hc_head = None
        model.head = None
        model.head_bias = None
        model.mtp = nn.ModuleList()
    model.pipeline_chunk = chunk
    return model


def _check_stage(cfg: TransformerConfig, layers: range) -> None:
    """ValueError naming chunk unless the blocks `layers` run on their own: no block reusing
    the keys another stage's block chose, no shortcut pair cut in two; it says how
    (Pipeline's layers_per_stage, fewer stages)."""
    for i in layers:  # DeepSeek sparse attention: a block reusing another's choice of keys needs it in its own forward
        if cfg.is_index_shared(i) and cfg.index_source(i) not in layers:
            raise ValueError(f"chunk: block {i} attends to the keys block {cfg.index_source(i)} chose (index_shared_layers), "
                             f"which is in another stage than blocks {layers.start}..{layers.stop - 1}; give the two one stage "
                             "(layers_per_stage), or use fewer stages or other index_shared_layers")
    for i in layers:  # a shortcut pair hands its MoE's output from one block to the next: one stage holds both
        pair = (i - 1, i) if cfg.shortcut(i) == "in" else (i, i + 1) if cfg.shortcut(i) == "out" else (i, i)
        if not all(j in layers for j in pair):
            raise ValueError(f"chunk: blocks {pair[0]} and {pair[1]} are a shortcut pair (shortcut_moe), the first's MoE output added "
                             f"in the second, and the stage of blocks {layers.start}..{layers.stop - 1} holds one of them; give each pair one "
                             "stage (layers_per_stage), or use fewer stages")


def check_schedule(schedule: str, virtual: int) -> str:
    """ValueError naming the knob unless `schedule` is a SCHEDULES name that runs `virtual`
    stages per rank; returns its style ("one" or "loop")."""
    if not isinstance(schedule, str) or schedule not in SCHEDULES:
        raise ValueError(f"pp_schedule: expected one of {', '.join(SCHEDULES)}, got {schedule!r}")
    style = SCHEDULES[schedule][1]
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
        raise ValueError(f"pp_virtual: expected a positive int, got {virtual!r}")
    if style == "one" and virtual != 1:
        raise ValueError(f"pp_virtual: the {schedule} schedule runs one stage per rank, got pp_virtual = {virtual}")
    if style == "loop" and virtual < 2:
        raise ValueError(f"pp_virtual: the {schedule} schedule runs several stages per rank (pp_virtual >= 2), got {virtual}")
    return style


def check_micro_batches(schedule: str, n: int, pp: int, virtual: int = 1) -> None:
    """ValueError naming the knob (batch_schedule) unless `schedule` can run n micro-batches
    per step on each data-parallel rank with pp ranks of `virtual` stages each."""
    check_schedule(schedule, virtual)
    check_positive_int("pp", pp)
    S = pp * virtual
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"batch_schedule: expected at least one micro-batch per data-parallel rank, got {n!r}")
    if schedule == "1f1b" and n < S:
        raise ValueError(f"batch_schedule: the {schedule} schedule needs at least as many micro-batches per data-parallel rank "
                         f"as pipeline stages ({S}), got {n}")
    if schedule == "interleaved_1f1b":
        rounds = max(1, n // pp)
        if n % rounds:
            raise ValueError(f"batch_schedule: the {schedule} schedule needs the micro-batches per data-parallel rank ({n}) "
                             f"to be a multiple of its rounds max(1, n // pp) = {rounds}: e.g. a multiple of pp = {pp}")


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch as a stage reads it: the batch on the device (split for context
    parallelism), and whether it is padding (a data-parallel rank short of micro-batches
    runs a copy with zero loss so that it joins every collective)."""

    batch: object
    padding: bool = False


# loss_fn(out, stats, batch, model) -> (loss, logged): out is the Transformer's losses
# TensorDict on the last stage and None elsewhere; stats the stage's MoE stats; model the
# stage's (pruned) Transformer, for what its layers keep from the forward (e.g. DeepSeek sparse
# attention's indexer losses, Transformer.index_loss_sum); loss the stage's share of the step's
# loss (a 0-D tensor) or None; logged {name: detached 0-D tensor} to sum
LossFn = Callable[[Optional[object], object, object, Transformer], tuple[Optional[torch.Tensor], dict]]


class StageModule(nn.Module):
    """The module torch's PipelineStage runs for one stage: forward(x, *, micro_batch)
    reads micro-batch `micro_batch` of the step (`micro_batches`), runs the pruned
    Transformer `model` (x: token ids on the first stage, else the previous stage's hidden
    state) and returns the hidden state with the stage's loss attached, or on the last
    stage the loss. It sums what `loss_fn` logs and the MoE layers' tokens_per_expert over
    the step's micro-batches (`logged`, `counts`; padding left out). With `evaluating`
    set it returns the hidden state, or on the last stage the LM loss sum."""

    def __init__(self, model: Transformer, loss_fn: LossFn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.micro_batches: list[MicroBatch] = []
        self.evaluating = False
        self.logged: dict = {}
        self.counts: dict = {}

    def forward(self, x, *, micro_batch):
        chunk = self.model.pipeline_chunk
        mb = self.micro_batches[int(micro_batch.reshape(-1)[0])]  # a host tensor: no device read
        batch = mb.batch
        out, stats = self.model(batch, self.model.context(batch), hidden=None if chunk.first else x)
        if self.evaluating:
            return out["lm_sum"] if chunk.last else out
        loss, logged = self.loss_fn(out if chunk.last else None, stats, batch, self.model)
        if mb.padding:
            loss = loss * 0.0 if loss is not None else None
        else:
            for name, value in logged.items():
                self.logged[name] = self.logged.get(name, 0) + value
            for name, layer in stats.items():
                self.counts[name] = self.counts.get(name, 0) + layer["tokens_per_expert"]
        if chunk.last:
            if loss is None:
                raise ValueError("loss_fn: returned no loss on the last stage")
            return loss
        return out if loss is None else attach_loss(out, loss)


class Pipeline:
    """This rank's part of a pipeline-parallel Transformer (module docstring).

    Args:
        cfg: the whole model's TransformerConfig.
        meshes: fmoe.parallel.build_meshes(pp=..., ...) (meshes.pp_mesh set).
        schedule: a name in SCHEDULES. virtual: stages per rank (pp_virtual).
        loss_fn: see LossFn; the train loop's losses of one micro-batch on one stage.
        tokens: the tokens of a micro-batch on this rank (T / cp), for the stages' buffers.
        device, dtype: where the stages run and the compute dtype of the hidden states:
            param_dtype's when it is given, else the parameters' (ValueError otherwise).
        layers_per_stage: explicit stage sizes (stage_layers), or None for an even split (of
            whole pairs with cfg.shortcut_moe).
        parallelize: a function (model) -> None that shards a meta-device chunk over the
            stage's meshes (fmoe.parallel.parallelize with the caller's precision) and
            materialize: (model) -> None that allocates and initialises it.

    Attributes: chunks (this rank's pruned Transformers, stage order), stages (their
    PipelineStages), modules (StageModules), layers (every stage's range, printable),
    stage_ids (the stage index of each chunk).
    """

    def __init__(
        self, cfg: TransformerConfig, meshes: Meshes, *, schedule: str, virtual: int, loss_fn: LossFn, tokens: int,
        device, dtype: torch.dtype, parallelize: Callable, materialize: Callable, layers_per_stage: Optional[Sequence[int]] = None,
        param_dtype: Optional[torch.dtype] = None, reduce_dtype: Optional[torch.dtype] = None,
    ):
        from torch.distributed.pipelining import PipelineStage

        check_schedule(schedule, virtual)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype: expected a floating-point torch.dtype for the hidden states between stages, got {dtype!r}")
        if param_dtype is not None and dtype != param_dtype:  # buffers of one size, hidden states of another: gloo aborted
            raise ValueError(f"dtype: the hidden states between stages are computed in param_dtype ({param_dtype}, FSDP2's mixed "
                             f"precision), got dtype {dtype}")
        for name, fn in (("loss_fn", loss_fn), ("parallelize", parallelize), ("materialize", materialize)):
            if not callable(fn):
                raise ValueError(f"{name}: expected a callable, got {type(fn).__name__}")
        if getattr(meshes, "pp_mesh", None) is None:
            raise ValueError("meshes: built without a pipeline axis (build_meshes(pp=...) with pp > 1)")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"device: expected a torch.device or its name, got {device!r} ({err})") from None
        if device.type != meshes.pp_mesh.device_type:
            raise ValueError(f"device: expected a {meshes.pp_mesh.device_type} device, the meshes' device type, got {device}")
        self.schedule_name, self.meshes, self.device = schedule, meshes, device
        self.pp, self.virtual = meshes.pp, virtual
        self.n_stages = self.pp * virtual
        if layers_per_stage is None and cfg.shortcut_moe:  # whole shortcut pairs per stage, as even as they go
            if self.n_stages > cfg.n_layers // 2:
                raise ValueError(f"pp: {self.n_stages} pipeline stages (pp x pp_virtual) for {cfg.n_layers // 2} shortcut pairs of blocks "
                                 "(shortcut_moe): every stage needs at least one pair")
            layers_per_stage = [2 * len(r) for r in stage_layers(cfg.n_layers // 2, self.n_stages)]
        self.layers = stage_layers(cfg.n_layers, self.n_stages, layers_per_stage)
        for layers in self.layers:  # every stage's, on every rank: one refused on its own rank alone left the others waiting
            _check_stage(cfg, layers)
        self.tokens = check_positive_int("tokens", tokens)
        self.stage_ids = rank_stages(meshes.pp_rank, self.pp, virtual)
        self.loss_fn = loss_fn
        self.chunks: list[Transformer] = []
        self.modules: list[StageModule] = []
        self.stages = []
        self._metas: list[tuple[torch.Tensor, torch.Tensor]] = []  # (inputs, outputs) of each stage, on meta
        self._eval: dict[int, object] = {}
        group = meshes.pp_mesh.get_group()
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
        from fmoe.parallel.fsdp import dense_data_mesh, shard_unit

        for s in self.stage_ids:
            chunk = PipelineChunk(s, self.n_stages, self.layers[s])
            with torch.device("meta"):
                model = Transformer(cfg)
            pipeline_chunk(model, chunk)
            parallelize(model)
            materialize(model)
            held = {p.dtype for p in model.parameters() if p.is_floating_point()}
            if param_dtype is None and dtype not in held:  # the stage computes in its parameters' dtype
                raise ValueError(f"dtype: the hidden states between stages are computed in the parameters' dtype "
                                 f"({', '.join(sorted(map(str, held)))}) without a param_dtype, got dtype {dtype}; "
                                 "give param_dtype for mixed precision")
            module = StageModule(model, loss_fn)
            shard_unit(module, mesh=dense_data_mesh(meshes), mp_policy=mp)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
            # the stages' static metadata (no shape inference run): the hidden state between
            # stages requires grad, so its gradient travels back
            hidden = torch.empty(tokens, cfg.stream_width, dtype=dtype, device="meta", requires_grad=True)
            inputs = torch.empty(tokens, dtype=torch.long, device="meta") if chunk.first else hidden
            outputs = torch.empty((), dtype=torch.float32, device="meta") if chunk.last else hidden
            self.chunks.append(model)
            self.modules.append(module)
            self._metas.append((inputs, outputs))
            self.stages.append(PipelineStage(module, s, self.n_stages, self.device, input_args=inputs, output_args=outputs, group=group))
        self._schedule: Optional[tuple[int, object]] = None  # (n, the torch schedule of the last step)
        self.tied_group = self._tied_group(cfg)

    # ------------------------------------------------------------------ the schedule
    def check_micro_batches(self, n: int) -> None:
        """check_micro_batches for this pipeline's schedule."""
        check_micro_batches(self.schedule_name, n, self.pp, self.virtual)

    def schedule(self, n: int):
        """The torch schedule for n micro-batches: the last step's when it had n too, else a
        new one. A torch schedule sizes its stages' buffers for its n at its first step
        only: one kept for each n ran a count used before (3, 2, 3) on the buffers of the
        count between (torch's "Chunk id 2 is out of range" on one rank, the others hung)."""
        if self._schedule is None or self._schedule[0] != n:
            import torch.distributed.pipelining as pipelining

            self.check_micro_batches(n)
            cls_name, style = SCHEDULES[self.schedule_name]
            cls = getattr(pipelining, cls_name, None)
            if cls is None:
                raise ValueError(f"pp_schedule: {self.schedule_name} ({cls_name}) is not in this torch's torch.distributed.pipelining")
            stages = self.stages[0] if style == "one" else self.stages
            self._schedule = (n, cls(stages, n, loss_fn=_loss_is_output, scale_grads=False))
        return self._schedule[1]

    def step(self, micro_batches: Sequence[MicroBatch]) -> tuple[dict, dict]:
        """Forward and backward of one optimizer step's micro-batches (this rank's share)
        through the pipeline; gradients accumulate in the chunks' parameters. Returns the
        sums of what loss_fn logged and the MoE counts over this rank's stages (names of
        layers held elsewhere absent). Every data-parallel rank passes the same number of
        micro-batches, a rank short of them padding with MicroBatch(..., padding=True) copies
        (examples/train_moe.py does): a count that differs leaves the ranks in different
        collectives of the gradients' reduction, and they wait on each other for ever (the
        count is not exchanged here: that would be a collective and a host sync per step)."""
        n = len(micro_batches)
        schedule = self.schedule(n)
        self._check_micro_batches(micro_batches)
        for module in self.modules:
            module.micro_batches, module.logged, module.counts, module.evaluating = list(micro_batches), {}, {}, False
        index = torch.arange(n)
        args = (torch.cat([mb.batch["input_ids"] for mb in micro_batches]),) if self.stage_ids[0] == 0 else ()
        target = torch.arange(n) if self.n_stages - 1 in self.stage_ids else None
        schedule.step(*args, target=target, return_outputs=False, micro_batch=index)
        logged, counts = {}, {}
        for module in self.modules:
            for name, value in module.logged.items():
                logged[name] = logged.get(name, 0) + value
            counts.update(module.counts)
            module.micro_batches = []
        return logged, counts

    def _check_micro_batches(self, micro_batches) -> None:
        """ValueError unless each is a MicroBatch of `tokens` token ids (the stages' buffers'
        size: another T aborted the transfers between stages) that the model takes
        (Transformer.check_batch: its entries, MTP rows, a cp split); on every rank alike when
        every rank is given the same kind of micro-batches."""
        for i, mb in enumerate(micro_batches):
            if not isinstance(mb, MicroBatch):
                raise ValueError(f"micro_batches[{i}]: expected a fmoe.parallel.MicroBatch, got {type(mb).__name__}")
            ids = mb.batch["input_ids"]
            if ids.ndim != 1 or ids.shape[0] != self.tokens:
                raise ValueError(f"micro_batches[{i}]: expected {self.tokens} token ids (the Pipeline's tokens), got shape {tuple(ids.shape)}")
            try:  # the model's own check, on every rank before the schedule (a refusal inside a stage closed the
                self.chunks[0].check_batch(mb.batch)  # connection under the other stages, which never saw the message)
            except ValueError as err:
                raise ValueError(f"micro_batches[{i}]: {err}") from None

    # ------------------------------------------------------------------ tied embedding
    def _tied_group(self, cfg: TransformerConfig) -> Optional[dist.ProcessGroup]:
        """The 2-rank groups (first stage's rank, last stage's rank) of each coordinate
        within a stage, when the last stage holds an embedding copy on another rank."""
        last_rank = (self.n_stages - 1) % self.pp  # pp - 1: never the first stage's rank
        if not (cfg.mtp_depth or cfg.tie_embeddings):
            return None
        world, mine = dist.get_world_size(), None
        stage = world // self.pp
        for c in range(stage):  # every rank creates every group, in the same order
            group = dist.new_group([c, last_rank * stage + c])
            if dist.get_rank() in (c, last_rank * stage + c):
                mine = group
        return mine

    def embed_copies(self) -> list[nn.Parameter]:
        """This rank's embedding parameters (first stage, and the last stage's copy)."""
        return [c.embed for c in self.chunks if c.embed is not None]

    @torch.no_grad()
    def sync_tied_grads(self) -> None:
        """Sum the embedding's gradients of the first stage and of the last stage's copy, on
        both (after the step's backward, before clipping): both copies then take the same
        optimizer steps. No-op without MTP (the last stage holds no copy)."""
        from fmoe.ops.backend import local_tensor

        copies = self.embed_copies()
        if copies and self.tied_group is not None:  # one per rank: the first stage's, or the last's
            p = copies[0]
            if p.grad is None:  # a loss that left the MTP modules out: zeros, so that both ranks join the sum (one waited)
                p.grad = torch.zeros_like(p)
            dist.all_reduce(local_tensor(p.grad), group=self.tied_group)

    @torch.no_grad()
    def tied_mismatches(self) -> list[str]:
        """["embed"] when a last stage's embedding copy no longer holds, bit for bit, the
        first stage's embedding it copies (the copy of the same shard, on the rank of the
        same coordinate within the stage), else []: what replica_mismatches, which looks
        within a stage, cannot see. A collective over the whole world (a hash exchanged in
        each 2-rank tied group, then one all_reduce), with the same answer on every rank;
        call it between steps, as replica_mismatches. [] without MTP or tied embeddings."""
        from fmoe.optim.grads import collective_device
        from fmoe.parallel.health import bits_hash

        copies = self.embed_copies()
        mine = bits_hash(copies[0]) if self.tied_group is not None and copies else None
        device = collective_device(dist.group.WORLD, [mine] if mine is not None else [])
        differ = torch.zeros((), dtype=torch.int64, device=device)
        if mine is not None:
            mine = mine.to(device)
            both = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(both, mine, group=self.tied_group)
            differ = (both[0] != both[1]).to(torch.int64)
        dist.all_reduce(differ, op=dist.ReduceOp.MAX)
        return ["embed"] if int(differ) else []

    def norm_parameters(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(the parameters the gradient norm counts, the copies it scales without counting):
        every parameter of this rank's chunks, the last stage's embedding copy apart."""
        counted, copies = [], []
        for chunk in self.chunks:
            for name, p in chunk.named_parameters():
                tied = name == "embed" and chunk.pipeline_chunk.last and not chunk.pipeline_chunk.first
                (copies if tied else counted).append(p)
        return counted, copies

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, micro_batches: Sequence[MicroBatch]) -> Optional[torch.Tensor]:
        """The [n] LM loss sums of the n micro_batches (one each: a validation loss per data
        source needs them apart) on the rank holding the last stage, None on the others:
        forward only, through stages of their own (the training stages' buffers stay as
        they are) over the same modules."""
        from torch.distributed.pipelining import PipelineStage

        n = len(micro_batches)
        if n < 1:
            raise ValueError("micro_batches: expected at least one micro-batch to evaluate, got none")
        self._check_micro_batches(micro_batches)
        if n not in self._eval:
            import torch.distributed.pipelining as pipelining

            stages = [PipelineStage(m, st.stage_index, st.num_stages, self.device, input_args=inputs, output_args=outputs, group=st.group)
                      for m, st, (inputs, outputs) in zip(self.modules, self.stages, self._metas)]
            if SCHEDULES[self.schedule_name][1] == "one":  # forward only: any order does, this one has no constraint
                self._eval[n] = pipelining.ScheduleGPipe(stages[0], n, loss_fn=_loss_is_output, scale_grads=False)
            else:
                self._eval[n] = pipelining.ScheduleLoopedBFS(stages, n, loss_fn=_loss_is_output, scale_grads=False)
        for module in self.modules:
            module.micro_batches, module.evaluating = list(micro_batches), True
        losses: list[torch.Tensor] = []
        args = (torch.cat([mb.batch["input_ids"] for mb in micro_batches]),) if self.stage_ids[0] == 0 else ()
        last = self.n_stages - 1 in self.stage_ids
        try:
            self._eval[n].eval(*args, target=torch.arange(n) if last else None, losses=losses if last else None,
                               return_outputs=False, micro_batch=torch.arange(n))
        finally:
            for module in self.modules:
                module.micro_batches, module.evaluating = [], False
        return torch.stack(losses) if last else None


def _loss_is_output(output, target):
    """The schedule's loss_fn: the last stage's output is its loss already."""
    return output
