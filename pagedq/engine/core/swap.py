"""The CPU side of swap preemption: a pool of host blocks holding the KV of swapped-out requests.

On CUDA the pool is pinned, so the copies in and out run at full PCIe/NVLink-C2C speed.
"""

from __future__ import annotations

from collections import deque


class SwapSpace:
    def __init__(self, num_blocks: int) -> None:
        self.num_total_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, tuple[int, list[int]]] = {}  # (table index of the first host block, host blocks)
        self.num_swapped_out = 0
        self.num_swapped_in = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def swap_out(self, request_id: str, device_table: list[int], first: int = 0) -> list[tuple[int, int]] | None:
        """Reserve host blocks for a request's device blocks, entries first, first + 1, ... of its table (a sliding
        window's request holds none before `first`); (device, host) pairs, or None if the pool is short."""
        if len(device_table) > len(self._free):
            return None
        host_table = [self._free.popleft() for _ in device_table]
        self._tables[request_id] = (first, host_table)
        self.num_swapped_out += 1
        return list(zip(device_table, host_table))

    def swap_in(self, request_id: str, device_table: list[int], first: int = 0) -> list[tuple[int, int]]:
        """Release a request's host blocks into the given device blocks (table entries first, first + 1, ...);
        (host, device) pairs for the entries both hold (host blocks before `first`, given back to a sliding window
        since, come back to the pool uncopied)."""
        host_first, host_table = self._tables.pop(request_id)
        self._free.extend(host_table)
        self.num_swapped_in += 1
        skip = max(first - host_first, 0)
        return list(zip(host_table[skip:], device_table[max(host_first - first, 0) :]))

    def discard(self, request_id: str) -> None:
        """An aborted swapped-out request: its host blocks go back to the pool."""
        self._free.extend(self._tables.pop(request_id, (0, []))[1])
