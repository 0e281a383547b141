"""How a flattened step batch maps onto requests and KV-cache slots: what every attention layer reads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar, cast

import torch

T = TypeVar("T")


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
    # What a kernel derives from the fields above, the same for every layer (the CPU attention's plans): built by
    # the first layer of the step that asks, reused by the others. Metadata lives one step, and so do these.
    derived: dict[str, object] = field(default_factory=dict, repr=False, compare=False)

    @property
    def has_prefill(self) -> bool:
        return self.prefill_context_lens.numel() > 0

    def derive(self, key: str, build: Callable[[], T]) -> T:
        """build(), once per metadata: what every layer would otherwise recompute from the same tensors."""
        if key not in self.derived:
            self.derived[key] = build()
        return cast(T, self.derived[key])
