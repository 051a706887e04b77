"""Views of the engine (block states, eviction order, requests, deltas, cadence), checked
against the scheduler and block pool they are read from. Pure Python: a fake model step."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

from engine.introspection import BlockState, EngineDelta, EngineMonitor, EngineSnapshot
from engine.introspection.capture import block_states, core_state, eviction_order, request_views
from engine.kv_cache import BlockPool
from engine.outputs import FinishedRequestStats, IterationStats
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerStats
from tests.engine.scheduler.test_scheduler import fake_step, make_request, make_scheduler

PREFIX = list(range(100, 108))  # two full blocks of 4 tokens


def shared_prefix_request(rid: str, tail: list[int], max_tokens: int = 3) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    return Request(rid, PREFIX + tail, params, eos_token_ids=(0,))


def step(sched: Scheduler) -> SchedulerStats:
    return fake_step(sched, sched.schedule()).stats


def test_views_name_every_block_state_and_the_eviction_order() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=64)
    sched.add_request(shared_prefix_request("a", [1, 2, 3]))
    sched.add_request(shared_prefix_request("b", [4, 5, 6]))
    step(sched)
    pool = sched.kv_cache.pool
    # a holds 0 1 2, b reuses a's prefix blocks 0 1 in the same step and adds 3.
    assert block_states(pool) == "4433" + "0" * 12
    assert eviction_order(pool) == ()
    a, b = request_views(sched)
    assert (a.request_id, a.status, a.block_ids) == ("a", "running", (0, 1, 2))
    assert a.num_cached_tokens == 0
    assert (b.block_ids, b.num_cached_tokens, b.num_computed_tokens) == ((0, 1, 3), 8, 11)
    assert (b.num_prompt_tokens, b.num_output_tokens) == (11, 1)

    while sched.has_unfinished_requests():
        step(sched)
    # 14 tokens each: blocks 2 and 3 filled up and were cached, 4 and 5 stayed partial.
    assert block_states(pool) == "222211" + "0" * 10
    # Freed tail first: a queues 4 2 and drops its references on 1 0; b then queues 5 3 1 0.
    assert [blk.block_id for blk in pool.free_queue][10:] == [4, 2, 5, 3, 1, 0]
    assert eviction_order(pool) == ((2, 11), (3, 13), (1, 14), (0, 15))
    assert request_views(sched) == ()


def test_an_uncached_pool_has_no_cached_blocks() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4, enable_caching=False)
    sched.add_request(shared_prefix_request("a", [1]))
    while sched.has_unfinished_requests():
        step(sched)
    assert block_states(sched.kv_cache.pool) == "111" + "0" * 13
    assert eviction_order(sched.kv_cache.pool) == ()


def reference_states(pool: BlockPool, ever_used: set[int]) -> str:
    """The same states, computed the slow and obvious way."""
    codes = []
    for block in pool.blocks:
        if block.ref_cnt > 1:
            codes.append(BlockState.SHARED)
        elif block.ref_cnt == 1:
            codes.append(BlockState.IN_USE)
        elif block.block_hash is not None:
            codes.append(BlockState.CACHED)
        elif block.block_id in ever_used:
            codes.append(BlockState.FREE)
        else:
            codes.append(BlockState.NEVER_USED)
    return "".join(code.value for code in codes)


def test_views_match_the_pool_through_a_random_soak_with_preemption() -> None:
    rng = random.Random(7)
    sched = make_scheduler(num_blocks=24, block_size=4, max_num_seqs=6, max_model_len=48)
    ever_used: set[int] = set()
    prefixes = [[rng.randrange(3, 90) for _ in range(8)] for _ in range(3)]
    for i in range(300):
        if rng.random() < 0.4:
            tail = [rng.randrange(3, 90) for _ in range(rng.randrange(1, 12))]
            request = Request(
                f"r{i}",
                rng.choice(prefixes) + tail,
                SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=True),
            )
            sched.add_request(request)
        if not sched.has_unfinished_requests():
            continue
        output = sched.schedule()
        for blocks in sched.kv_cache.req_to_blocks.values():
            ever_used.update(b.block_id for b in blocks)
        fake_step(sched, output)
        pool = sched.kv_cache.pool
        assert block_states(pool) == reference_states(pool, ever_used)
        queue = list(pool.free_queue)
        expected = tuple((b.block_id, i) for i, b in enumerate(queue) if b.block_hash is not None)
        assert eviction_order(pool) == expected
        sched.kv_cache.check_invariants()
    assert sched.total_preemptions > 0, "the soak should exercise preemption"
    assert len(ever_used) == sched.kv_cache.pool.num_ever_used


def apply(state: EngineSnapshot, change: EngineDelta) -> EngineSnapshot:
    """A delta applied as the page applies it."""
    assert change.seq == state.seq + 1
    states = list(state.states)
    for start, codes in change.blocks:
        states[start : start + len(codes)] = codes
    order = state.eviction_order if change.eviction_order is None else change.eviction_order
    return replace(
        state,
        seq=change.seq,
        time=change.time,
        states="".join(states),
        eviction_order=order,
        requests=change.requests,
        finished=state.finished + change.finished,
        counts=change.counts,
        gauges=change.gauges,
        totals=change.totals,
        rates=change.rates,
    )


def finished_stats(request_id: str) -> IterationStats:
    stats = FinishedRequestStats(request_id, "length", 11, 8, 3, 0.25, 0.1, True)
    return IterationStats(finished=[stats])


class Watched:
    """A scheduler run by the fake model step, its steps counted, and a monitor over it."""

    def __init__(self, **scheduler_args: int) -> None:
        self.sched = make_scheduler(**scheduler_args)
        self.steps = 0
        self.monitor = EngineMonitor(
            lambda: core_state(self.sched, self.steps), True, min_interval=0.0
        )

    def step(self, iteration: IterationStats | None = None) -> SchedulerStats:
        stats = step(self.sched)
        self.steps += 1
        self.monitor.observe(stats, iteration or IterationStats())
        return stats


def test_a_snapshot_then_deltas_rebuild_every_view() -> None:
    async def run() -> None:
        engine = Watched(num_blocks=32, block_size=4, max_num_batched_tokens=16)
        sched, watcher = engine.sched, engine.monitor.subscribe()
        for i in range(6):
            sched.add_request(shared_prefix_request(f"r{i}", [1 + i, 2, 3], max_tokens=6))
        state = None
        while sched.has_unfinished_requests():
            engine.step()
            engine.monitor.capture()
            view = await watcher.get(timeout=1)
            if state is None:
                assert isinstance(view, EngineSnapshot)
                state = view
            else:
                assert isinstance(view, EngineDelta)
                state = apply(state, view)
            pool = sched.kv_cache.pool
            assert state.states == block_states(pool)
            assert state.eviction_order == eviction_order(pool)
            assert state.requests == request_views(sched)
            assert state.counts.shared == block_states(pool).count("4")
            assert state.gauges.kv_cache_usage == pool.usage()
        assert state is not None and state.counts.in_use == state.counts.shared == 0
        assert state.counts.cached > 0 and state.totals.prefix_cache_hits > 0

    asyncio.run(run())


def test_a_watcher_that_falls_behind_gets_a_whole_snapshot() -> None:
    async def run() -> None:
        sched = make_scheduler()
        monitor = EngineMonitor(lambda: core_state(sched, 0), True, min_interval=0.0)
        keeping_up, behind = monitor.subscribe(), monitor.subscribe()
        monitor.capture()
        assert isinstance(await keeping_up.get(1), EngineSnapshot)
        assert isinstance(await behind.get(1), EngineSnapshot)
        sched.add_request(make_request("a", 6))
        step(sched)
        monitor.capture()
        assert isinstance(await keeping_up.get(1), EngineDelta)
        monitor.capture()  # `behind` never took the delta before this one
        assert isinstance(await keeping_up.get(1), EngineDelta)
        caught_up = await behind.get(1)
        assert isinstance(caught_up, EngineSnapshot) and caught_up.seq == 2
        assert caught_up.states == block_states(sched.kv_cache.pool)

    asyncio.run(run())


def test_rates_cover_the_interval_since_the_previous_view() -> None:
    async def run() -> None:
        engine = Watched(num_blocks=32, block_size=4, max_num_batched_tokens=16)
        sched, watcher = engine.sched, engine.monitor.subscribe()
        engine.monitor.capture()
        first = await watcher.get(1)
        assert first is not None and first.rates is None
        for i in range(3):
            sched.add_request(shared_prefix_request(f"r{i}", [1 + i], max_tokens=2))
        tokens = sum(
            engine.step(finished_stats(f"done{i}")).num_scheduled_tokens for i in (1, 2, 3)
        )
        engine.monitor.capture()
        view = await watcher.get(1)
        assert isinstance(view, EngineDelta) and view.rates is not None
        assert view.rates.tokens_per_step == tokens / 3
        counters = sched.kv_cache.counters
        assert view.rates.prefix_cache_hit_rate == counters.hits / counters.queries
        assert view.rates.steps_per_s == 3 / view.rates.interval
        assert [f.request_id for f in view.finished] == ["done1", "done2", "done3"]
        assert view.finished[0].ttft == 0.1 and view.finished[0].num_cached_tokens == 8

    asyncio.run(run())


def test_nothing_is_kept_while_nobody_watches() -> None:
    async def run() -> None:
        engine = Watched()
        monitor = engine.monitor
        engine.sched.add_request(make_request("a", 6))
        engine.step(finished_stats("unseen"))
        monitor.capture_if_due()  # no watcher: takes nothing
        watcher = monitor.subscribe()
        monitor.capture_if_due()
        view = await watcher.get(1)
        assert isinstance(view, EngineSnapshot) and view.seq == 0
        assert view.finished == () and view.rates is None

    asyncio.run(run())


def test_a_slow_view_spaces_out_the_next_ones() -> None:
    """Views never take more than `max_share` of the loop's time: a view that took t
    seconds makes the next wait t / max_share (here: forever)."""

    async def run() -> None:
        sched = make_scheduler()
        monitor = EngineMonitor(lambda: core_state(sched, 0), True, 0.0, max_share=1e-12)
        watcher = monitor.subscribe()
        monitor.capture_if_due()
        assert await watcher.get(1) is not None
        monitor.capture_if_due()
        assert await watcher.get(0.05) is None

    asyncio.run(run())
