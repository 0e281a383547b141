"""BlockManager with a sliding window (every layer slides): blocks wholly before a request's window go back to
the pool, and every walk over a table (free, fork, swap, hashing, copy-on-write, utilisation) skips them."""

from __future__ import annotations

import pytest

from pagedq.engine.core.block_manager import BlockManager
from pagedq.engine.core.swap import SwapSpace

SIZE, WINDOW = 4, 6  # a query at p sees p - 5 .. p


def _tokens(n: int, start: int = 10) -> list[int]:
    return list(range(start, start + n))


def test_blocks_before_the_window_go_back():
    manager = BlockManager(10, SIZE, enable_prefix_caching=False, sliding_window=WINDOW)
    assert manager.allocate_slots("a", 0, 12) == []  # prompt of 12: blocks 0-2
    assert manager.num_used_blocks == 3 and manager.first_held("a") == 0
    assert manager.allocate_slots("a", 12, 13) == []  # query 12 sees 7..12: block 0 (0-3) goes back, block 1 stays
    assert manager.first_held("a") == 1 and manager.num_used_blocks == 3  # block 3 taken, block 0 back
    assert manager.held_blocks("a") == manager.block_table("a")[1:] and len(manager.block_table("a")) == 4
    assert manager.kv_slot_utilization() == pytest.approx(9 / 12)  # held: 4 + 4 + 1 slots
    manager.allocate_slots("a", 13, 20)  # query 13 sees 8..13: block 1 (4-7) goes back too
    assert manager.first_held("a") == 2 and manager.num_used_blocks == 3
    manager.free("a")
    assert manager.num_free_blocks == 10 and manager.num_used_blocks == 0 and manager.first_held("a") == 0


def test_a_fresh_table_never_takes_blocks_before_the_window():
    """A swapped-in request re-creates its table from position 0 (first_query past the window): the entries
    before its window are stale, never taken, and the pool only needs the window's blocks."""
    manager = BlockManager(4, SIZE, sliding_window=WINDOW)
    copies = manager.allocate_slots("a", 0, 30, first_query=25)  # window of 25: 20..25, blocks 5..7
    assert copies == [] and manager.first_held("a") == 5 and manager.num_used_blocks == 3
    assert len(manager.block_table("a")) == 8
    assert manager.allocate_slots("b", 0, 40, first_query=10) is None  # needs blocks 1..9: more than 1 free
    assert manager.num_used_blocks == 3  # nothing taken


def test_fork_shares_only_the_held_blocks():
    manager = BlockManager(10, SIZE, enable_prefix_caching=False, sliding_window=WINDOW)
    manager.allocate_slots("a", 0, 16)
    manager.allocate_slots("a", 16, 17)  # query 16 sees 11..16: blocks 0, 1 go back
    held = manager.held_blocks("a")
    manager.fork("a", "b")
    assert manager.first_held("b") == 2 and manager.held_blocks("b") == held
    assert all(manager.ref_count(block) == 2 for block in held)
    assert manager.num_shared_block_refs() == len(held)
    copies = manager.allocate_slots("b", 17, 18)  # writes into the shared last block: copy-on-write
    assert copies is not None and len(copies) == 1 and copies[0][0] == held[-1]
    manager.free("a")
    manager.free("b")
    assert manager.num_free_blocks == 10


def test_given_back_blocks_stay_cached_with_their_prefix():
    manager = BlockManager(6, SIZE, enable_prefix_caching=True, sliding_window=WINDOW)
    tokens = _tokens(16)
    manager.allocate_slots("a", 0, 8)
    manager.cache_full_blocks("a", tokens, 8)  # blocks 0, 1 hashed
    manager.allocate_slots("a", 8, 16)  # a chunk 8..15: its first query sees 3..8, so block 0 is still needed
    assert manager.first_held("a") == 0
    manager.allocate_slots("a", 16, 17)  # query 16 sees 11..16: blocks 0, 1 go back (hashed: evictable)
    assert manager.first_held("a") == 2 and manager.num_used_blocks == 3
    stale = manager.block_table("a")[:2]
    # a second request with the same first 9 tokens finds both blocks in the prefix cache, with their prefix
    assert manager.match_prefix("b", tokens[:9]) == 8 and manager.block_table("b") == stale
    manager.free("b")
    # the pool takes never-used blocks first, then evicts the cached ones: afterwards the prefix is gone
    manager.allocate_slots("c", 0, 12)
    assert manager.match_prefix("d", tokens[:9]) == 0


def test_a_block_given_back_before_it_was_hashed_is_never_registered():
    """Hashing a request's full blocks after some went back: their stale entries now name other requests'
    blocks, and registering them would serve those as this prefix."""
    manager = BlockManager(6, SIZE, enable_prefix_caching=True, sliding_window=WINDOW)
    tokens = _tokens(17)
    manager.allocate_slots("a", 0, 16)
    manager.allocate_slots("a", 16, 17)  # blocks 0, 1 go back unhashed: to the free pool
    manager.allocate_slots("c", 0, 12)  # takes them (and one more)
    assert set(manager.block_table("a")[:2]) <= set(manager.held_blocks("c"))
    manager.cache_full_blocks("a", tokens, 16)  # blocks 0-3 full: only 2 and 3 are a's
    assert manager.match_prefix("d", tokens[:9]) == 0
    manager.free("c")
    manager.free("d")
    assert manager.match_prefix("e", tokens) == 0  # the chain breaks at block 0: nothing served


def test_swap_pairs_follow_the_table_index():
    swap = SwapSpace(8)
    pairs = swap.swap_out("a", [10, 11, 12], first=2)  # entries 2, 3, 4 of the table
    assert pairs is not None and [device for device, _ in pairs] == [10, 11, 12]
    host = [h for _, h in pairs]
    back = swap.swap_in("a", [20, 21, 22], first=3)  # entry 2 went out of the window meanwhile; 5 is new
    assert back == [(host[1], 20), (host[2], 21)]
    assert swap.num_free_blocks == 8
