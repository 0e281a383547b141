"""How a flattened step batch maps onto requests and KV-cache slots: what every attention layer reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
