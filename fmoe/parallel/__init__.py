"""fmoe.parallel: PyTorch's distributed engine (DeviceMesh, DTensor, FSDP2, functional
collectives, DCP) arranged for MoE models. DESIGN.md "Parallelism".

    build_meshes, Meshes, plan_sizes      the dense / batch / expert meshes with MoE folding
    leave_ranks                        end a rank's process after its work: barrier, destroy, exit 0
    parallelize, apply_fsdp, shard_experts  TP -> EP -> FSDP2 on the reference model
    materialize                        a meta-device model, parallelized, allocated shard by shard
    gathered                           FSDP2 units kept gathered across calls (decode's steps)
    ExpertParallel, dispatch, combine, DispatchMeta   expert (and expert-tensor) parallel all-to-all
    permute_padded, dispatch_padded, combine_padded, PaddedDispatchMeta   the same in fixed-size
                                       capacity-padded buffers: no host sync
    split_tokens, gather_tokens        tokens split over tp ranks (Replicate -> Shard(0)) and gathered back
    tensor_parallel_plan, ShardTokens, SequenceShard, HeadShard, copy_to_tp, gather_from_sp,
    reduce_scatter_to_sp               tensor parallel with sequence parallelism (parallelize_module)
    AttentionParallel, LinearAttentionParallel, SwiGLUParallel, SequenceParallelModule   the
                                       plan's styles, for a plan of one's own
    all_reduce_counts, all_reduce_sums   per-layer counts and logged sums (kept on device), one
                                       collective each
    replica_mismatches, bits_hash      do the ranks that should hold identical parameters and
                                       buffers (replicas, tp copies, expert biases) still do
    seq_load_balancing_loss_split, global_load_balancing_loss, z_loss_split   aux losses over split tokens
    seq_load_balancing_losses_split    the sequence-level loss of every MoE layer, one collective
    DistributedMuon                    layer-wise Muon: each matrix orthogonalised on one rank
    cp_token_index, cp_kv_index, split_batch, gather_kv, ContextParallel   context parallel: the
                                       load-balanced split of a packed micro-batch, the K/V
                                       all-gather, the model's attention over the split
    ContextCapacityDrop                the capacity drop of a MoE block over every cp rank's tokens
    gated_delta_rule_cp, conv_halo     Gated DeltaNet's rule and convolution across the split
    gated_linear_attention_cp          the rule without the delta (lightning attention) across it
    selective_scan_cp                  Mamba-1's selective scan across it
    Pipeline, MicroBatch, StageModule, stage_layers, rank_stages, pipeline_chunk, attach_loss,
    SCHEDULES                          pipeline parallel on torch.distributed.pipelining: the
                                       split by layers, the stages, the schedules, the tied
                                       embedding, balancing losses of middle stages

The gradient norm over parameters on several meshes is fmoe.optim.grad_norm / clip_grad_norm
(the same functions serve one process and torchrun).
"""

from fmoe.parallel.context import (
    ContextCapacityDrop,
    ContextParallel,
    conv_halo,
    cp_kv_index,
    cp_token_index,
    gated_delta_rule_cp,
    gated_linear_attention_cp,
    gather_kv,
    selective_scan_cp,
    split_batch,
)
from fmoe.parallel.expert import (
    DispatchMeta,
    ExpertParallel,
    PaddedDispatchMeta,
    combine,
    combine_padded,
    dispatch,
    dispatch_padded,
    gather_tokens,
    permute_padded,
    split_tokens,
)
from fmoe.parallel.fsdp import apply_fsdp, dense_data_mesh, gathered, materialize, parallelize, shard_experts
from fmoe.parallel.health import bits_hash, replica_mismatches
from fmoe.parallel.mesh import Meshes, build_meshes, leave_ranks, plan_sizes
from fmoe.parallel.muon import DistributedMuon
from fmoe.parallel.pipeline import (
    SCHEDULES,
    MicroBatch,
    Pipeline,
    StageModule,
    attach_loss,
    check_micro_batches,
    check_schedule,
    pipeline_chunk,
    rank_stages,
    stage_layers,
)
from fmoe.parallel.reduce import (
    all_reduce_counts,
    all_reduce_sums,
    global_load_balancing_loss,
    seq_load_balancing_loss_split,
    seq_load_balancing_losses_split,
    z_loss_split,
)
from fmoe.parallel.tensor import (
    AttentionParallel,
    HeadShard,
    LinearAttentionParallel,
    SequenceParallelModule,
    SequenceShard,
    ShardTokens,
    SwiGLUParallel,
    copy_to_tp,
    gather_from_sp,
    reduce_scatter_to_sp,
    tensor_parallel_plan,
)

__all__ = [
    "SCHEDULES",
    "MicroBatch",
    "Pipeline",
    "StageModule",
    "attach_loss",
    "check_micro_batches",
    "check_schedule",
    "pipeline_chunk",
    "rank_stages",
    "stage_layers",
    "ContextCapacityDrop",
    "ContextParallel",
    "DispatchMeta",
    "DistributedMuon",
    "ExpertParallel",
    "PaddedDispatchMeta",
    "combine_padded",
    "dispatch_padded",
    "permute_padded",
    "Meshes",
    "combine",
    "conv_halo",
    "cp_kv_index",
    "cp_token_index",
    "gated_delta_rule_cp",
    "gated_linear_attention_cp",
    "selective_scan_cp",
    "gather_kv",
    "split_batch",
    "dispatch",
    "gather_tokens",
    "split_tokens",
    "all_reduce_counts",
    "all_reduce_sums",
    "global_load_balancing_loss",
    "seq_load_balancing_loss_split",
    "seq_load_balancing_losses_split",
    "z_loss_split",
    "apply_fsdp",
    "gathered",
    "leave_ranks",
    "bits_hash",
    "build_meshes",
    "copy_to_tp",
    "dense_data_mesh",
    "materialize",
    "parallelize",
    "plan_sizes",
    "reduce_scatter_to_sp",
    "replica_mismatches",
    "gather_from_sp",
    "SequenceShard",
    "HeadShard",
    "AttentionParallel",
    "LinearAttentionParallel",
    "SequenceParallelModule",
    "SwiGLUParallel",
    "ShardTokens",
    "shard_experts",
    "tensor_parallel_plan",
]
