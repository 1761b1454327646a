"""Small nn.Modules that only own parameters and call fmoe.layers.

    MoE(hidden, ffn, cfg)(x[..., H]) -> (y[..., H], stats)

Legend: H hidden, F expert FFN size, Fs shared FFN size, E experts.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from fmoe.layers import MoEConfig, moe


class MoE(nn.Module):
    """Parameters of a mixture-of-experts block; forward calls fmoe.layers.moe.

    Owns: router [E, H] (float32), stacked experts w_gate / w_up [E, H, F] and w_down
    [E, F, H], optional shared experts [H, Fs] / [Fs, H] with an optional sigmoid gate [H],
    and, with expert_bias=True (sigmoid scoring), the aux-loss-free `expert_bias` [E], a
    persistent float32 buffer. The router and the bias stay float32 when the module is cast
    (`.to(torch.bfloat16)`, `.half()`): routing decisions and bias steps of 1e-3 need it.

    Args:
        hidden: H. ffn: F per routed expert. cfg: MoEConfig (n_experts, k, routing).
        shared_ffn: Fs of the shared experts (0: none; DeepSeek's n_shared experts of size F
            are one SwiGLU of Fs = n_shared * F). shared_gate: sigmoid gate on their output.
        expert_bias: own an expert_bias buffer (needs cfg.score == "sigmoid").
    """

    _FLOAT32 = ("router", "expert_bias")

    def __init__(
        self, hidden: int, ffn: int, cfg: MoEConfig, *, shared_ffn: int = 0, shared_gate: bool = False,
        expert_bias: bool = False, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        if expert_bias and cfg.score != "sigmoid":
            raise ValueError("expert_bias: needs cfg.score == 'sigmoid' (it shifts selection scores)")
        if shared_gate and not shared_ffn:
            raise ValueError("shared_gate: needs shared experts (shared_ffn > 0)")
        E, H, kw = cfg.n_experts, hidden, dict(device=device, dtype=dtype)
        self.cfg = cfg
        self.router = nn.Parameter(torch.empty(E, H, device=device, dtype=torch.float32))
        self.w_gate = nn.Parameter(torch.empty(E, H, ffn, **kw))
        self.w_up = nn.Parameter(torch.empty(E, H, ffn, **kw))
        self.w_down = nn.Parameter(torch.empty(E, ffn, H, **kw))
        if shared_ffn:
            self.shared_w_gate = nn.Parameter(torch.empty(H, shared_ffn, **kw))
            self.shared_w_up = nn.Parameter(torch.empty(H, shared_ffn, **kw))
            self.shared_w_down = nn.Parameter(torch.empty(shared_ffn, H, **kw))
            if shared_gate:
                self.shared_gate = nn.Parameter(torch.empty(H, **kw))
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(E, device=device, dtype=torch.float32), persistent=True)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Every weight Normal(0, std), the expert bias 0. A model stacking blocks may scale
        the output projections by depth (the reference model does)."""
        for p in self.parameters():
            nn.init.normal_(p, std=std)
        if "expert_bias" in self._buffers:
            self.expert_bias.zero_()

    def _apply(self, fn, recurse=True):
        # nn.Module casts every floating tensor; keep the float32 ones float32 (on the new
        # device), restoring them from their float32 values, not from a rounded copy
        kept = {n: getattr(self, n).data for n in self._FLOAT32 if getattr(self, n, None) is not None}
        super()._apply(fn, recurse)
        for name, data in kept.items():
            t = getattr(self, name)
            if t.dtype != torch.float32:
                t.data = data.to(device=t.device)
        return self

    def params(self) -> dict:
        """The tensors fmoe.layers.moe takes (see its module docstring)."""
        names = ("router", "w_gate", "w_up", "w_down", "expert_bias", "shared_w_gate", "shared_w_up", "shared_w_down", "shared_gate")
        return {n: getattr(self, n) for n in names if getattr(self, n, None) is not None}

    def forward(self, x: torch.Tensor):
        """x [..., H] -> (y [..., H], stats TensorDict of fmoe.layers.moe)."""
        y, stats = moe(x.reshape(-1, x.shape[-1]), self.params(), self.cfg)
        return y.reshape(x.shape), stats
