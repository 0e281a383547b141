"""RMSNorm (variance in fp32, as transformers), optionally fused with the residual add; and Gemma's (1 + weight)
variant."""

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

    def per_head(self, x: torch.Tensor) -> torch.Tensor:
        """The norm over the last dim of [T, heads, head_dim] (a per-head q/k norm)."""
        return self.ops.head_rms_norm(x, self.weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores weight - 1, and the normalised row is scaled by (1 + weight) in fp32
    and rounded to the input dtype once, as transformers' Gemma2RMSNorm/Gemma3RMSNorm do (the kernels'
    unit_offset). Adding 1 in fp32 matters: in bf16, 1 + a small weight rounds to 1."""

    def __init__(self, size: int, eps: float, ops: KernelSet) -> None:
        super().__init__(size, eps, ops)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rms_norm(x, self.weight, self.eps, residual, unit_offset=True)

    def per_head(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.head_rms_norm(x, self.weight, self.eps, unit_offset=True)
