"""Chunked prefill's limits, step by step: --long-prefill-token-threshold caps each prefill
chunk, --max-num-partial-prefills and --max-long-partial-prefills bound the prompts
part-way through prefill, and running decodes take the budget before any prefill."""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine.config import (
    EngineArgs,
    SchedulerConfig,
    check_scheduling_options,
    resolve_prefill_chunks,
)
from engine.kv_cache import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput, step_cost
from tests.engine.scheduler.test_scheduler import (
    EOS,
    check_step_invariants,
    fake_step,
    make_request,
    run_to_completion,
)


def make_scheduler(
    budget: int,
    threshold: int = 0,
    max_partial: int = 1,
    max_long: int = 1,
    num_blocks: int = 64,
    max_model_len: int = 64,
    beside_decodes: int = 0,
    beside_ratio: float = 0.0,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        max_num_partial_prefills=max_partial,
        max_long_partial_prefills=max_long,
        long_prefill_token_threshold=threshold,
        prefill_chunk_beside_decodes=beside_decodes,
        prefill_time_beside_decodes=beside_ratio,
    )
    return Scheduler(config, KVCacheManager(num_blocks, 4, True))


def tokens(output: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request_id, s.num_new_tokens) for s in output.scheduled]


def step(sched: Scheduler) -> list[tuple[str, int]]:
    output = sched.schedule()
    check_step_invariants(sched, output)
    fake_step(sched, output)
    return tokens(output)


def test_threshold_caps_every_chunk_of_a_long_prompt() -> None:
    sched = make_scheduler(budget=32, threshold=8)
    sched.add_request(make_request("long", 30, max_tokens=2))
    chunks = [o.scheduled[0].num_new_tokens for o in run_to_completion(sched)]
    # Without the threshold: [30, 1].
    assert chunks == [8, 8, 8, 6, 1]


def test_one_partial_prefill_at_a_time_and_short_prompts_pass_it() -> None:
    sched = make_scheduler(budget=32, threshold=8)
    sched.add_request(make_request("a", 20, base=100, max_tokens=3))
    sched.add_request(make_request("b", 20, base=200, max_tokens=3))
    sched.add_request(make_request("c", 3, base=300, max_tokens=3))
    # b would be left part-way and a holds the only slot: b waits, in first place; c
    # finishes its prompt in the step, so it needs no slot and goes past b.
    assert step(sched) == [("a", 8), ("c", 3)]
    assert [r.request_id for r in sched.waiting] == ["b"]
    assert step(sched) == [("c", 1), ("a", 8)]
    # a's last chunk finishes its prompt, which frees the slot for b in the same step.
    assert step(sched) == [("c", 1), ("a", 4), ("b", 8)]
    assert step(sched) == [("a", 1), ("b", 8)]
    assert step(sched) == [("a", 1), ("b", 4)]


def test_a_prompt_cut_by_the_budget_needs_a_slot_too() -> None:
    sched = make_scheduler(budget=12, threshold=8)
    sched.add_request(make_request("a", 30, base=100))
    sched.add_request(make_request("c", 7, base=200))
    sched.add_request(make_request("d", 3, base=300))
    # c is not long, but 4 of its 7 tokens would leave it part-way, and a holds the slot.
    assert step(sched) == [("a", 8), ("d", 3)]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_long_slots_let_a_shorter_prompt_go_first() -> None:
    # Two partial slots, one of them for long prompts (more than 8 tokens left).
    sched = make_scheduler(budget=14, threshold=8, max_partial=2, max_long=1)
    sched.add_request(make_request("a", 30, base=100))
    sched.add_request(make_request("b", 30, base=200))
    sched.add_request(make_request("c", 7, base=300))
    # a takes the long slot; b, long too, waits; c (7 tokens, not long) is cut by the
    # budget and takes the other slot.
    assert step(sched) == [("a", 8), ("c", 6)]
    assert [r.request_id for r in sched.waiting] == ["b"]
    # c's last prompt token goes with the decodes; b still finds the long slot taken.
    assert step(sched) == [("c", 1), ("a", 8)]
    assert [r.request_id for r in sched.waiting] == ["b"]


def test_several_long_prefills_share_the_budget() -> None:
    sched = make_scheduler(budget=20, threshold=8, max_partial=2, max_long=2)
    for rid, base in (("a", 100), ("b", 200), ("c", 300)):
        sched.add_request(make_request(rid, 30, base=base))
    assert step(sched) == [("a", 8), ("b", 8)]
    assert step(sched) == [("a", 8), ("b", 8)]


def test_decodes_take_the_budget_before_a_prefill_ahead_of_them() -> None:
    sched = make_scheduler(budget=10, threshold=8)
    sched.add_request(make_request("a", 40, base=100))
    sched.add_request(make_request("c", 2, base=200))
    assert step(sched) == [("a", 8), ("c", 2)]
    # c now decodes behind a in running order, with 3 drafts (speculative decoding) to
    # verify: taken in running order, a's chunk would leave c 2 of its 4 tokens.
    assert [r.request_id for r in sched.running] == ["a", "c"]
    sched.requests["c"].spec_token_ids = [5, 5, 5]
    output = sched.schedule()
    assert tokens(output) == [("c", 4), ("a", 6)]
    assert output.scheduled[0].spec_token_ids == (5, 5, 5)


def test_the_cap_beside_decodes_leaves_a_step_of_prompts_alone_its_budget() -> None:
    sched = make_scheduler(budget=16, beside_decodes=4)
    sched.add_request(make_request("a", 20, base=100, max_tokens=4))
    # No decode yet: a's chunks take the whole budget.
    assert step(sched) == [("a", 16)]
    assert step(sched) == [("a", 4)]
    sched.add_request(make_request("b", 11, base=200, max_tokens=2))
    # a decodes now, so b's chunks are capped at 4, the last one finishing its prompt.
    assert step(sched) == [("a", 1), ("b", 4)]
    assert step(sched) == [("a", 1), ("b", 4)]
    assert step(sched) == [("a", 1), ("b", 3)]
    # a finished: b decodes, and c's first chunk is capped beside it; c then prefills
    # alone, with the whole budget, once b has finished.
    sched.add_request(make_request("c", 30, base=300, max_tokens=1))
    assert step(sched) == [("b", 1), ("c", 4)]
    assert step(sched) == [("c", 16)]
    assert step(sched) == [("c", 10)]


def test_prompts_beside_decodes_share_one_cap() -> None:
    sched = make_scheduler(budget=32, beside_decodes=6)
    sched.add_request(make_request("a", 4, base=100, max_tokens=8))
    assert step(sched) == [("a", 4)]
    for rid, base in (("b", 200), ("c", 300), ("d", 400)):
        sched.add_request(make_request(rid, 3, base=base, max_tokens=2))
    # Beside a's decode, b's and c's prompts take the 6 tokens; none are left for d, which
    # waits, first in line.
    assert step(sched) == [("a", 1), ("b", 3), ("c", 3)]
    assert [r.request_id for r in sched.waiting] == ["d"]
    assert step(sched) == [("a", 1), ("b", 1), ("c", 1), ("d", 3)]


def test_the_cap_in_time_follows_the_steps_times() -> None:
    """Before the steps' times are known, the cap in tokens; after, as many tokens as take
    as long as a step of the decodes alone (--prefill-time-beside-decodes 1): with 2 ms a
    step, 8 ms a decode and 0.25 ms a prompt token, 40 beside one decode, 72 beside two."""
    sched = make_scheduler(budget=128, beside_decodes=4, beside_ratio=1.0, max_model_len=256)
    sched.add_request(make_request("a", 2, base=100, max_tokens=200))

    def timed_step() -> list[tuple[str, int]]:
        decoding = {
            r.request_id for r in sched.running if r.num_tokens - r.num_computed_tokens == 1
        }
        output = sched.schedule()
        fake_step(sched, output)
        decodes = sum(1 for s in output.scheduled if s.request_id in decoding)
        prompt_tokens = sum(s.num_new_tokens for s in output.scheduled) - decodes
        sched.observe_step_time((2 + 8 * decodes + prompt_tokens / 4) / 1e3)
        return tokens(output)

    assert timed_step() == [("a", 2)]  # a prompt alone: the cap beside decodes has no say
    for _ in range(3):
        assert timed_step() == [("a", 1)]
    sched.add_request(make_request("b", 100, base=200, max_tokens=50))
    # The steps of prompt tokens seen are too few yet: 4 tokens a step.
    assert [timed_step() for _ in range(2)] == [[("a", 1), ("b", 4)]] * 2
    assert sched.prefill_tokens_beside_decodes() in (39, 40)
    assert timed_step()[1][1] in (39, 40)
    b = sched.requests["b"]
    while b.num_computed_tokens < b.num_prompt_tokens:
        timed_step()
    # b decodes beside a now, and c's prompt arrives: a step of two decodes takes 18 ms.
    sched.add_request(make_request("c", 100, base=300, max_tokens=1))
    cap = sched.prefill_tokens_beside_decodes()
    assert cap in (71, 72)
    assert timed_step() == [("a", 1), ("b", 1), ("c", cap)]
    # Were prompt tokens to cost 200 ms, each step would still move 32 (step_cost.MIN_TOKENS).
    for prompt_tokens in [0, 4, 10] * 100:
        sched.step_cost.observe(2, prompt_tokens, (18 + 200 * prompt_tokens) / 1e3)
    assert sched.prefill_tokens_beside_decodes() == 32


def check_limits(sched: Scheduler, output: SchedulerOutput, decodes: set[str], beside: int) -> None:
    """The limits of one step, checked after it was scheduled and before it ran (`beside`:
    its cap on prompt tokens beside decodes, as it was before it was scheduled)."""
    config = sched.config
    threshold = config.long_prefill_token_threshold
    decoding = any(entry.request_id in decodes for entry in output.scheduled)
    prompt_tokens = 0
    for entry in output.scheduled:
        if entry.request_id not in decodes:
            prompt_tokens += entry.num_new_tokens
            if threshold:
                assert entry.num_new_tokens <= threshold
    if decoding and beside:
        assert prompt_tokens <= beside
    # Every decode got its token: decodes alone never exceed these budgets.
    still_running = {r.request_id for r in sched.running}
    assert decodes & still_running <= {s.request_id for s in output.scheduled}
    left = [r.num_tokens - r.num_computed_tokens for r in sched.running]
    partial = [n for n in left if n > 0]
    assert len(partial) <= config.max_num_partial_prefills, left
    if threshold:
        long = [n for n in partial if n > threshold]
        assert len(long) <= config.max_long_partial_prefills, left


@pytest.mark.parametrize(
    ("threshold", "max_partial", "max_long", "beside", "beside_ratio", "seed"),
    [
        (0, 1, 1, 0, 0.0, 0),
        (8, 1, 1, 0, 0.0, 1),
        (6, 3, 1, 0, 0.0, 2),
        (5, 2, 2, 0, 0.0, 3),
        (0, 2, 1, 0, 0.0, 4),
        (0, 1, 1, 4, 0.0, 5),
        (10, 2, 1, 3, 0.0, 6),
        (0, 2, 1, 12, 1.5, 7),  # the least cap in time (step_cost.MIN_TOKENS) made 2
    ],
)
def test_randomized_soak_within_limits(
    threshold: int,
    max_partial: int,
    max_long: int,
    beside: int,
    beside_ratio: float,
    seed: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Random arrivals, aborts and preemptions: each step holds every limit, and no
    running decode misses a step. Each step is timed at 2 ms, 1 ms a decode and 0.5 ms a
    prompt token, give or take 20%, for the cap in time where it is on."""
    rng = random.Random(seed)
    monkeypatch.setattr(step_cost, "MIN_TOKENS", 2)
    sched = make_scheduler(
        budget=24,
        threshold=threshold,
        max_partial=max_partial,
        max_long=max_long,
        num_blocks=16,
        max_model_len=52,
        beside_decodes=beside,
        beside_ratio=beside_ratio,
    )
    next_id = finished = preemptions = 0
    caps = set()
    for _ in range(1200):
        if rng.random() < 0.3:
            prompt = [rng.randrange(1, 50) for _ in range(rng.choice([2, 5, 12, 30, 40]))]
            params = SamplingParams(max_tokens=rng.randrange(1, 8), ignore_eos=True)
            sched.add_request(Request(f"r{next_id}", prompt, params, eos_token_ids=(EOS,)))
            next_id += 1
        if sched.requests and rng.random() < 0.03:
            sched.finish_requests([rng.choice(list(sched.requests))])
        decodes = {r.request_id for r in sched.running if r.num_tokens - r.num_computed_tokens == 1}
        cap = sched.prefill_tokens_beside_decodes()
        caps.add(cap)
        output = sched.schedule()
        check_step_invariants(sched, output)
        check_limits(sched, output, decodes, cap)
        prompt_tokens = sum(
            s.num_new_tokens for s in output.scheduled if s.request_id not in decodes
        )
        ms = 2 + len(decodes & {s.request_id for s in output.scheduled}) + prompt_tokens / 2
        sched.observe_step_time(ms * rng.uniform(0.8, 1.2) / 1e3)
        result = fake_step(sched, output, lambda r: rng.randrange(0, 50))
        preemptions += result.stats.num_preemptions
        finished += sum(1 for o in result.outputs if o.finished)
    run_to_completion(sched, max_steps=5000)
    assert finished > 50
    assert preemptions > 0, "the soak should exercise preemption"
    if beside_ratio:  # the cap in tokens at first, then in time
        assert beside in caps and len(caps) > 3, caps
    assert sched.kv_cache.pool.num_free_blocks == sched.kv_cache.pool.num_blocks


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"max_num_partial_prefills": 0}, "--max-num-partial-prefills must be at least 1"),
        ({"max_long_partial_prefills": 0}, "--max-long-partial-prefills must be between 1"),
        (
            {"max_num_partial_prefills": 2, "max_long_partial_prefills": 3},
            r"between 1 and --max-num-partial-prefills \(2\), got 3",
        ),
        ({"long_prefill_token_threshold": -1}, "must be 0 \\(off\\) or positive"),
        (
            {"long_prefill_token_threshold": 600, "max_model_len": 512},
            r"\(600\) cannot be greater than max_model_len \(512\)",
        ),
        ({"prefill_time_beside_decodes": -5.0}, "must be 0 \\(off\\) or positive, got -5.0"),
        ({"prefill_time_beside_decodes": float("nan")}, "must be 0 \\(off\\) or positive"),
        (
            {"prefill_time_beside_decodes": 2.0, "async_scheduling": True},
            "does not run with --async-scheduling",
        ),
    ],
)
def test_flag_validation(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_scheduling_options(EngineArgs(**values))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("values", "device", "task", "overlap", "chunks"),
    [
        ({}, "cpu", "generate", False, (0, 64, 1.0)),
        ({"long_prefill_token_threshold": 0}, "cpu", "generate", False, (0, 0, 0.0)),
        ({"long_prefill_token_threshold": 32}, "cpu", "generate", False, (32, 0, 0.0)),
        ({"max_num_partial_prefills": 2}, "cpu", "generate", False, (327, 64, 1.0)),
        ({"prefill_time_beside_decodes": 0.0}, "cpu", "generate", False, (0, 64, 0.0)),
        ({"prefill_time_beside_decodes": 3.5}, "cpu", "generate", False, (0, 64, 3.5)),
        (
            {"long_prefill_token_threshold": 32, "prefill_time_beside_decodes": 3.5},
            "cpu",
            "generate",
            False,
            (32, 0, 3.5),
        ),
        ({}, "cpu", "generate", True, (0, 64, 0.0)),  # --async-scheduling: steps overlap
        ({}, "cpu", "embed", False, (0, 0, 0.0)),
        ({}, "cuda", "generate", True, (0, 0, 0.0)),
        ({"max_num_partial_prefills": 2}, "cuda", "generate", True, (327, 0, 0.0)),  # vLLM's 4%
        ({"long_prefill_token_threshold": 100}, "cuda", "generate", True, (100, 0, 0.0)),
    ],
)
def test_default_chunks(
    values: dict[str, Any],
    device: str,
    task: str,
    overlap: bool,
    chunks: tuple[int, int, float],
) -> None:
    """(threshold, cap beside decodes in tokens, and in time): a threshold given replaces
    both caps, but the one in time where it is given too."""
    args = EngineArgs(**values)  # type: ignore[arg-type]
    assert resolve_prefill_chunks(args, 8192, device, task, overlap) == chunks


def test_config_refuses_a_threshold_above_max_model_len() -> None:
    with pytest.raises(ValueError, match=r"\(65\) cannot be greater than max_model_len \(64\)"):
        make_scheduler(budget=16, threshold=65)
    assert make_scheduler(budget=16, threshold=64).config.long_prefill_token_threshold == 64


def test_the_startup_line_names_limits_set() -> None:
    assert SchedulerConfig().describe_prefill_limits() == ""
    beside = SchedulerConfig(prefill_chunk_beside_decodes=64)
    assert beside.describe_prefill_limits() == ", at most 64 prompt tokens beside decodes"
    timed = SchedulerConfig(prefill_chunk_beside_decodes=64, prefill_time_beside_decodes=2.0)
    assert timed.describe_prefill_limits() == (
        ", prompt tokens of 2x the decodes' time at most beside decodes (until timed, 64)"
    )
    limits = SchedulerConfig(
        long_prefill_token_threshold=64, max_num_partial_prefills=3, max_long_partial_prefills=2
    )
    assert limits.describe_prefill_limits() == (
        ", prefill chunks of at most 64 tokens, 3 partial prefills at once (2 long)"
    )
