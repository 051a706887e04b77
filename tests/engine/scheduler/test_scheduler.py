"""V1 scheduler with a fake model step: budgets, chunking, preemption, stops, a soak."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from engine.config import SchedulerConfig
from engine.errors import RequestValidationError
from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput, StepResult
from engine.utils import cdiv

EOS = 0


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 64,
    enable_caching: bool = True,
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_caching))


def make_request(rid: str, length: int, base: int = 100, **params: object) -> Request:
    params.setdefault("max_tokens", 4)
    prompt = [base + i for i in range(length)]
    return Request(rid, prompt, SamplingParams(**params), eos_token_ids=(EOS,))  # type: ignore[arg-type]


def fake_step(
    sched: Scheduler,
    output: SchedulerOutput,
    sample: Callable[[Request], int] = lambda r: 7,
) -> StepResult:
    """Samples for each request that reaches the end of its known tokens."""
    sampled = {}
    for entry in output.scheduled:
        request = sched.requests[entry.request_id]
        if entry.num_computed_tokens + entry.num_new_tokens == request.num_tokens:
            sampled[entry.request_id] = sample(request)
    return sched.update_from_output(output, ModelRunnerOutput(sampled))


def check_step_invariants(sched: Scheduler, output: SchedulerOutput) -> None:
    assert output.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    assert len(sched.running) <= sched.config.max_num_seqs
    block_size = sched.kv_cache.block_size
    for entry in output.scheduled:
        held = len(sched.kv_cache.block_ids(entry.request_id))
        needed = cdiv(entry.num_computed_tokens + entry.num_new_tokens, block_size)
        assert held >= needed, f"{entry.request_id} holds {held} blocks, needs {needed}"
    sched.kv_cache.check_invariants()


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    outputs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outputs
        output = sched.schedule()
        check_step_invariants(sched, output)
        fake_step(sched, output)
        outputs.append(output)
    raise AssertionError("did not finish")


def test_long_prompt_is_chunked_within_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("long", 40))
    steps = run_to_completion(sched)
    tokens = [o.scheduled[0].num_new_tokens for o in steps]
    # 40 prompt tokens in chunks of 16, then 3 decode steps for max_tokens=4.
    assert tokens == [16, 16, 8, 1, 1, 1]
    assert [o.scheduled[0].num_computed_tokens for o in steps[:3]] == [0, 16, 32]


def test_running_go_first_then_fcfs_admission_under_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    for rid, n, base in [("a", 6, 100), ("b", 6, 200), ("c", 3, 300)]:
        sched.add_request(make_request(rid, n, base=base))
    first = sched.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in first.scheduled] == [("a", 6), ("b", 4)]
    fake_step(sched, first)
    second = sched.schedule()
    # a decodes, b finishes its prompt, c is admitted with what is left of the budget.
    assert [(s.request_id, s.num_new_tokens) for s in second.scheduled] == [
        ("a", 1),
        ("b", 2),
        ("c", 3),
    ]
    assert second.scheduled[2].new_table and not second.scheduled[0].new_table


def test_max_num_seqs_caps_running() -> None:
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 3, base=10 * i))
    output = sched.schedule()
    assert [s.request_id for s in output.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in sched.waiting] == ["r2", "r3"]


def test_preemption_takes_the_tail_which_resumes_first_with_cache_hits() -> None:
    # 8 blocks of 4 tokens: two requests of 13 prompt tokens take 4 blocks each.
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=64, max_model_len=32)
    sched.add_request(make_request("a", 13, base=100, max_tokens=10))
    sched.add_request(make_request("b", 13, base=200, max_tokens=10))
    sched.add_request(make_request("c", 4, base=300, max_tokens=2))
    output = sched.schedule()
    assert [s.request_id for s in output.scheduled] == ["a", "b"]
    fake_step(sched, output)
    # Tokens 14..16 fit in each request's 4th block; the 17th token needs a 5th block.
    for _ in range(3):
        output = sched.schedule()
        check_step_invariants(sched, output)
        fake_step(sched, output)
    output = sched.schedule()
    check_step_invariants(sched, output)
    # a needed a new block, none was free: the tail (b) was preempted.
    assert [s.request_id for s in output.scheduled] == ["a"]
    assert "b" in output.finished_req_ids
    assert sched.requests["b"].status == RequestStatus.PREEMPTED
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    stats = fake_step(sched, output).stats
    assert stats.num_preemptions == 1

    counters = (sched.kv_cache.counters.queries, sched.kv_cache.counters.hits)
    resumed = None
    while resumed is None:
        output = sched.schedule()
        resumed = next((s for s in output.scheduled if s.resumed), None)
        if resumed is None:
            fake_step(sched, output)
    # b resumed before c and found its own full blocks still cached...
    assert resumed.request_id == "b" and resumed.num_computed_tokens > 0
    order = [s.request_id for s in output.scheduled]
    assert "c" not in order or order.index("b") < order.index("c")
    # ...which the prefix-cache counters do not count again: b was counted when admitted
    # (c, first admitted now if it fit, is: 4 tokens, no hit).
    c_tokens = 4 if "c" in order else 0
    after = (sched.kv_cache.counters.queries, sched.kv_cache.counters.hits)
    assert after == (counters[0] + c_tokens, counters[1])
    fake_step(sched, output)
    run_to_completion(sched)
    assert sched.kv_cache.usage() == 0.0


def test_resumed_request_comes_back_with_its_outputs() -> None:
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=64, max_model_len=32)
    sched.add_request(make_request("a", 13, base=100, max_tokens=10))
    sched.add_request(make_request("b", 13, base=200, max_tokens=10))
    resumed, outputs_at_resume = None, []
    for _ in range(30):
        output = sched.schedule()
        for entry in output.scheduled:
            if entry.resumed:
                resumed, outputs_at_resume = entry, list(entry.request.output_token_ids)
        fake_step(sched, output)
        if resumed:
            break
    assert resumed is not None and resumed.new_table
    assert resumed.request_id == "b"
    assert outputs_at_resume == [7, 7, 7, 7]
    # b's blocks were freed tail first, so while b waited, a's growth took its last two
    # blocks; the first two were still cached and are reused.
    assert resumed.num_computed_tokens == 8
    assert resumed.block_ids[:2] == [4, 5]
    assert resumed.block_ids == sched.kv_cache.block_ids("b")


def test_abort_mid_prefill_frees_blocks() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("a", 30))
    output = sched.schedule()
    fake_step(sched, output)
    assert sched.kv_cache.usage() > 0
    finished = sched.finish_requests(["a", "unknown"])
    assert [r.request_id for r in finished] == ["a"]
    assert finished[0].status.finish_reason == "abort"
    assert sched.kv_cache.usage() == 0.0
    assert not sched.has_unfinished_requests()
    assert "a" in sched.schedule().finished_req_ids
    sched.kv_cache.check_invariants()


def test_abort_waiting_request() -> None:
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", 3))
    sched.add_request(make_request("b", 3))
    sched.schedule()
    sched.finish_requests(["b"])
    assert list(sched.waiting) == []


def finish_of(sched: Scheduler, request: Request, tokens: list[int]) -> tuple[list[int], str]:
    sched.add_request(request)
    script = iter(tokens)
    out_tokens: list[int] = []
    for _ in range(100):
        output = sched.schedule()
        result = fake_step(sched, output, lambda r: next(script))
        for out in result.outputs:
            out_tokens += out.new_token_ids
            if out.finish_reason:
                return out_tokens, out.finish_reason
    raise AssertionError("no finish")


@pytest.mark.parametrize(
    ("params", "tokens", "expected", "reason"),
    [
        ({"max_tokens": 10}, [5, 6, EOS, 8], [5, 6, EOS], "stop"),
        ({"max_tokens": 3, "ignore_eos": True}, [EOS, EOS, EOS, EOS], [EOS, EOS, EOS], "length"),
        ({"max_tokens": 10, "stop_token_ids": [42]}, [5, 42, 6], [5, 42], "stop"),
        ({"max_tokens": 2}, [5, 6, 7], [5, 6], "length"),
        ({"max_tokens": 10, "min_tokens": 3}, [EOS, 5, EOS, EOS], [EOS, 5, EOS], "stop"),
        ({"max_tokens": None}, [5] * 100, [5] * 12, "length"),  # max_model_len=16, prompt 4
    ],
)
def test_stop_conditions(
    params: dict[str, object], tokens: list[int], expected: list[int], reason: str
) -> None:
    sched = make_scheduler(max_model_len=16)
    out, finish = finish_of(sched, make_request("r", 4, **params), tokens)
    assert (out, finish) == (expected, reason)
    assert sched.kv_cache.usage() == 0.0


def test_stop_token_sets_stop_reason() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("r", 4, max_tokens=10, stop_token_ids=[42]))
    for _ in range(5):
        result = fake_step(sched, sched.schedule(), lambda r: 42)
        if result.outputs:
            break
    assert result.outputs[0].stop_reason == 42


def test_prompt_too_long_and_duplicate_ids_are_refused() -> None:
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(RequestValidationError, match="max_model_len") as refused:
        sched.add_request(make_request("r", 16))
    assert refused.value.param == "prompt"
    sched.add_request(make_request("r", 4))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(make_request("r", 4))


def test_kv_cache_smaller_than_max_model_len_is_refused() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        make_scheduler(num_blocks=2, block_size=4, max_model_len=16)


def test_stats_report_queue_and_prefix_counters() -> None:
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", 9, base=0))
    sched.add_request(make_request("b", 9, base=0))
    result = fake_step(sched, sched.schedule())
    assert (result.stats.num_running, result.stats.num_waiting) == (1, 1)
    assert result.stats.prefix_cache_queries == 9 and result.stats.prefix_cache_hits == 0
    steps = [fake_step(sched, sched.schedule()) for _ in range(4)]
    assert sum(s.stats.prefix_cache_hits for s in steps) == 8
    assert steps[-1].outputs[0].num_cached_tokens == 8


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_soak(seed: int) -> None:
    rng = random.Random(seed)
    sched = make_scheduler(
        num_blocks=13,
        block_size=4,
        max_num_seqs=6,
        max_num_batched_tokens=rng.choice([8, 16, 32]),
        max_model_len=52,
    )
    shared = [rng.randrange(1, 50) for _ in range(16)]
    next_id = 0
    finished = 0
    preemptions = 0
    for _ in range(1500):
        if rng.random() < 0.3:
            length = rng.randrange(1, 30)
            prefix = shared[: rng.randrange(0, 16)] if rng.random() < 0.5 else []
            prompt = (prefix + [rng.randrange(1, 50) for _ in range(length)])[:40]
            params = SamplingParams(max_tokens=rng.randrange(1, 8), ignore_eos=rng.random() < 0.5)
            sched.add_request(Request(f"r{next_id}", prompt, params, eos_token_ids=(EOS,)))
            next_id += 1
        if sched.requests and rng.random() < 0.05:
            sched.finish_requests([rng.choice(list(sched.requests))])
        output = sched.schedule()
        check_step_invariants(sched, output)
        result = fake_step(sched, output, lambda r: rng.randrange(0, 50))
        preemptions += result.stats.num_preemptions
        finished += sum(1 for o in result.outputs if o.finished)
        sched.kv_cache.check_invariants()
    run_to_completion(sched, max_steps=5000)
    assert finished > 50
    assert preemptions > 0, "the soak should exercise preemption"
    pool = sched.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks
    sched.kv_cache.check_invariants()
