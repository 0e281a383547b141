"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flattened token batch and a paged KV cache.

No padding anywhere: the batch is [T] tokens from many requests; attention finds each token's request
through `AttentionMetadata`. Q/K/V and gate/up are packed into one matmul each. The numerics follow
transformers (RMSNorm variance in fp32, neox RoPE from transformers' own inv_freq functions) so greedy
outputs match it token for token in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.config import ModelConfig
from kernels import KernelSet


@dataclass
class AttentionMetadata:
    """How the flattened batch maps onto requests and cache slots. Decode tokens (one per request) come first."""

    slot_mapping: torch.Tensor  # [T] int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [D, M] int32
    decode_context_lens: torch.Tensor  # [D] int32
    prefill_block_tables: torch.Tensor  # [P, M] int32
    prefill_cu_seqlens_q: torch.Tensor  # [P+1] int32, offsets into the prefill part of the batch
    prefill_context_lens: torch.Tensor  # [P] int32

    @property
    def has_prefill(self) -> bool:
        return self.prefill_context_lens.numel() > 0


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


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: KernelSet) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelSet) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = PackedLinear(config.hidden_size, [self.q_size, self.kv_size, self.kv_size], config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)

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
            q = ops.head_rms_norm(q, self.q_norm.weight, self.q_norm.eps)
            k = ops.head_rms_norm(k, self.k_norm.weight, self.k_norm.eps)
        q, k = ops.rotary_embedding(q, k, positions, cos_sin_cache)
        k_cache, v_cache = kv_cache
        ops.store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = self._attend(q, k_cache, v_cache, meta)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_decode = meta.num_decode_tokens
        if not meta.has_prefill:
            return self.ops.paged_decode_attention(
                q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale)
        out = torch.empty_like(q)
        if num_decode:
            out[:num_decode] = self.ops.paged_decode_attention(
                q[:num_decode], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale)
        out[num_decode:] = self.ops.paged_prefill_attention(
            q[num_decode:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_cu_seqlens_q,
            meta.prefill_context_lens, self.scale)
        return out


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelSet) -> None:
        super().__init__()
        self.ops = ops
        size = config.intermediate_size
        self.gate_up_proj = PackedLinear(config.hidden_size, [size, size], bias=False)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelSet) -> None:
        super().__init__()
        self.self_attn = Attention(config, ops)
        self.mlp = MLP(config, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, hidden, residual, positions, cos_sin_cache, kv_cache, meta):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, cos_sin_cache, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelSet) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, ops) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class LlamaForCausalLM(nn.Module):
    """Checkpoint-compatible module tree (model.layers.N.self_attn..., lm_head) with packed projections.

    `ops` are the kernels every layer calls, bound once for the model's device (`kernels.bind`).
    """

    def __init__(self, config: ModelConfig, ops: KernelSet) -> None:
        super().__init__()
        self.config = config
        self.kernels = ops
        self.model = LlamaModel(config, ops)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(config), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        hidden = self.model.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(hidden, residual, positions, self.cos_sin_cache, kv_cache, meta)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def rope_cos_sin_cache(config: ModelConfig) -> torch.Tensor:
    """[max_positions, head_dim] fp32 = cat(cos, sin) of position * inv_freq, inv_freq from transformers."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = config.hf_config
    rope_type = (getattr(hf, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type == "default":
        base = hf.rope_parameters["rope_theta"]
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float, device="cpu") / config.head_dim
        inv_freq = 1.0 / (base**exponents)
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float, device="cpu")
    freqs = positions[:, None] * inv_freq.float().cpu()[None, :]
    table = torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)
    return table.to(torch.get_default_device())
