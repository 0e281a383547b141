"""Builders of paged-cache test inputs shared by the kernel tests (not a test module)."""

from __future__ import annotations

import torch

# (atol, rtol) per dtype. fp32: both sides accumulate in fp32, only summation order differs. bf16/fp16: the
# kernels round probabilities to the input dtype for the tensor-core P @ V product, and the interpreter
# truncates fp32 -> bf16 instead of rounding to nearest, so results may differ by one or two ulps.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    atol, rtol = TOLERANCES[dtype or expected.dtype]
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


def make_paged_kv(context_lens, num_kv_heads, head_dim, block_size, dtype, device, spare_blocks=3):
    """Random caches plus block tables that scatter each sequence over a random permutation of the pool.

    Table entries past a sequence's last block point at other random (valid) blocks: kernels must ignore them.
    """
    blocks_per_seq = [max(1, -(-n // block_size)) for n in context_lens]
    max_blocks = max(blocks_per_seq) + 1
    num_blocks = sum(blocks_per_seq) + spare_blocks
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32).to(dtype)
    pool = torch.randperm(num_blocks)
    tables = torch.randint(0, num_blocks, (len(context_lens), max_blocks))
    start = 0
    for seq, used in enumerate(blocks_per_seq):
        tables[seq, :used] = pool[start : start + used]
        start += used
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return k_cache.to(device), v_cache.to(device), tables.to(torch.int32).to(device), lens.to(device)


def edge_context_lens(block_size: int, extra_random: int = 1, max_len: int | None = None) -> list[int]:
    """1, block_size - 1, block_size, block_size + 1, plus random lengths up to max_len (default 3 blocks)."""
    max_len = max_len or 3 * block_size
    randoms = torch.randint(2, max_len + 1, (extra_random,)).tolist()
    return [1, block_size - 1, block_size, block_size + 1, *randoms]
