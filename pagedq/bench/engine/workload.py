"""The random-token workload of `bench throughput` (the anchors' draw) and transformers' left-padded batches, apart
so every bench module can use them."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def draw_workload(
    num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int, seed: int = 0
) -> Workload:
    """Per request, in order: prompt length, its tokens in [10, vocab-10), then output length (as the anchors)."""
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(num_prompts):
        length = rng.randint(*input_len)
        prompts.append([rng.randrange(10, vocab_size - 10) for _ in range(length)])
        outputs.append(rng.randint(*output_len))
    return Workload(prompts, outputs)


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) of prompts left-padded to the longest, as transformers' generate takes a batch."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask
