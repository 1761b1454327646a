"""fmoe.ops: stateless, differentiable tensor -> tensor ops (SPEC.md).

Each op runs fused Triton kernels on CUDA tensors and a plain-torch reference otherwise;
`impl="auto" | "triton" | "torch"` overrides the choice. See fmoe/ops/README.md.
"""

from fmoe.ops.balance import (
    aux_scores,
    load_balancing_loss,
    load_stats,
    seq_load_balancing_loss,
    tokens_per_expert,
    update_expert_bias,
    z_loss,
)
from fmoe.ops.delta import gated_delta_rule, gated_linear_attention
from fmoe.ops.dispatch import PermutePlan, permute, unpermute
from fmoe.ops.experts import grouped_matmul, grouped_mlp, swiglu
from fmoe.ops.fp8 import fp8_matmul, fp8_quantize
from fmoe.ops.loss import cross_entropy, linear_cross_entropy
from fmoe.ops.packed import mtp_targets, positions_from_cu_seqlens, roll_packed
from fmoe.ops.rope import (
    apply_rope,
    llama3_inv_freq,
    longrope_inv_freq,
    longrope_scale,
    rope_cos_sin,
    rope_inv_freq,
    yarn_correction_range,
    yarn_cos_sin_scale,
    yarn_inv_freq,
    yarn_mscale,
    yarn_softmax_scale,
)
from fmoe.ops.routing import Routes, drop_by_capacity, hash_route, random_logits, route, sparsemixer_route, split_zero_experts
from fmoe.ops.scan import selective_scan
from fmoe.ops.sparse import indexer_scores, sparse_attention, sparse_attention_probs

__all__ = [
    "PermutePlan",
    "Routes",
    "apply_rope",
    "aux_scores",
    "cross_entropy",
    "drop_by_capacity",
    "fp8_matmul",
    "fp8_quantize",
    "gated_delta_rule",
    "gated_linear_attention",
    "grouped_matmul",
    "grouped_mlp",
    "indexer_scores",
    "linear_cross_entropy",
    "llama3_inv_freq",
    "longrope_inv_freq",
    "longrope_scale",
    "load_balancing_loss",
    "load_stats",
    "mtp_targets",
    "permute",
    "positions_from_cu_seqlens",
    "random_logits",
    "roll_packed",
    "rope_cos_sin",
    "rope_inv_freq",
    "route",
    "hash_route",
    "sparsemixer_route",
    "selective_scan",
    "seq_load_balancing_loss",
    "split_zero_experts",
    "sparse_attention",
    "sparse_attention_probs",
    "swiglu",
    "tokens_per_expert",
    "unpermute",
    "update_expert_bias",
    "yarn_correction_range",
    "yarn_cos_sin_scale",
    "yarn_inv_freq",
    "yarn_mscale",
    "yarn_softmax_scale",
    "z_loss",
]
