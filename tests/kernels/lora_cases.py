"""Batched-LoRA test cases shared by the CPU-path and Triton tests, and an oracle independent of `kernels.lora`:
a plain per-token loop over the formula, written here so the reference itself is checked against it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# (name, token slots, number of slots, rank used by each slot (<= R), out sizes per slice)
CASES = {
    "mixed_qkv_gqa": ([2, -1, 0, 2, -1, 1, 0, 2, 2], 4, (8, 16, 4, 16), (32, 8, 8)),
    "one_slot_gate_up": ([1, 1, 1, 1, 1], 2, (16, 8), (24, 24)),
    "no_adapter_tokens": ([-1, -1, -1], 3, (16, 16, 16), (32,)),
    "single_token": ([0], 1, (16,), (24,)),
    "single_base_token": ([-1], 2, (16, 16), (16, 8)),
    "every_slot_one_token": ([3, 2, 1, 0], 4, (4, 8, 16, 2), (32,)),
    "decode_segments_padded": ([1, 0, -1, 1, 0, 1, -1], 3, (16, 8, 4), (24, 8, 8)),
    # the CPU path's layouts (kernels.lora.SlotRows): every slot in a full grid; a grid read by base tokens too; a
    # grid of slots that are not consecutive (their weights gathered); long unequal runs of one slot, looped over
    "decode_every_slot": ([i % 4 for i in range(12)], 4, (16, 8, 4, 12), (24, 8, 8)),
    "decode_with_base_tokens": ([2, -1, 0, 1, 2, -1, 1, 0], 3, (8, 16, 4), (32,)),
    "decode_slot_gap": ([3, 0, 3, -1, 0], 4, (16, 8, 4, 12), (24, 8, 8)),
    "prefill_runs": ([1] * 9 + [-1] * 4 + [0] * 2 + [1] * 5, 2, (16, 8), (24, 24)),
}
RANK = 16
IN_DIM = 48


@dataclass
class LoRACase:
    slots: torch.Tensor
    num_slots: int
    x: torch.Tensor
    y: torch.Tensor
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    out_sizes: tuple[int, ...]


def make_case(name: str, dtype: torch.dtype, device: str = "cpu") -> LoRACase:
    """Random inputs for CASES[name]: adapters of rank below R are zero-padded as the engine stores them."""
    slot_list, num_slots, ranks, out_sizes = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    num_slices, max_out = len(out_sizes), max(out_sizes)
    lora_a = torch.randn(num_slots, num_slices, RANK, IN_DIM, generator=gen) / IN_DIM**0.5
    lora_b = torch.randn(num_slots, num_slices, max_out, RANK, generator=gen) / RANK**0.5
    for slot, rank in enumerate(ranks):
        lora_a[slot, :, rank:] = 0
        lora_b[slot, :, :, rank:] = 0
    num_tokens = len(slot_list)
    return LoRACase(
        slots=torch.tensor(slot_list, dtype=torch.int32),
        num_slots=num_slots,
        x=torch.randn(num_tokens, IN_DIM, generator=gen).to(device, dtype),
        y=torch.randn(num_tokens, sum(out_sizes), generator=gen).to(device, dtype),
        lora_a=lora_a.to(device, dtype),
        lora_b=lora_b.to(device, dtype),
        out_sizes=out_sizes,
    )


def loop_shrink(case: LoRACase) -> torch.Tensor:
    num_slices, rank = case.lora_a.shape[1], case.lora_a.shape[2]
    buf = torch.zeros(num_slices, len(case.slots), rank, dtype=torch.float64)
    for t, slot in enumerate(case.slots.tolist()):
        if slot >= 0:
            for n in range(num_slices):
                buf[n, t] = case.lora_a[slot, n].double().cpu() @ case.x[t].double().cpu()
    return buf


def loop_expand(case: LoRACase, buf: torch.Tensor) -> torch.Tensor:
    y = case.y.double().cpu().clone()
    for t, slot in enumerate(case.slots.tolist()):
        offset = 0
        for n, size in enumerate(case.out_sizes):
            if slot >= 0:
                y[t, offset : offset + size] += case.lora_b[slot, n, :size].double().cpu() @ buf[n, t].double().cpu()
            offset += size
    return y


TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
