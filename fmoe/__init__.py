"""fmoe: Mixture-of-Experts training for PyTorch, as small composable pieces.

    fmoe.ops       stateless differentiable ops (Triton on CUDA, torch reference everywhere)
    fmoe.parallel  DeviceMesh / DTensor / FSDP2 wrappers
    fmoe.optim     optimizers and schedules
    fmoe.train     data, checkpoints, metrics
"""

__version__ = "0.1.0"
