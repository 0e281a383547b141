"""Physical KV blocks: a free pool, reference counts, block tables, prefix caching and copy-on-write.

A block table maps a request's logical block i (token positions i*block_size ... (i+1)*block_size-1)
to a physical block of the cache tensors. Blocks are taken from the pool only when a request's last
block is full, so a request never holds more than block_size-1 empty slots.

Sharing: a block may appear in several tables (forked samples and beams, identical prefixes), counted
by its reference count. A full block is immutable and identified by a hash chain over its tokens and
every token before it; with prefix caching a new request starts from the cached blocks of its longest
cached prefix. A block whose count drops to zero but which holds a hashed full block stays reusable
(evictable, least recently used first) until the pool needs it. Writing into a shared, partly filled
block copies it first (copy-on-write); the copies are returned for the model runner to perform.

Sliding windows (`sliding_window` > 0: a model whose every layer attends through that window): a query at
position p reads only positions p - window + 1 .. p, so when a request's next query is at position q, its blocks
wholly before q - window + 1 are given back (released like a finished request's: a hashed one stays in the prefix
cache, evictable, its contents still those of its prefix). The table keeps its logical indexing: its first
`first_held(request)` entries are no longer the request's (their stale ids are still valid block indices, which
the kernels never read: they skip what lies before the window), and everything that walks a table's blocks (free,
fork, swap, hashing, utilisation) walks `held_blocks` only.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, sliding_window: int = 0
    ) -> None:
        if num_blocks < 1 or block_size < 1 or sliding_window < 0:
            raise ValueError(
                f"need num_blocks >= 1, block_size >= 1 and sliding_window >= 0, got {num_blocks}, {block_size}, "
                f"{sliding_window}"
            )
        self.sliding_window = sliding_window
        self._first_held: dict[str, int] = {}  # leading table entries given back (before the window), by request
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but cached, oldest first
        self._ref_counts = [0] * num_blocks
        self._fill = [0] * num_blocks  # slots holding tokens, per block in use
        self._filled_slots = 0
        self._hash_of_block: dict[int, bytes] = {}
        self._block_of_hash: dict[bytes, int] = {}
        self._block_tables: dict[str, list[int]] = {}
        self._block_hashes: dict[str, list[bytes]] = {}  # hashes of each request's full blocks, in order
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of which found

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def block_tables(self) -> dict[str, list[int]]:
        """Every request's block table, by request id (read-only to callers: for per-step loops over many)."""
        return self._block_tables

    def block_table(self, request_id: str) -> list[int]:
        return self._block_tables.get(request_id, [])

    def first_held(self, request_id: str) -> int:
        """How many leading entries of the request's table it gave back (wholly before its window): 0 without one."""
        return self._first_held.get(request_id, 0)

    def held_blocks(self, request_id: str) -> list[int]:
        """The blocks the request holds: its table past the entries it gave back."""
        return self._block_tables.get(request_id, [])[self._first_held.get(request_id, 0) :]

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of num_tokens tokens holds at once, computed in chunks of up to max_chunk
        tokens: all of them, or with a sliding window those from the first chunk query's window to its last."""
        whole = self.blocks_for_tokens(num_tokens)
        if not self.sliding_window:
            return whole
        return min(whole, self.blocks_for_tokens(self.sliding_window - 1 + max_chunk) + 1)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def num_shared_block_refs(self) -> int:
        """Block-table entries served by a block that another entry already uses: memory saved by sharing."""
        given_back = sum(self._first_held.values())
        return sum(len(t) for t in self._block_tables.values()) - given_back - self.num_used_blocks

    def kv_slot_utilization(self) -> float:
        """Slots holding tokens / slots in blocks in use (0.0 when none is in use: an idle cache holds nothing)."""
        used = self.num_used_blocks
        return self._filled_slots / (used * self.block_size) if used else 0.0

    # ---- allocation ------------------------------------------------------------------------------
    def _take_block(self) -> int:
        if self._free_block_ids:
            block_id = self._free_block_ids.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)  # least recently used cached block
            del self._block_of_hash[self._hash_of_block.pop(block_id)]
        self._ref_counts[block_id] = 1
        return block_id

    def _retain(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            self._evictable.pop(block_id)
            self._set_fill(block_id, self.block_size)  # only full blocks are cached
        self._ref_counts[block_id] += 1

    def _release(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] > 0:
            return
        self._set_fill(block_id, 0)
        if block_id in self._hash_of_block:
            self._evictable[block_id] = None
        else:
            self._free_block_ids.append(block_id)

    def _set_fill(self, block_id: int, fill: int) -> None:
        self._filled_slots += fill - self._fill[block_id]
        self._fill[block_id] = fill

    def _shared_write_block(self, table: list[int], num_computed: int, num_tokens: int) -> int | None:
        """Index in `table` of a shared block that positions [num_computed, num_tokens) would write into."""
        index = num_computed // self.block_size
        if num_tokens > num_computed and index < len(table) and self._ref_counts[table[index]] > 1:
            return index
        return None

    def allocate_slots(
        self, request_id: str, num_computed: int, num_tokens: int, first_query: int | None = None
    ) -> list[tuple[int, int]] | None:
        """Make positions [num_computed, num_tokens) of a request writable.

        Grows its table and un-shares a shared block it is about to write into. Returns the block copies
        (src, dst) that must happen before the write, or None (and no change but the next line's) if the pool is
        short. With a sliding window, blocks wholly before the window of first_query (the first position to be
        computed: num_computed unless a swapped-in request re-creates its table from 0) are given back first, or
        never taken. Runs for every scheduled sequence every step, hence the inlined arithmetic.
        """
        table = self._block_tables.get(request_id)
        if table is None:
            table = []
        size = self.block_size
        num_blocks = -(-num_tokens // size)
        first_held = 0
        if self.sliding_window:
            first_held = self._give_back_before_window(request_id, table, num_computed, first_query)
        shared = self._shared_write_block(table, num_computed, num_tokens)
        grow = num_blocks - len(table)
        if max(num_blocks - max(len(table), first_held), 0) + (shared is not None) > self.num_free_blocks:
            if request_id not in self._block_tables:
                self._first_held.pop(request_id, None)  # no table was made: nothing of it to remember
            return None
        self._block_tables[request_id] = table
        copies = []
        if shared is not None:
            source, target = table[shared], self._take_block()
            self._set_fill(target, self._fill[source])
            self._release(source)
            table[shared] = target
            copies.append((source, target))
        for index in range(len(table), len(table) + grow):
            table.append(self._take_block() if index >= first_held else 0)  # 0: a stale entry, never read
        fill = self._fill
        for index in range(max(num_computed // size, first_held), num_blocks):
            block_id = table[index]
            new_fill = min(size, num_tokens - index * size)
            if new_fill > fill[block_id]:
                self._filled_slots += new_fill - fill[block_id]
                fill[block_id] = new_fill
        return copies

    def _give_back_before_window(
        self, request_id: str, table: list[int], num_computed: int, first_query: int | None
    ) -> int:
        """Release the request's held blocks wholly before the window of its next query; the new first_held."""
        query = num_computed if first_query is None else first_query
        first_needed = max(query - self.sliding_window + 1, 0) // self.block_size
        first_held = self._first_held.get(request_id, 0)
        if first_needed <= first_held:
            return first_held
        for index in range(first_held, min(first_needed, len(table))):
            self._release(table[index])
        self._first_held[request_id] = first_needed
        return first_needed

    def append_slot(self, request_id: str, position: int, token_ids: list[int], num_known: int) -> bool:
        """`allocate_slots(request_id, position, position + 1)` then `cache_full_blocks(request_id, token_ids,
        num_known)` for the common decode step, where `position` falls in a block the request already holds alone:
        no growth, no copy-on-write, only its fill counter moves. False (nothing changed) otherwise: then those two
        decide. Most steps of a decoding sequence take this, so it is one call with the arithmetic inlined."""
        table = self._block_tables.get(request_id)
        index = position // self.block_size
        if table is None or index >= len(table) or self._ref_counts[block_id := table[index]] != 1:
            return False
        if (new_fill := position - index * self.block_size + 1) > self._fill[block_id]:
            self._set_fill(block_id, new_fill)
        if self.enable_prefix_caching:
            hashes = self._block_hashes.get(request_id)
            if hashes is None or len(hashes) < num_known // self.block_size:  # a block filled: hash it
                self.cache_full_blocks(request_id, token_ids, num_known)
        return True

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Cut a request's slots back to its first `num_tokens` (lookahead slots of speculative drafts that
        verification rejected): blocks past them go back to the pool (never hashed: they held no final token),
        the last one counts only the slots still holding tokens."""
        table = self._block_tables.get(request_id)
        if not table:
            return
        keep = max(self.blocks_for_tokens(num_tokens), self._first_held.get(request_id, 0))
        for block_id in reversed(table[keep:]):
            self._release(block_id)
        del table[keep:]
        if keep and (fill := num_tokens - (keep - 1) * self.block_size) < self._fill[table[-1]]:
            self._set_fill(table[-1], fill)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (copy-on-write later)."""
        table = list(self._block_tables.get(parent_id, []))
        first_held = self._first_held.get(parent_id, 0)
        for block_id in table[first_held:]:
            self._retain(block_id)
        self._block_tables[child_id] = table
        if first_held:
            self._first_held[child_id] = first_held
        self._block_hashes[child_id] = list(self._block_hashes.get(parent_id, []))

    def free(self, request_id: str) -> None:
        """Drop the request's references; blocks whose count reaches zero return to the pool (or the cache)."""
        table = self._block_tables.pop(request_id, [])
        self._block_hashes.pop(request_id, None)
        first_held = self._first_held.pop(request_id, 0)
        # Tail first: the cache then evicts a request's last blocks before its (more shareable) first ones.
        for block_id in reversed(table[first_held:]):
            self._release(block_id)

    # ---- prefix caching ----------------------------------------------------------------------------
    def _chain_hash(self, parent: bytes, tokens: list[int]) -> bytes:
        return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()

    def match_prefix(self, request_id: str, token_ids: list[int], namespace: bytes = b"") -> int:
        """Give a request with no blocks the cached blocks of its longest cached prefix; returns tokens covered.

        At least one token is always left to compute: its logits are what the request samples from. `namespace`
        seeds the hash chain: requests whose K/V over the same tokens differ pass different ones.
        """
        if not self.enable_prefix_caching or self._block_tables.get(request_id):
            return 0
        size = self.block_size
        hashes, table = [], []
        parent = namespace
        for start in range(0, len(token_ids) - 1 - (len(token_ids) - 1) % size, size):
            parent = self._chain_hash(parent, token_ids[start : start + size])
            block_id = self._block_of_hash.get(parent)
            if block_id is None:
                break
            hashes.append(parent)
            table.append(block_id)
        for block_id in table:
            self._retain(block_id)
        self._block_tables[request_id] = table
        self._block_hashes[request_id] = hashes
        self.num_prefix_queries += len(token_ids)
        self.num_prefix_hits += len(table) * size
        return len(table) * size

    def cache_full_blocks(
        self, request_id: str, token_ids: list[int], num_computed: int, namespace: bytes = b""
    ) -> None:
        """Register the hashes of a request's blocks that became full (computed) since the last call (`namespace`:
        match_prefix's)."""
        if not self.enable_prefix_caching:
            return
        hashes = self._block_hashes.setdefault(request_id, [])
        size = self.block_size
        if len(hashes) >= num_computed // size:
            return  # most steps: a decode token that does not fill its block
        table = self._block_tables[request_id]
        first_held = self._first_held.get(request_id, 0)
        for index in range(len(hashes), num_computed // size):
            parent = self._chain_hash(hashes[-1] if hashes else namespace, token_ids[index * size : (index + 1) * size])
            hashes.append(parent)
            block_id = table[index]
            if index < first_held:
                continue  # given back before it was hashed: its entry is stale
            if parent not in self._block_of_hash and block_id not in self._hash_of_block:
                self._block_of_hash[parent] = block_id
                self._hash_of_block[block_id] = parent

    def uncache_uncomputed(self, request_id: str, num_computed: int) -> None:
        """Forget hashes registered for blocks beyond `num_computed` tokens (a step that failed never wrote them)."""
        hashes = self._block_hashes.get(request_id)
        if not hashes:
            return
        table = self._block_tables.get(request_id, [])
        keep = num_computed // self.block_size
        first_held = self._first_held.get(request_id, 0)
        for index in range(keep, len(hashes)):
            block_id = table[index] if first_held <= index < len(table) else None
            if block_id is not None and self._hash_of_block.get(block_id) == hashes[index]:
                del self._hash_of_block[block_id]
                del self._block_of_hash[hashes[index]]
        del hashes[keep:]
