"""fmoe.optim: what the train loop steps with (SPEC.md section 7).

    lr_at, lr_scheduler               learning-rate schedules (warmup, cosine, WSD, ...)
    batch_size_at, parse_batch_schedule   the "0:32 50M:64" batch-size schedule
    AdamW                             AdamW with float32 or bfloat16 moments (fused Triton on CUDA)
    Muon, newton_schulz               Muon for matrices (each expert its own matrix)
    split_param_groups, build_optimizers  Muon for matrices, AdamW for the rest
    grad_norm, clip_grad_norm         the gradient norm (one process, or one collective over
                                      gradients on several meshes) and its clipping
    clip_factor                       the clipping's factor, for AdamW.step(grad_factor=...)
    param_norm, zero_grad_count       the parameters' norm and the count of zero gradients,
                                      exact over meshes in the same way
    Float32GradAccumulator            float32 sums of chosen bf16 gradients
fmoe.parallel.muon.DistributedMuon is the layer-wise distributed Muon.
"""

from fmoe.optim.adamw import AdamW
from fmoe.optim.grads import Float32GradAccumulator, clip_factor, clip_grad_norm, grad_norm, param_norm, zero_grad_count
from fmoe.optim.muon import Muon, build_optimizers, newton_schulz, split_param_groups
from fmoe.optim.schedules import batch_size_at, lr_at, lr_scheduler, parse_batch_schedule

__all__ = [
    "AdamW",
    "Float32GradAccumulator",
    "Muon",
    "batch_size_at",
    "build_optimizers",
    "clip_factor",
    "clip_grad_norm",
    "grad_norm",
    "lr_at",
    "lr_scheduler",
    "newton_schulz",
    "param_norm",
    "parse_batch_schedule",
    "split_param_groups",
    "zero_grad_count",
]
