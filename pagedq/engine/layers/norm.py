"""RMSNorm (variance in fp32, as transformers), optionally fused with the residual add."""

from __future__ import annotations

import torch
from torch import nn

from pagedq.kernels import KernelSet


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: KernelSet) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rms_norm(x, self.weight, self.eps, residual)
