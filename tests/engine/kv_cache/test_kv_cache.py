"""KV cache manager: exact block ids, free-queue order, prefix caching rules."""

from __future__ import annotations

import random

import pytest

from engine.kv_cache import BlockPool, FreeBlockQueue, KVCacheBlock, KVCacheManager
from engine.kv_cache.hashing import hash_block
from engine.request import Request
from engine.sampling_params import SamplingParams

B = 4  # block size used throughout


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), cache_salt=salt)


def free_order(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.pool.free_queue]


def admit(manager: KVCacheManager, request: Request) -> list[int]:
    """Schedule the whole prompt of a waiting request, as the scheduler would."""
    hits, num_hit = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit, hits)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    return manager.block_ids(request.request_id)


def test_lookahead_slots_are_held_and_never_cached() -> None:
    """A draft model's lookahead slots (speculative decoding) take blocks past the
    scheduled tokens; only the scheduled tokens' full blocks are registered."""
    manager = KVCacheManager(num_blocks=10, block_size=B)
    request = make_request("a", list(range(8)))  # two full blocks
    hits, _ = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, 8, hits, num_lookahead_tokens=3) is not None
    assert manager.block_ids("a") == [0, 1, 2]  # 8 tokens and 3 slots after them
    assert len(manager.pool.cached) == 2
    request.num_computed_tokens = 8
    request.append_output_token(50)
    # The next step's token fits; 4 lookahead slots more need a fourth block.
    assert manager.allocate_slots(request, 1, None, 3) == []
    new = manager.allocate_slots(request, 1, None, 4)
    assert new is not None and [b.block_id for b in new] == [3]
    assert len(manager.pool.cached) == 2
    manager.free(request)
    manager.check_invariants()


def test_free_queue_is_fifo_with_o1_remove() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert queue.popleft().block_id == 0
    queue.append(blocks[2])
    queue.append(blocks[0])
    assert [b.block_id for b in queue] == [1, 3, 4, 2, 0]
    assert queue.num_free_blocks == 5
    with pytest.raises(ValueError):
        queue.append(blocks[0])
    popped = queue.popleft()
    with pytest.raises(ValueError):
        queue.remove(popped)


def test_allocation_and_tail_first_free_order() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=B)
    a = make_request("a", list(range(10)))  # 3 blocks: 2 full + 2 tokens
    b = make_request("b", list(range(100, 105)))  # 2 blocks
    assert admit(manager, a) == [0, 1, 2]
    assert admit(manager, b) == [3, 4]
    assert free_order(manager) == [5, 6, 7, 8, 9]
    manager.free(a)
    # Tail first: a's last block is evicted first, its first block last.
    assert free_order(manager) == [5, 6, 7, 8, 9, 2, 1, 0]
    manager.free(b)
    assert free_order(manager) == [5, 6, 7, 8, 9, 2, 1, 0, 4, 3]
    assert manager.usage() == 0.0
    manager.check_invariants()


def test_prefix_hit_reuses_blocks_and_counts_tokens() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=B)
    prefix = list(range(12))  # 3 full blocks
    a = make_request("a", [*prefix, 50, 51])
    assert admit(manager, a) == [0, 1, 2, 3]
    b = make_request("b", [*prefix, 60])
    hits, num_hit = manager.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1, 2]
    assert num_hit == 12
    assert manager.allocate_slots(b, 1, hits) is not None
    assert manager.block_ids("b") == [0, 1, 2, 4]
    assert [blk.ref_cnt for blk in manager.pool.blocks[:5]] == [2, 2, 2, 1, 1]
    assert manager.counters.queries == 14 + 13
    assert manager.counters.hits == 12
    manager.check_invariants()


def test_lazy_eviction_and_touch_from_free_queue() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=B)
    a = make_request("a", list(range(9)))  # blocks 0,1 full; 2 partial
    assert admit(manager, a) == [0, 1, 2]
    manager.free(a)
    assert free_order(manager) == [3, 4, 5, 2, 1, 0]
    # The freed full blocks keep their hashes until reused.
    assert len(manager.pool.cached) == 2
    b = make_request("b", [*range(8), 99])
    hits, num_hit = manager.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and num_hit == 8
    assert manager.allocate_slots(b, 1, hits) == [manager.pool.blocks[3]]
    # Touching removed 0 and 1 from the middle of the queue; 3 was popped from the front.
    assert free_order(manager) == [4, 5, 2]
    manager.check_invariants()


def test_popping_a_cached_block_evicts_its_hash() -> None:
    manager = KVCacheManager(num_blocks=3, block_size=B)
    a = make_request("a", [*range(8), 8])
    admit(manager, a)
    manager.free(a)
    assert free_order(manager) == [2, 1, 0]
    c = make_request("c", list(range(200, 209)))  # needs all 3 blocks
    assert admit(manager, c) == [2, 1, 0]
    again = make_request("again", [*range(8), 8])
    hits, _ = manager.get_computed_blocks(again)
    assert hits == []
    manager.check_invariants()


def test_cached_free_hits_do_not_count_as_free_space() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=B)
    a = make_request("a", list(range(9)))
    assert admit(manager, a) == [0, 1, 2]
    manager.free(a)  # 4 free blocks: 3, 2, 1, 0 (0 and 1 cached)
    b = make_request("b", [*range(8), *range(300, 309)])  # 2 hit blocks + 9 new tokens
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    # 9 new tokens need 3 new blocks; 4 are free but 2 of them are the hits themselves.
    assert manager.allocate_slots(b, 9, hits) is None
    assert free_order(manager) == [3, 2, 1, 0]
    assert manager.counters.queries == 9  # the failed admission was not counted
    # 5 new tokens need 2 new blocks: 2 plain free blocks remain beside the 2 hits.
    assert manager.allocate_slots(b, 5, hits) is not None
    assert manager.block_ids("b") == [0, 1, 3, 2]
    manager.check_invariants()


def test_full_hit_recomputes_last_token() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=B)
    prompt = list(range(8))  # exactly two blocks
    a = make_request("a", prompt)
    admit(manager, a)
    b = make_request("b", list(prompt))
    hits, num_hit = manager.get_computed_blocks(b)
    # Only the first block is reused: the last token's logits must be computed.
    assert [h.block_id for h in hits] == [0]
    assert num_hit == 4
    c = make_request("c", [*prompt, 77])
    hits, num_hit = manager.get_computed_blocks(c)
    assert num_hit == 8


def test_cache_salt_isolates_tenants() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=B)
    prompt = list(range(9))
    admit(manager, make_request("a", prompt, salt="tenant-1"))
    _, other_tenant = manager.get_computed_blocks(make_request("b", prompt, salt="tenant-2"))
    _, no_salt = manager.get_computed_blocks(make_request("c", prompt))
    _, same_tenant = manager.get_computed_blocks(make_request("d", prompt, salt="tenant-1"))
    assert (other_tenant, no_salt, same_tenant) == (0, 0, 8)


def test_blocks_are_cached_when_scheduled_not_when_computed() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=B)
    a = make_request("a", list(range(10)))
    assert manager.allocate_slots(a, 6, []) is not None  # chunk: tokens 0..5
    assert len(manager.pool.cached) == 1  # block 0 is full once the chunk runs
    b = make_request("b", list(range(10)))
    _, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 4


def test_hit_compares_token_ids_not_only_digest() -> None:
    pool = BlockPool(2)
    real = hash_block(None, [1, 2, 3, 4])
    pool.cache(pool.blocks[0], real)
    forged = type(real)(real.digest, (9, 9, 9, 9))
    assert pool.lookup(real) is pool.blocks[0]
    assert pool.lookup(forged) is None


def test_no_prefix_caching_never_hits() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=B, enable_caching=False)
    prompt = list(range(9))
    admit(manager, make_request("a", prompt))
    _, num_hit = manager.get_computed_blocks(make_request("b", prompt))
    assert num_hit == 0
    assert manager.pool.cached == {}


def test_check_invariants_catches_corruption() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=B)
    admit(manager, make_request("a", list(range(5))))
    manager.check_invariants()
    manager.pool.blocks[0].ref_cnt = 0  # in use, but claims to be free
    with pytest.raises(AssertionError):
        manager.check_invariants()

    manager = KVCacheManager(num_blocks=4, block_size=B)
    admit(manager, make_request("a", list(range(5))))
    manager.pool.blocks[3].ref_cnt = 1  # in the free queue with a reference
    with pytest.raises(AssertionError):
        manager.check_invariants()

    manager = KVCacheManager(num_blocks=4, block_size=B)
    admit(manager, make_request("a", list(range(5))))
    manager.pool.blocks[1].ref_cnt = 2  # more references than holders
    with pytest.raises(AssertionError):
        manager.check_invariants()


def test_double_free_is_refused() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(ValueError):
        pool.free(blocks)


def test_lookups_change_nothing_and_hashing_is_explicit() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=B)
    prompt = list(range(9))
    a = make_request("a", prompt)
    admit(manager, a)
    manager.free(a)
    cache = manager.prefix_cache
    b = make_request("b", list(prompt))
    before = (free_order(manager), [blk.ref_cnt for blk in manager.pool.blocks])
    assert cache.max_hit_blocks(b) == 0 and b.block_hashes == []  # not hashed: no lookup
    cache.update_hashes(b)
    assert len(b.block_hashes) == 2 and cache.max_hit_blocks(b) == 2
    hits = [cache.lookup(b, i, 0) for i in range(2)]
    assert [h.block_id for h in hits if h is not None] == [0, 1]
    assert cache.lookup(b, 0, 1) is None  # another group's prefix cache has none of them
    assert (free_order(manager), [blk.ref_cnt for blk in manager.pool.blocks]) == before
    assert len(b.block_hashes) == 2  # lookups left the request alone


def test_resumed_request_is_not_counted_again() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=B)
    a = make_request("a", list(range(9)))
    admit(manager, a)
    assert (manager.counters.queries, manager.counters.hits) == (9, 0)
    manager.free(a)  # preempted: the scheduler frees it and counts the preemption
    a.num_computed_tokens, a.num_preemptions = 0, 1
    hits, num_hit = manager.get_computed_blocks(a)
    assert num_hit == 8
    assert manager.allocate_slots(a, 1, hits) is not None
    assert (manager.counters.queries, manager.counters.hits) == (9, 0)


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_the_running_requests_fast_path_changes_nothing_the_general_path_would_not(
    caching: bool, seed: int
) -> None:
    """allocate_slots returns early for a running request whose next tokens fit its blocks
    and fill no block (_fits_as_is). Driven through random admissions with shared
    prefixes, chunked and one-token steps and frees, a manager with it and one without
    agree after every call: blocks, free queue order, cached hashes, registrations."""
    rng = random.Random(seed)
    managers = [KVCacheManager(48, B, caching), KVCacheManager(48, B, caching)]
    managers[1]._fits_as_is = lambda *args: False  # type: ignore[method-assign]
    prefix = [rng.randrange(50) for _ in range(9)]
    running: list[tuple[Request, Request]] = []
    fast_paths = 0
    for step in range(300):
        action = rng.random()
        if action < 0.15 and len(running) < 6:
            tokens = prefix[: rng.randrange(10)] + [
                rng.randrange(50) for _ in range(rng.randrange(1, 9))
            ]
            pair = tuple(make_request(f"r{step}", tokens) for _ in managers)
            news = []
            for manager, request in zip(managers, pair, strict=True):
                hits, num_hit = manager.get_computed_blocks(request)
                new = manager.allocate_slots(request, request.num_tokens - num_hit, hits)
                news.append(None if new is None else [b.block_id for b in new])
                if new is not None:
                    request.num_computed_tokens = request.num_tokens
            assert news[0] == news[1]
            if news[0] is not None:
                running.append(pair)  # type: ignore[arg-type]
        elif action < 0.25 and running:
            for manager, request in zip(
                managers, running.pop(rng.randrange(len(running))), strict=True
            ):
                manager.free(request)
        elif running:
            pair = running[rng.randrange(len(running))]
            tokens = [rng.randrange(50) for _ in range(rng.choice([1, 1, 1, 2, 6]))]
            news = []
            for manager, request in zip(managers, pair, strict=True):
                for token in tokens:
                    request.append_output_token(token)
                fast_paths += manager is managers[0] and manager._fits_as_is(request, len(tokens))
                new = manager.allocate_slots(request, len(tokens))
                news.append(None if new is None else [b.block_id for b in new])
                if new is not None:
                    request.num_computed_tokens += len(tokens)
            assert news[0] == news[1]
        fast, general = managers
        for a, b in running:
            assert fast.block_ids(a.request_id) == general.block_ids(b.request_id)
        assert free_order(fast) == free_order(general)
        assert fast.pool.cached.keys() == general.pool.cached.keys()
        assert fast._num_registered == general._num_registered
        fast.check_invariants()
    assert fast_paths > 50  # the fast path was taken, and often
