"""The batched LoRA kernels' cases of `pagedq bench kernels` (CUDA, which times them): lora_shrink and lora_expand
next to the torch reference (a gather of each token's weights), and lora_add, the two kernels as the layer calls
them, next to the slot-grouped torch path (the CPU backend's); each with its compulsory bytes (inputs read once,
outputs written once)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from pagedq.kernels import lora


def lora_shrink_bytes(num_tokens: int, in_dim: int, num_slices: int, rank: int, active_slots: int,
                      elem_bytes: int) -> int:  # fmt: skip
    """Read x and the A of every slot the step uses, write the fp32 buffer."""
    return (
        num_tokens * in_dim + active_slots * num_slices * rank * in_dim
    ) * elem_bytes + num_slices * num_tokens * rank * 4


def lora_expand_bytes(num_tokens: int, out_sizes: Sequence[int], rank: int, active_slots: int, elem_bytes: int) -> int:
    """Read the fp32 buffer and the used rows of every used slot's B, read and write y."""
    buffer = len(out_sizes) * num_tokens * rank * 4
    return buffer + (active_slots * sum(out_sizes) * rank + 2 * num_tokens * sum(out_sizes)) * elem_bytes


@dataclass(frozen=True)
class LoRABenchCase:
    """One timed call: the Triton kernel, a torch path on the same inputs, its compulsory bytes."""

    kernel: str
    shape: str
    triton: Callable[[], object]
    torch_path: Callable[[], object]
    num_bytes: int


DEFAULT_CASES = ((64, 16), (64, 64), (4096, 16))  # (tokens, rank): decode at two ranks, then a prefill


def lora_bench_cases(device: torch.device, dtype: torch.dtype = torch.bfloat16, hidden: int = 4096,
                     kv_out: int = 1024, num_slots: int = 8,
                     cases: Sequence[tuple[int, int]] = DEFAULT_CASES) -> list[LoRABenchCase]:  # fmt: skip
    """lora_shrink, lora_expand and lora_add on a qkv_proj (N = 3, GQA out sizes), per (tokens, rank), the tokens
    spread round-robin over `num_slots` adapters."""
    from pagedq.kernels import triton_ops

    out_sizes = (hidden, kv_out, kv_out)
    elem = torch.empty((), dtype=dtype).element_size()
    outs = "+".join(map(str, out_sizes))
    timed: list[LoRABenchCase] = []
    for tokens, rank in cases:
        index = lora.LoRAIndex.build(torch.arange(tokens, dtype=torch.int32) % num_slots, num_slots, device)
        x = torch.randn(tokens, hidden, dtype=dtype, device=device)
        lora_a = torch.randn(num_slots, 3, rank, hidden, dtype=dtype, device=device) / hidden**0.5
        lora_b = torch.randn(num_slots, 3, max(out_sizes), rank, dtype=dtype, device=device) / rank**0.5
        y = torch.randn(tokens, sum(out_sizes), dtype=dtype, device=device)
        buf = triton_ops.lora_shrink(x, lora_a, index)
        active = len(index.host_segments)
        timed += [
            LoRABenchCase("lora_shrink", f"T={tokens} in={hidden} N=3 R={rank} S={num_slots}",
                          partial(triton_ops.lora_shrink, x, lora_a, index),
                          partial(lora.lora_shrink, x, lora_a, index),
                          lora_shrink_bytes(tokens, hidden, 3, rank, active, elem)),
            LoRABenchCase("lora_expand", f"T={tokens} out={outs} R={rank} S={num_slots}",
                          partial(triton_ops.lora_expand, y, buf, lora_b, index, out_sizes),
                          partial(lora.lora_expand, y, buf, lora_b, index, out_sizes),
                          lora_expand_bytes(tokens, out_sizes, rank, active, elem)),
            LoRABenchCase("lora_add", f"T={tokens} in={hidden} out={outs} R={rank} S={num_slots}",
                          partial(triton_ops.lora_add, y, x, lora_a, lora_b, index, out_sizes),
                          partial(lora.grouped_lora_add, y, x, lora_a, lora_b, index, out_sizes),
                          lora_shrink_bytes(tokens, hidden, 3, rank, active, elem)
                          + lora_expand_bytes(tokens, out_sizes, rank, active, elem)),
        ]  # fmt: skip
    return timed
