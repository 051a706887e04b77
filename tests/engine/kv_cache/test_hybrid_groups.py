"""A hybrid model's KV cache groups (full layers beside sliding ones) on one block pool:
how layers are grouped, each group's table with exact block ids, the sliding group's
blocks freed out of its window while the full group keeps its own, prefix hits as long as
every group serves, and KV events for group 0 only."""

from __future__ import annotations

from engine.kv_cache import SKIPPED, GroupBlocks, KVCacheGroups, KVCacheManager
from engine.kv_cache.block import BlockHash
from tests.engine.kv_cache.test_kv_cache import B, admit, free_order, make_request

WINDOW = 4  # tokens: a query at position p sees p - 3..p


def test_layers_of_a_kind_share_slots_group_by_group() -> None:
    # gpt-oss: sliding and full layers alternate.
    gpt_oss = KVCacheGroups.for_layers([128, None, 128, None])
    assert gpt_oss.windows == (None, 128) and gpt_oss.num_slots == 2
    assert gpt_oss.layer_groups == (1, 0, 1, 0) and gpt_oss.layer_slots == (0, 0, 1, 1)
    assert gpt_oss.hybrid and gpt_oss.layers(1) == [0, 2]
    # Gemma 3 (26 layers: every sixth full): 4 full layers, 22 sliding in 6 groups of up
    # to 4 slots.
    windows = [None if i % 6 == 5 else 512 for i in range(26)]
    gemma = KVCacheGroups.for_layers(windows)
    assert gemma.num_slots == 4 and gemma.windows == (None,) + (512,) * 6
    assert gemma.layers(0) == [5, 11, 17, 23] and gemma.layers(6) == [24, 25]
    assert sorted(zip(gemma.layer_groups, gemma.layer_slots, strict=True)) == sorted(
        {(g, s) for g, s in zip(gemma.layer_groups, gemma.layer_slots, strict=True)}
    )  # no two layers share a group's slot
    assert gemma.describe().startswith("7 groups (full, window 512, window 512,")
    # Layers that attend alike: one group, a slot a layer.
    for uniform in ([None] * 3, [8] * 3):
        single = KVCacheGroups.for_layers(uniform)
        assert not single.hybrid and single.layer_slots == (0, 1, 2)
        assert single.windows == (uniform[0],)


def test_the_sliding_group_frees_its_blocks_while_the_full_group_keeps_them() -> None:
    manager = KVCacheManager(12, B, groups=(None, WINDOW))
    a = make_request("a", list(range(100, 113)))  # 13 tokens: 4 blocks in each group
    assert admit(manager, a) == [0, 1, 2, 3]
    assert manager.block_ids("a", 1) == [4, 5, 6, 7]
    assert manager.other_group_block_ids("a") == ([4, 5, 6, 7],)
    a.append_output_token(7)
    # The decode's query at 13 sees 10..13: the sliding group gives back its blocks for
    # 0-3 and 4-7; the full group keeps all four.
    assert manager.allocate_slots(a, 1) == []
    assert [b.block_id for b in manager.held_blocks("a", 0)] == [0, 1, 2, 3]
    assert [b.block_id for b in manager.held_blocks("a", 1)] == [6, 7]
    assert free_order(manager) == [8, 9, 10, 11, 5, 4]
    manager.check_invariants()
    a.num_computed_tokens += 1
    for token in (8, 9):  # positions 14 and 15 fit the tables
        a.append_output_token(token)
        assert manager.allocate_slots(a, 1) == []
        a.num_computed_tokens += 1
    # Position 16 takes a block in each group (the sliding group gave back block 6 first).
    a.append_output_token(10)
    new = manager.allocate_slots(a, 1)
    assert isinstance(new, GroupBlocks) and [[b.block_id for b in g] for g in new.groups] == [
        [8],
        [9],
    ]
    manager.check_invariants()
    manager.free(a)
    assert manager.pool.num_free_blocks == 12
    manager.check_invariants()


def test_a_step_that_does_not_fit_every_group_changes_nothing() -> None:
    manager = KVCacheManager(7, B, groups=(None, WINDOW))
    a = make_request("a", list(range(100, 113)))  # 4 blocks a group: 8 > 7
    hits, num_hit = manager.get_computed_blocks(a)
    assert num_hit == 0 and manager.allocate_slots(a, 13, hits) is None
    assert manager.pool.num_free_blocks == 7 and manager.req_to_blocks == {}
    # Chunks fit: 8 tokens (2 + 2 blocks), then 5 more, for which the sliding group gives
    # back its first block (block 2) before it takes two.
    assert manager.allocate_slots(a, 8, hits) is not None
    a.num_computed_tokens = 8
    assert manager.allocate_slots(a, 5) is not None
    assert manager.block_ids("a") == [0, 1, 4, 5]
    assert [b.block_id for b in manager.held_blocks("a", 1)] == [3, 6, 2]
    assert manager.blocks_for_one_request(max_model_len=64, max_chunk=8) == 16 + 4
    manager.check_invariants()


def test_a_prefix_hit_is_as_long_as_every_group_serves() -> None:
    manager = KVCacheManager(10, B, groups=(None, WINDOW))  # all used once b has run
    prompt = list(range(100, 113))
    a = make_request("a", prompt)
    admit(manager, a)  # full: 0-3, sliding: 4-7
    manager.free(a)

    # The whole prompt's 3 full blocks: the full group's 0-2, the sliding group's block
    # in the window of position 12 (9..12: its block 2, block 6), the rest SKIPPED.
    b = make_request("b", prompt)
    hits, num_hit = manager.get_computed_blocks(b)
    assert isinstance(hits, GroupBlocks) and num_hit == 12
    assert [h.block_id for h in hits] == [0, 1, 2]
    assert hits.groups[1] == [SKIPPED, SKIPPED, manager.pool.blocks[6]]
    assert manager.allocate_slots(b, 1, hits) is not None
    assert manager.block_ids("b") == [0, 1, 2, 8] and manager.block_ids("b", 1) == [0, 0, 6, 9]
    assert [h.block_id for h in manager.held_blocks("b", 1)] == [6, 9]
    assert manager.counters.hits == 12
    manager.check_invariants()
    manager.free(b)

    # The sliding group's block 6 reused: a hit of 3 blocks needs it; one of 2 needs the
    # sliding group's second block (5), cached still.
    evict(manager, 6)
    c = make_request("c", prompt)
    hits, num_hit = manager.get_computed_blocks(c)
    assert num_hit == 2 * B and isinstance(hits, GroupBlocks)
    assert [h.block_id for h in hits.groups[0]] == [0, 1]
    assert hits.groups[1] == [SKIPPED, manager.pool.blocks[5]]

    # The full group's chain broken at its second block (1), which the sliding group's
    # window at position 4 does not need: a hit of one block in each.
    evict(manager, 1)
    d = make_request("d", prompt)
    hits, num_hit = manager.get_computed_blocks(d)
    assert num_hit == B and isinstance(hits, GroupBlocks)
    assert hits.groups == ([manager.pool.blocks[0]], [manager.pool.blocks[4]])
    manager.check_invariants()


def evict(manager: KVCacheManager, block_id: int) -> None:
    """Reuses one free block, and only it, as an allocation that reached it would: its
    hash goes, the other free blocks keep theirs (the free queue is reordered)."""
    pool = manager.pool
    queued = list(pool.free_queue)
    pool.touch(queued)
    pool.free(sorted(queued, key=lambda b: b.block_id != block_id))
    [taken] = pool.allocate(1)
    assert taken.block_id == block_id and taken.block_hash is None
    pool.free([taken])


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, tuple[int, ...]]] = []

    def block_stored(self, block_hash: BlockHash, parent: BlockHash | None) -> None:
        self.events.append(("stored", block_hash.token_ids))

    def block_removed(self, block_hash: BlockHash) -> None:
        self.events.append(("removed", block_hash.token_ids))

    def all_cleared(self) -> None:
        self.events.append(("cleared", ()))


def test_kv_events_report_group_0_only() -> None:
    recorder = Recorder()
    manager = KVCacheManager(8, B, events=recorder, groups=(None, WINDOW))
    a = make_request("a", list(range(8)))
    admit(manager, a)  # two full blocks in each group
    assert recorder.events == [("stored", (0, 1, 2, 3)), ("stored", (4, 5, 6, 7))]
    assert len(manager.pool.cached) == 4
    manager.free(a)
    manager.pool.allocate(8)  # every block evicted, the other group's silently
    assert recorder.events[2:] == [("removed", (4, 5, 6, 7)), ("removed", (0, 1, 2, 3))]
    assert manager.pool.cached == {}
