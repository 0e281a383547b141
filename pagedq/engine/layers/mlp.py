"""The gated MLP: down(act(gate(x)) * up(x)), gate and up packed into one matmul; act is silu (SwiGLU) or
gelu_pytorch_tanh (GeGLU, Gemma)."""

from __future__ import annotations

import torch
from torch import nn

from pagedq.engine.config.engine import ModelConfig
from pagedq.engine.layers.linear import Linear, PackedLinear
from pagedq.kernels import KernelSet

# ModelConfig.hidden_act -> the KernelSet kernel computing act(gate) * up
GATED_ACTIVATION_KERNELS = {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul"}


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelSet, intermediate_size: int | None = None) -> None:
        """intermediate_size: the config's unless given (a MoE model's shared expert has its own)."""
        super().__init__()
        self.ops = ops
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = PackedLinear(config.hidden_size, [size, size], bias=False)
        self.down_proj = Linear(size, config.hidden_size, bias=False)
        self.act_and_mul = getattr(ops, GATED_ACTIVATION_KERNELS[config.hidden_act])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
