"""Plain-PyTorch reference implementations of every kernel the engine calls.

These define the contract (shapes, dtypes, semantics) that the Triton kernels must match, and they are
what runs on CPU. Layout of the paged cache, fixed for the whole project:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = physical_block * block_size + offset_in_block

All attention math accumulates in fp32 and returns the query's dtype.
"""

from __future__ import annotations

import torch

from pagedq.kernels.lora import lora_add as lora_add
from pagedq.kernels.lora import lora_expand as lora_expand  # the LoRA references live beside their index
from pagedq.kernels.lora import lora_shrink as lora_shrink


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, Hkv, D] into the caches at slot_mapping [T]; slot -1 means skip."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    flat_k = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_k[slots] = key[keep].to(k_cache.dtype)
    flat_v[slots] = value[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """Contiguous [context_len, Hkv, D] view of one sequence's cached keys or values."""
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:context_len]


def attention_probs(
    scores: torch.Tensor, visible: torch.Tensor, softcap: float, sinks: torch.Tensor | None
) -> torch.Tensor:
    """softmax over the last dim of fp32 scores (already scaled), with the attention features every backend shares:
    softcap (Gemma 2: softcap * tanh(scores / softcap), before the mask), the mask (visible: True = attend), and
    sinks (gpt-oss: one logit per query head, broadcast to scores[..., :1], that joins the denominator only)."""
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def window_start(query_position: torch.Tensor, window: int) -> torch.Tensor:
    """The first key position a query at `query_position` sees: it sees [start, query_position]. window 0 is full
    attention (start 0); else the window's `window` positions up to and including its own, as transformers'
    sliding masks have it (key k visible iff k > q - window: masking_utils.sliding_window_overlay)."""
    if not window:
        return torch.zeros_like(query_position)
    return (query_position - window + 1).clamp_min(0)


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [Q, Hq, D], key/value [K, Hkv, D], mask [Q, K] (True = attend) -> [Q, Hq, D] fp32."""
    num_q_heads, num_kv_heads = query.shape[1], key.shape[1]
    group = num_q_heads // num_kv_heads
    q = query.float().view(query.shape[0], num_kv_heads, group, query.shape[2])
    scores = torch.einsum("qhgd,khd->hgqk", q, key.float()) * scale
    head_sinks = None if sinks is None else sinks.view(num_kv_heads, group, 1, 1)
    probs = attention_probs(scores, mask, softcap, head_sinks)
    out = torch.einsum("hgqk,khd->qhgd", probs, value.float())
    return out.reshape(query.shape[0], num_q_heads, query.shape[2])


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence at position context_len-1, attending to its context_len cached tokens (the last
    `window` of them when window > 0: window_start).

    query [S, Hq, D]; block_tables [S, M] int32; context_lens [S] int32 -> [S, Hq, D].
    softcap > 0: scores = softcap * tanh(scale * q.k / softcap); sinks [Hq] fp32: per query head, a logit that
    joins the softmax's denominator only (gpt-oss).
    Vectorised over sequences (gather padded to M blocks, mask the tail): this is also the CPU hot path.
    """
    num_seqs, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    max_len = block_tables.shape[1] * block_size
    tables = block_tables.long()
    keys = k_cache[tables].view(num_seqs, max_len, num_kv_heads, head_dim).float()
    values = v_cache[tables].view(num_seqs, max_len, num_kv_heads, head_dim).float()
    group = num_q_heads // num_kv_heads
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("shgd,skhd->shgk", q, keys) * scale
    positions = torch.arange(max_len, device=query.device)
    lens = context_lens[:, None].long()
    valid = (positions[None, :] < lens) & (positions[None, :] >= window_start(lens - 1, window))
    head_sinks = None if sinks is None else sinks.view(1, num_kv_heads, group, 1)
    probs = attention_probs(scores, valid[:, None, None, :], softcap, head_sinks)
    out = torch.einsum("shgk,skhd->shgd", probs, values)
    return out.reshape(num_seqs, num_q_heads, head_dim).to(query.dtype)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for a packed batch of query chunks whose K/V are already in the cache.

    query [T, Hq, D]; cu_seqlens_q [S+1] int32; context_lens [S] int32 (cached prefix + this chunk).
    Query i of sequence s sits at position context_len - q_len + i and sees positions <= its own (and, with
    window > 0, >= its window_start). softcap and sinks as in paged_decode_attention.
    """
    out = torch.empty_like(query)
    starts = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for seq, context_len in enumerate(lens):
        q_start, q_end = starts[seq], starts[seq + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        keys = gather_kv(k_cache, block_tables[seq], context_len)
        values = gather_kv(v_cache, block_tables[seq], context_len)
        q_pos = torch.arange(context_len - q_len, context_len, device=query.device)
        k_pos = torch.arange(context_len, device=query.device)
        mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= window_start(q_pos, window)[:, None])
        attended = _attend(query[q_start:q_end], keys, values, mask, scale, softcap, sinks)
        out[q_start:q_end] = attended.to(query.dtype)
    return out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm, with transformers' numerics (variance in fp32, cast, then weight).

    Returns (normed, new_residual) where new_residual = x + residual (or x when residual is None).
    x, residual [T, H]; weight [H]. unit_offset: Gemma's norm, see `_unit_offset_norm`.
    """
    if residual is not None:
        x = x + residual
    if unit_offset:
        return _unit_offset_norm(x, weight, eps), x
    variance = x.float().pow(2).mean(-1, keepdim=True)
    normed = (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)
    return weight * normed, x


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of [T, H, D] (Qwen3's per-head q/k norm; Gemma 3's with unit_offset)."""
    if unit_offset:
        return _unit_offset_norm(x, weight, eps)
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def _unit_offset_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm (transformers' Gemma2RMSNorm/Gemma3RMSNorm): the checkpoint stores weight - 1, and the
    normalised row is scaled by (1 + weight) in fp32 and rounded to x's dtype once."""
    row = x.float()
    normed = row * torch.rsqrt(row.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def rotary_embedding(
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox ("rotate half") RoPE. query [T, Hq, D], key [T, Hkv, D], positions [T] int64,
    cos_sin_cache [max_pos, D] fp32 = cat(cos[:, :D/2], sin[:, :D/2]). Returns new (query, key)."""
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache[positions]
    cos = cos_sin[:, :half].repeat(1, 2)[:, None, :]
    sin = cos_sin[:, half:].repeat(1, 2)[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * c + rotated * s

    return rotate(query), rotate(key)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] packed (gate | up) -> silu(gate) * up, [T, I]."""
    half = gate_up.shape[-1] // 2
    return torch.nn.functional.silu(gate_up[..., :half]) * gate_up[..., half:]


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] packed (gate | up) -> gelu(gate, approximate="tanh") * up, [T, I] (GeGLU: transformers'
    gelu_pytorch_tanh)."""
    half = gate_up.shape[-1] // 2
    return torch.nn.functional.gelu(gate_up[..., :half], approximate="tanh") * gate_up[..., half:]


def copy_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """Copy whole blocks within each layer's caches: block_mapping [N, 2] int64 rows (src, dst).

    Used for copy-on-write of shared blocks; one call covers every layer and every pair.
    """
    if block_mapping.numel() == 0:
        return
    src, dst = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    for cache in (*key_caches, *value_caches):
        cache[dst] = cache[src]


_MASK32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser on int64 tensors holding 32-bit values (products wrap; the mask keeps 32 bits)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] fp32 Gumbel(0, 1) noise, a pure function of (seed, position, token id): counter-based, so a row's
    draws do not depend on the rest of the batch. seeds, positions [B] int64."""
    token_ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    row_key = _fmix32(_fmix32((seeds >> 32) & _MASK32) ^ (seeds & _MASK32))
    row_key = _fmix32(row_key ^ _fmix32(positions & _MASK32))
    bits = _fmix32(_fmix32(row_key[:, None] ^ ((token_ids * 0x9E3779B9) & _MASK32)[None, :]))
    # 23 bits + 0.5 needs 24 significant bits: exact in fp32 and strictly inside (0, 1). (With 24 bits the
    # largest value would round up to 1.0 and give +inf noise.)
    uniform = ((bits >> 9).float() + 0.5) / float(1 << 23)
    return -torch.log(-torch.log(uniform))


def gumbel_argmax(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Sample one token per row: argmax(logits / T + Gumbel noise), an exact draw from softmax(logits / T)
    over the tokens not set to -inf. Rows with T == 0 take the plain argmax. logits [B, V] fp32 -> [B] int64."""
    greedy = logits.argmax(dim=-1)
    scaled = logits / temperature.clamp_min(1e-6)[:, None]
    noisy = scaled + gumbel_noise(seeds, positions, logits.shape[-1])
    sampled = noisy.masked_fill(logits == float("-inf"), float("-inf")).argmax(dim=-1)  # filtered stay out
    return torch.where(temperature == 0, greedy, sampled)


# gpt-oss's clamped SwiGLU (transformers' GptOssExperts: config.swiglu_alpha, config.swiglu_limit).
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0
MOE_ACTIVATIONS = ("silu", "swiglu_oai")


def check_moe_activation(activation: str) -> None:
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"fused_moe: activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")


def moe_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """[N, 2I] (gate | up) halves -> [N, I], in the input dtype, as transformers' experts compute it.

    "silu": silu(gate) * up (Qwen3-MoE, Mixtral). "swiglu_oai" (gpt-oss): gate clamped above at the limit, up
    clamped to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate).
    """
    check_moe_activation(activation)
    half = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :half], gate_up[..., half:]
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
    up = up.clamp(min=-SWIGLU_OAI_LIMIT, max=SWIGLU_OAI_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA))


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """The routed experts' output, [T, H] in hidden's dtype: out[t] = sum_k topk_weights[t, k] * expert(hidden[t])
    with expert e = topk_ids[t, k], expert_e(x) = act(x @ w13[e].T + w13_bias[e]) @ w2[e].T + w2_bias[e].

    hidden [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_weights [T, K] fp32; topk_ids
    [T, K] int32/int64 in [0, E); biases [E, 2I] and [E, H] or None; activation as in `moe_activation`. Each
    expert's projections run in hidden's dtype (as transformers'); the weighted sum over k accumulates in fp32.
    Routing (router logits, softmax, top-k) is the caller's. The oracle: a loop over every expert, masking.
    """
    check_moe_activation(activation)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in range(w13.shape[0]):
        tokens, slots = torch.where(topk_ids == expert)
        if tokens.numel() == 0:
            continue
        bias13 = None if w13_bias is None else w13_bias[expert]
        bias2 = None if w2_bias is None else w2_bias[expert]
        gate_up = torch.nn.functional.linear(hidden[tokens], w13[expert], bias13)
        expert_out = torch.nn.functional.linear(moe_activation(gate_up, activation), w2[expert], bias2)
        out.index_add_(0, tokens, expert_out.float() * topk_weights[tokens, slots, None].float())
    return out.to(hidden.dtype)
