"""Linear layers: the CPU's few-row product, and one holding several of the checkpoint's projections in one matrix
(one matmul instead of several)."""

from __future__ import annotations

import torch
from torch import nn

from pagedq.kernels.cpu_linear import cpu_linear, uses_few_row_layout


class Linear(nn.Linear):
    """nn.Linear whose CPU product of a few rows is computed as (weight @ x^T)^T: the same matrix product (fp32
    rounding aside), in the layout the CPU's BLAS runs fastest for a skinny operand."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not uses_few_row_layout(x):
            return super().forward(x)
        return cpu_linear(x, self.weight, self.bias)


class PackedLinear(Linear):
    """One matmul for several projections of the checkpoint (q|k|v or gate|up), loaded shard by shard."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes) + 1)]

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        param = getattr(self, param_name)
        lo, hi = self.shard_offsets[shard], self.shard_offsets[shard + 1]
        if tensor.shape[0] != hi - lo:
            raise ValueError(f"shard {shard} of {param_name} has {tensor.shape[0]} rows, expected {hi - lo}")
        param.data[lo:hi].copy_(tensor)
