"""How many KV blocks fit on the GPU: after the weights and a profiled activation peak.

A dummy step of max_num_batched_tokens prompt tokens (plus sampling over max_num_seqs rows) is run with
a throwaway cache just large enough for it; the peak it reaches, less that throwaway cache, is what one
step needs besides the KV cache. The rest of gpu_memory_utilization * total memory becomes blocks.
"""

from __future__ import annotations

import torch

from pagedq.engine.layers import AttentionMetadata
from pagedq.engine.sample.sampler import SamplingBatch, sample


def profile_num_blocks(runner) -> int:
    config, model_config = runner.config, runner.model_config
    device = runner.device
    num_tokens = min(config.max_num_batched_tokens, config.max_model_len)
    block_size = runner.block_size
    num_blocks = -(-num_tokens // block_size)
    shape = (num_blocks, block_size, model_config.num_kv_heads, model_config.head_dim)
    scratch = [
        (torch.zeros(shape, dtype=config.dtype, device=device), torch.zeros(shape, dtype=config.dtype, device=device))
        for _ in range(model_config.num_layers)
    ]
    scratch_bytes = 2 * model_config.num_layers * scratch[0][0].numel() * scratch[0][0].element_size()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        input_ids, positions, meta = _dummy_prefill(num_tokens, block_size, num_blocks, device)
        hidden = runner.model(input_ids, positions, scratch, meta)
        rows = min(config.max_num_seqs, num_tokens)
        logits = runner.model.compute_logits(hidden[:rows])
        sample(logits, _dummy_sampling(rows, device), runner.kernels)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch_bytes
    del scratch, hidden, logits
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    available = total * config.gpu_memory_utilization - peak
    blocks = int(available // runner.bytes_per_block)
    if blocks < 1:
        raise RuntimeError(
            f"no room for the KV cache: step peak {peak / 2**30:.1f} GiB of "
            f"{total * config.gpu_memory_utilization / 2**30:.1f} GiB allowed; "
            "raise gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return blocks


def _dummy_prefill(num_tokens: int, block_size: int, num_blocks: int, device):
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, dtype=torch.long, device=device)
    table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :]
    meta = AttentionMetadata(
        slot_mapping=positions.clone(),
        num_decode_tokens=0,
        decode_block_tables=table[:0],
        decode_context_lens=torch.zeros(0, dtype=torch.int32, device=device),
        prefill_block_tables=table,
        prefill_cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        prefill_context_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
    )
    return input_ids, positions, meta


def _dummy_sampling(rows: int, device) -> SamplingBatch:
    def full(value, dtype):
        return torch.full((rows,), value, dtype=dtype, device=device)

    return SamplingBatch(
        temperature=full(1.0, torch.float32),
        top_k=full(50, torch.long),
        top_p=full(0.9, torch.float32),
        min_p=full(0.0, torch.float32),
        seeds=full(0, torch.long),
        positions=full(0, torch.long),
        max_num_logprobs=5,
    )
