"""Paged self-attention: packed q/k/v, optional per-head q/k RMSNorm, RoPE, the cache write, and the
dispatch of the step's decode tokens and prefill chunks to their kernels."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pagedq.engine.config.engine import ModelConfig
from pagedq.engine.layers.linear import Linear, PackedLinear
from pagedq.engine.layers.metadata import AttentionMetadata
from pagedq.engine.layers.norm import GemmaRMSNorm, RMSNorm
from pagedq.kernels import KernelSet, cpu_attention


def paged_attention(
    ops: KernelSet,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output [T, heads, head_dim]: decode tokens (first) by the decode kernel, prefill chunks by the
    varlen prefill kernel, each over the paged cache through its block table. window (0: full attention), softcap
    (0: none) and sinks ([heads] fp32 or None) as pagedq/kernels/reference.py defines them."""
    features = AttentionFeatures(window, softcap, sinks)
    decode = _decode_kernel(ops, k_cache, meta, features)
    prefill = _prefill_kernel(ops, k_cache, meta, q.shape[1], features)
    num_decode = meta.num_decode_tokens
    if not meta.has_prefill:
        return decode(q, k_cache, v_cache, scale)
    out = torch.empty_like(q)
    if num_decode:
        out[:num_decode] = decode(q[:num_decode], k_cache, v_cache, scale)
    out[num_decode:] = prefill(q[num_decode:], k_cache, v_cache, scale)
    return out


AttentionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


@dataclass(frozen=True)
class AttentionFeatures:
    """One layer's attention variant: its sliding window, logit soft-cap and sinks (the kernels' keyword args)."""

    window: int = 0
    softcap: float = 0.0
    sinks: torch.Tensor | None = None


def _decode_kernel(
    ops: KernelSet, k_cache: torch.Tensor, meta: AttentionMetadata, features: AttentionFeatures
) -> AttentionKernel:
    """(q, k_cache, v_cache, scale) -> decode attention. On the CPU backend, over the step's plan (for the native
    kernel the tables and lengths as int32, else the gather's blocks, length groups and masks), built by the first
    layer and reused by the others (pagedq/kernels/cpu_attention.py)."""
    tables, lens = meta.decode_block_tables, meta.decode_context_lens
    window, softcap, sinks = features.window, features.softcap, features.sinks
    if ops.backend != "cpu":
        return lambda q, k, v, scale: ops.paged_decode_attention(
            q, k, v, tables, lens, scale, window=window, softcap=softcap, sinks=sinks
        )
    plan = meta.derive(
        _plan_key("cpu_decode_plan", window),
        lambda: cpu_attention.plan_decode(
            tables, lens, k_cache.shape[1], cpu_attention.use_native(k_cache), window=window
        ),
    )
    return lambda q, k, v, scale: cpu_attention.planned_decode(
        q, k, v, plan, scale, window=window, softcap=softcap, sinks=sinks
    )


def _prefill_kernel(
    ops: KernelSet, k_cache: torch.Tensor, meta: AttentionMetadata, num_q_heads: int, features: AttentionFeatures
) -> AttentionKernel:
    """(q, k_cache, v_cache, scale) -> prefill attention; on the CPU backend over the step's plan, whose batched short
    chunks (verify rows) go to the native kernel where it runs, else fold num_q_heads // num_kv_heads query heads
    per KV head into their masks."""
    tables, cu_seqlens, lens = meta.prefill_block_tables, meta.prefill_cu_seqlens_q, meta.prefill_context_lens
    window, softcap, sinks = features.window, features.softcap, features.sinks
    if ops.backend != "cpu":
        return lambda q, k, v, scale: ops.paged_prefill_attention(
            q, k, v, tables, cu_seqlens, lens, scale, window=window, softcap=softcap, sinks=sinks
        )

    def build() -> cpu_attention.PrefillPlan:  # by the step's first layer of this window; the others reuse it
        block_size, heads, native = k_cache.shape[1], num_q_heads // k_cache.shape[2], cpu_attention.use_native(k_cache)
        return cpu_attention.plan_prefill(tables, cu_seqlens, lens, block_size, heads, native, window=window)

    plan = meta.derive(_plan_key("cpu_prefill_plan", window), build)
    return lambda q, k, v, scale: cpu_attention.planned_prefill(
        q, k, v, plan, scale, window=window, softcap=softcap, sinks=sinks
    )


def _plan_key(name: str, window: int) -> str:
    """The metadata key of a CPU plan: one per window, since a plan's masks and blocks depend on it."""
    return f"{name}/window={window}" if window else name


class Attention(nn.Module):
    """Self-attention of layer `layer_idx`: its window (ModelConfig.layer_window) and the model's soft-cap and
    sinks."""

    def __init__(self, config: ModelConfig, ops: KernelSet, layer_idx: int) -> None:
        super().__init__()
        self.ops = ops
        self.layer_idx = layer_idx
        self.window = config.layer_window(layer_idx)
        self.softcap = config.attn_logit_softcapping or 0.0
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.qkv_proj = PackedLinear(config.hidden_size, [self.q_size, self.kv_size, self.kv_size], config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = _head_norm(config, ops)
            self.k_norm = _head_norm(config, ops)
        # gpt-oss: a learned logit per query head in the softmax's denominator (checkpoint: ...self_attn.sinks)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.attention_sinks else None

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        ops = self.ops
        if self.qk_norm:
            q, k = self.q_norm.per_head(q), self.k_norm.per_head(k)
        q, k = ops.rotary_embedding(q, k, positions, cos_sin_cache)
        k_cache, v_cache = kv_cache
        ops.store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        sinks = None if self.sinks is None else self.sinks.float()
        out = paged_attention(
            ops, q, k_cache, v_cache, meta, self.scale, window=self.window, softcap=self.softcap, sinks=sinks
        )
        return self.o_proj(out.reshape(num_tokens, self.q_size))


def _head_norm(config: ModelConfig, ops: KernelSet) -> RMSNorm:
    """A per-head q/k norm: Qwen3's, or Gemma 3's (1 + weight) one."""
    if config.rms_norm_unit_offset:
        return GemmaRMSNorm(config.head_dim, config.rms_norm_eps, ops)
    return RMSNorm(config.head_dim, config.rms_norm_eps, ops)
