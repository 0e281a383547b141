"""Where one decode step's time goes, and the compute limit it is measured against (`pagedq bench throughput`).

After the throughput run, the engine's own model times one decode step of the workload's batch over its own
paged cache (the contexts the batch's requests reach halfway through their outputs, blocks scattered over the
pool as a busy server leaves them), part by part: the attention kernel in every layer, the linear layers, the
LM head at the sampling rows, and the rest of the forward (norms, RoPE, the cache write, the embedding).

`roofline_ms_per_step` is the time of that step's matmuls alone, measured in the same run with torch.mm (and
torch.bmm for attention) on the same shapes: a distinct weight per layer, so weights stream from memory as in
the model; attention's QK^T and P V over contiguous K/V at the batch's mean context, the same FLOPs and K/V
bytes as the step's. Nothing the step does beyond its matmuls is counted, so step / roofline says how much of
the step is overhead: gathers, softmax, elementwise kernels, Python.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from pagedq.engine.layers import AttentionMetadata

REPEATS = 7


def _median_ms(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    """Median wall time of fn; on a GPU each run is synchronised before and after, so it is the device's time."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else lambda: None
    fn()  # warm: first-touch page faults and lazy initialisation are not the step's
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def decode_metadata(context_lens: list[int], block_size: int, num_blocks: int, seed: int = 0) -> AttentionMetadata:
    """Decode-only metadata: each sequence's blocks drawn from a shuffled pool, its new token at context_len-1."""
    generator = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in context_lens]
    if sum(per_seq) > num_blocks:
        raise ValueError(f"a decode step at these contexts needs {sum(per_seq)} KV blocks; the pool has {num_blocks}")
    pool = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    tables = torch.zeros(len(context_lens), max(per_seq), dtype=torch.int32)
    start = 0
    for seq, used in enumerate(per_seq):
        tables[seq, :used] = pool[start : start + used]
        start += used
    lens = torch.tensor(context_lens, dtype=torch.int32)
    last = (lens - 1).long()
    slots = tables[torch.arange(len(context_lens)), last // block_size].long() * block_size + last % block_size
    empty = torch.zeros(0, dtype=torch.int32)
    return AttentionMetadata(
        slots, len(context_lens), tables, lens, tables[:0], torch.zeros(1, dtype=torch.int32), empty
    )


def _linear_shapes(model) -> list[tuple[str, torch.Tensor]]:
    """(name, weight) of every linear layer of every decoder layer, in call order."""
    found = []
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        found += [("qkv", attention.qkv_proj.weight), ("o", attention.o_proj.weight)]
        found += [("gate_up", mlp.gate_up_proj.weight), ("down", mlp.down_proj.weight)]
    return found


def measure_step_parts(model, kv_caches, block_size: int, context_lens: list[int]) -> dict[str, float]:
    """Milliseconds of one decode step at these contexts (one sequence each), part by part, and its roofline."""
    config, ops = model.config, model.kernels
    num_seqs, dtype, device = len(context_lens), kv_caches[0][0].dtype, kv_caches[0][0].device
    meta = _on(decode_metadata(context_lens, block_size, kv_caches[0][0].shape[0]), device)
    with torch.device(device):
        return _measure(model, ops, config, kv_caches, meta, num_seqs, dtype, context_lens)


def _on(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    tensors = (
        *("slot_mapping", "decode_block_tables", "decode_context_lens"),
        *("prefill_block_tables", "prefill_cu_seqlens_q", "prefill_context_lens"),
    )
    moved = {name: getattr(meta, name).to(device) for name in tensors}
    return AttentionMetadata(num_decode_tokens=meta.num_decode_tokens, **moved)


def _measure(model, ops, config, kv_caches, meta, num_seqs, dtype, context_lens) -> dict[str, float]:
    token_ids = torch.randint(10, config.vocab_size - 10, (num_seqs,))
    positions = meta.decode_context_lens.long() - 1
    query = torch.randn(num_seqs, config.num_heads, config.head_dim, dtype=dtype)
    scale = config.head_dim**-0.5
    linears = _linear_shapes(model)
    inputs = {w.shape[1]: torch.randn(num_seqs, w.shape[1], dtype=dtype) for _, w in linears}
    with torch.inference_mode():
        hidden = model(token_ids, positions, kv_caches, meta)
        forward = _median_ms(lambda: model(token_ids, positions, kv_caches, meta))
        logits = _median_ms(lambda: model.compute_logits(hidden))
        attention = _median_ms(
            lambda: [
                ops.paged_decode_attention(query, k, v, meta.decode_block_tables, meta.decode_context_lens, scale)
                for k, v in kv_caches
            ]
        )
        linear = _median_ms(lambda: [torch.nn.functional.linear(inputs[w.shape[1]], w) for _, w in linears])
        roofline = _roofline_ms(model, linears, context_lens, dtype)
    step = forward + logits
    return {
        "step_batch": num_seqs,
        "step_mean_context": sum(context_lens) / num_seqs,
        "step_ms": step,
        "step_attention_ms": attention,
        "step_linear_ms": linear,
        "step_lm_head_ms": logits,
        "step_other_ms": max(forward - attention - linear, 0.0),
        **roofline,
        "step_over_roofline": step / roofline["roofline_ms_per_step"],
    }


def _roofline_ms(model, linears, context_lens: list[int], dtype: torch.dtype) -> dict[str, float]:
    """torch.mm on the step's weight shapes (fresh weights, one per layer) and torch.bmm on its attention."""
    config, num_seqs = model.config, len(context_lens)
    weights = [torch.randn(w.shape[1], w.shape[0], dtype=dtype) for _, w in linears]  # [in, out], as mm takes
    weights.append(torch.randn(config.hidden_size, config.vocab_size, dtype=dtype))
    inputs = {w.shape[0]: torch.randn(num_seqs, w.shape[0], dtype=dtype) for w in weights}
    matmuls = _median_ms(lambda: [torch.mm(inputs[w.shape[0]], w) for w in weights])
    mean_len = max(1, round(sum(context_lens) / num_seqs))
    group = config.num_heads // config.num_kv_heads
    batch = num_seqs * config.num_kv_heads
    layers = [
        (
            torch.randn(batch, group, config.head_dim, dtype=dtype),
            torch.randn(batch, config.head_dim, mean_len, dtype=dtype),  # K^T
            torch.randn(batch, mean_len, config.head_dim, dtype=dtype),  # V
        )
        for _ in range(config.num_layers)
    ]
    attention = _median_ms(lambda: [torch.bmm(torch.bmm(q, k_t), v) for q, k_t, v in layers])
    return {
        "roofline_ms_per_step": matmuls + attention,
        "roofline_matmul_ms": matmuls,
        "roofline_attention_ms": attention,
    }
