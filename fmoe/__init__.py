"""fmoe: Mixture-of-Experts training for PyTorch, as small composable pieces.

    fmoe.ops       stateless differentiable ops (Triton on CUDA, torch reference everywhere)
    fmoe.parallel  DeviceMesh / DTensor / FSDP2 wrappers
    fmoe.optim     optimizers and schedules
    fmoe.train     data, checkpoints, metrics
    fmoe.layers    functional attention, MoE and MLP layers over the ops
    fmoe.model     the reference transformer (Transformer, TransformerConfig)
    fmoe.hf        Hugging Face checkpoints in and out
"""

__version__ = "0.1.0"
