"""Layers shared by every architecture: a model file composes these (see engine/models/registry.py)."""

from engine.layers.attention import Attention, paged_attention
from engine.layers.linear import PackedLinear
from engine.layers.metadata import AttentionMetadata
from engine.layers.mlp import MLP
from engine.layers.norm import RMSNorm
from engine.layers.rotary import rope_cos_sin_cache

__all__ = ["MLP", "Attention", "AttentionMetadata", "PackedLinear", "RMSNorm", "paged_attention", "rope_cos_sin_cache"]
