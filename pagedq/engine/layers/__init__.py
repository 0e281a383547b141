"""Layers shared by every architecture: a model file composes these (see pagedq/engine/models/registry.py)."""

from pagedq.engine.layers.attention import Attention, paged_attention
from pagedq.engine.layers.linear import PackedLinear
from pagedq.engine.layers.metadata import AttentionMetadata
from pagedq.engine.layers.mlp import MLP
from pagedq.engine.layers.norm import RMSNorm
from pagedq.engine.layers.rotary import rope_cos_sin_cache

__all__ = ["MLP", "Attention", "AttentionMetadata", "PackedLinear", "RMSNorm", "paged_attention", "rope_cos_sin_cache"]
