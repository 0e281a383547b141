"""The gated MLP: down(silu(gate(x)) * up(x)), gate and up packed into one matmul."""

from __future__ import annotations

import torch
from torch import nn

from pagedq.engine.config.engine import ModelConfig
from pagedq.engine.layers.linear import Linear, PackedLinear
from pagedq.kernels import KernelSet


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelSet) -> None:
        super().__init__()
        self.ops = ops
        size = config.intermediate_size
        self.gate_up_proj = PackedLinear(config.hidden_size, [size, size], bias=False)
        self.down_proj = Linear(size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
