"""A linear layer holding several of the checkpoint's projections in one matrix (one matmul instead of several)."""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Linear):
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
