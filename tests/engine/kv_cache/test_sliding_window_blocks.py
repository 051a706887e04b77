"""KV cache manager with a sliding window: blocks out of every future query's window go
back to the pool (exact block ids and free order), and prefix hits stay correct."""

from __future__ import annotations

from engine.kv_cache import SKIPPED, KVCacheManager
from tests.engine.kv_cache.test_kv_cache import B, admit, free_order, make_request

WINDOW = 4  # tokens: a query at position p sees p - 3..p


def test_blocks_before_the_window_are_freed_tail_first() -> None:
    manager = KVCacheManager(8, B, sliding_window=WINDOW)
    a = make_request("a", list(range(100, 113)))  # 13 tokens: blocks 0-3
    assert admit(manager, a) == [0, 1, 2, 3]
    # Admitted from position 0: every block is in the window of a prompt query.
    assert [b.block_id for b in manager.held_blocks("a")] == [0, 1, 2, 3]
    a.append_output_token(7)
    # The decode's query sits at 13 and sees 10..13: blocks 0 (0-3) and 1 (4-7) go back.
    assert manager.allocate_slots(a, 1) == []
    assert [b.block_id for b in manager.held_blocks("a")] == [2, 3]
    assert manager.block_ids("a") == [0, 1, 2, 3]  # positions keep their pages
    assert free_order(manager) == [4, 5, 6, 7, 1, 0]
    manager.check_invariants()
    manager.free(a)
    assert free_order(manager) == [4, 5, 6, 7, 1, 0, 3, 2]
    manager.check_invariants()


def test_a_prefix_hit_after_freeing_never_uses_a_reused_block() -> None:
    manager = KVCacheManager(6, B, sliding_window=WINDOW)
    prompt = list(range(100, 113))
    a = make_request("a", prompt)
    admit(manager, a)
    a.append_output_token(7)
    manager.allocate_slots(a, 1)  # frees blocks 0 and 1, still cached
    a.num_computed_tokens += 1

    # A second request with the same prompt hits all three full blocks, but takes only the
    # one in the window of its first query (it resumes at 12 and sees 9..12): block 2. The
    # two before it are SKIPPED: page 0, held by nobody.
    b = make_request("b", prompt)
    hits, num_hit = manager.get_computed_blocks(b)
    assert hits == [SKIPPED, SKIPPED, manager.pool.blocks[2]] and num_hit == 12
    assert [n.block_id for n in manager.allocate_slots(b, 1, hits) or []] == [4]
    assert manager.block_ids("b") == [0, 0, 2, 4]
    assert [h.block_id for h in manager.held_blocks("b")] == [2, 4]
    assert free_order(manager) == [5, 1, 0]
    manager.check_invariants()

    # Another prompt takes the free blocks from the front, reusing block 1 (not 0). The
    # first prompt still hits whole, as its window needs block 2 only; its first 9 tokens
    # (a hit of two blocks would need block 1 for its window) hit one block.
    c = make_request("c", list(range(200, 205)))
    assert admit(manager, c) == [5, 1]
    d = make_request("d", prompt)
    hits, num_hit = manager.get_computed_blocks(d)
    assert [h.block_id for h in hits] == [0, 0, 2] and num_hit == 12
    e = make_request("e", prompt[:9])
    hits, num_hit = manager.get_computed_blocks(e)
    assert hits == [manager.pool.blocks[0]] and num_hit == B
    manager.check_invariants()


def test_freed_blocks_count_as_free_space_for_the_next_step() -> None:
    """A decode that needs a new block fits by the blocks its window gave back."""
    manager = KVCacheManager(4, B, sliding_window=WINDOW)
    a = make_request("a", list(range(100, 116)))  # 16 tokens: all 4 blocks
    assert admit(manager, a) == [0, 1, 2, 3]
    assert manager.pool.num_free_blocks == 0
    a.append_output_token(7)
    # Query at 16 sees 13..16: blocks 0-2 go back, and block 4 of the request is block 2.
    assert [b.block_id for b in manager.allocate_slots(a, 1) or []] == [2]
    assert [b.block_id for b in manager.held_blocks("a")] == [3, 2]
    manager.check_invariants()


def test_without_a_window_nothing_is_freed() -> None:
    manager = KVCacheManager(8, B)
    a = make_request("a", list(range(100, 113)))
    admit(manager, a)
    a.append_output_token(7)
    manager.allocate_slots(a, 1)
    assert [b.block_id for b in manager.held_blocks("a")] == [0, 1, 2, 3]
