"""Linear layers: the CPU's few-row product, and one holding several of the checkpoint's projections in one matrix
(one matmul instead of several)."""

from __future__ import annotations

import torch
from torch import nn

# Rows up to which a CPU linear runs as weight @ x^T: torch's F.linear (x @ weight^T) of a few rows is slower than
# the same product in that layout on the CPU's BLAS, and decode steps and verify rows live in that range, prefill
# does not (docs/benchmarks.md#cpu-few-row-products).
CPU_FEW_ROWS = 128


class Linear(nn.Linear):
    """nn.Linear whose CPU product of a few rows is computed as (weight @ x^T)^T: the same matrix product (fp32
    rounding aside), in the layout the CPU's BLAS runs fastest for a skinny operand."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dim() != 2 or not 2 <= x.shape[0] <= CPU_FEW_ROWS:  # one row: as fast
            return super().forward(x)
        out = torch.mm(self.weight, x.t()).t().contiguous()  # row-major, as F.linear's (in-place users need it)
        return out if self.bias is None else out + self.bias


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
