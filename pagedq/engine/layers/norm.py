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


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the checkpoint stores weight - 1, and the normalised row is scaled by (1 + weight) in fp32
    and rounded to the input dtype once, as transformers' Gemma2RMSNorm/Gemma3RMSNorm do. Adding 1 in fp32 matters:
    in bf16, 1 + a small weight rounds to 1."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the sum, rounded to x's dtype, is also the new residual."""
        if residual is not None:
            x = x + residual
        return self.per_head(x), x

    def per_head(self, x: torch.Tensor) -> torch.Tensor:
        """The norm over the last dim, whatever the leading dims ([T, hidden] or [T, heads, head_dim])."""
        row = x.float()
        normed = row * torch.rsqrt(row.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)
