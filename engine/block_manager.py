"""Physical KV blocks: a free pool, reference counts, and one block table per request.

A block table maps a request's logical block i (token positions i*block_size ... (i+1)*block_size-1)
to a physical block of the cache tensors. Blocks are taken from the pool only when a request's last
block is full, so a request never holds more than block_size-1 empty slots.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._block_tables: dict[str, list[int]] = {}
        self._num_slots_used: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - len(self._free_block_ids)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._block_tables.get(request_id, [])

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def num_blocks_to_grow(self, request_id: str, num_tokens: int) -> int:
        """How many new blocks `request_id` needs to hold `num_tokens` tokens in all."""
        return max(0, self.blocks_for_tokens(num_tokens) - len(self.block_table(request_id)))

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold `num_tokens` tokens; False (and no change) if the pool is short."""
        needed = self.num_blocks_to_grow(request_id, num_tokens)
        if needed > len(self._free_block_ids):
            return False
        table = self._block_tables.setdefault(request_id, [])
        for _ in range(needed):
            block_id = self._free_block_ids.popleft()
            self._ref_counts[block_id] = 1
            table.append(block_id)
        self._num_slots_used[request_id] = max(self._num_slots_used.get(request_id, 0), num_tokens)
        return True

    def free(self, request_id: str) -> None:
        """Drop the request's references; blocks whose count reaches zero return to the pool."""
        table = self._block_tables.pop(request_id, [])
        self._num_slots_used.pop(request_id, None)
        # Reversed so the tail blocks (least likely to be shared later) are reused first.
        for block_id in reversed(table):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_block_ids.append(block_id)

    def slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Cache slots of token positions [start, end) of a request."""
        table = self._block_tables[request_id]
        size = self.block_size
        return [table[pos // size] * size + pos % size for pos in range(start, end)]

    def kv_slot_utilization(self) -> float:
        """Token slots holding real tokens / slots in allocated blocks (1.0 when nothing is allocated)."""
        allocated = self.num_used_blocks * self.block_size
        if allocated == 0:
            return 1.0
        return sum(self._num_slots_used.values()) / allocated
