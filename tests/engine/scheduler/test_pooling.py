"""Prefill-only (embedding) requests in the V1 scheduler, with a fake model step: chunked
like any prompt, batched beside each other, ended by their embedding, and a full
prefix-cache hit still computes the last token."""

from __future__ import annotations

import pytest

from engine.errors import RequestValidationError
from engine.output_processor import EMBEDDING_PARAMS
from engine.pooling import PoolingParams
from engine.request import Request, RequestStatus
from engine.scheduler import ModelRunnerOutput, Scheduler, StepResult
from tests.engine.scheduler.test_scheduler import check_step_invariants, make_scheduler


def embedding_request(rid: str, length: int, base: int = 100) -> Request:
    prompt = [base + i for i in range(length)]
    return Request(rid, prompt, EMBEDDING_PARAMS, pooling_params=PoolingParams())


def pool_step(sched: Scheduler) -> tuple[StepResult, dict[str, int]]:
    """One step whose fake runner pools each request that reaches its prompt's end; also
    returns how many tokens each request was scheduled."""
    output = sched.schedule()
    check_step_invariants(sched, output)
    pooled, scheduled = {}, {}
    for entry in output.scheduled:
        scheduled[entry.request_id] = entry.num_new_tokens
        if entry.num_computed_tokens + entry.num_new_tokens == entry.request.num_tokens:
            pooled[entry.request_id] = [float(entry.num_computed_tokens)]
    result = sched.update_from_output(output, ModelRunnerOutput({}, pooled=pooled))
    sched.kv_cache.check_invariants()
    return result, scheduled


def test_chunked_and_batched_then_finished_by_the_embedding() -> None:
    sched = make_scheduler(block_size=4, max_num_batched_tokens=16, max_model_len=64)
    sched.add_request(embedding_request("long", 40))
    sched.add_request(embedding_request("short", 6, base=300))
    steps = []
    while sched.has_unfinished_requests():
        steps.append(pool_step(sched))
    # 16-token chunks of the long prompt; the short one rides in the third step's leftover.
    assert [scheduled for _, scheduled in steps] == [
        {"long": 16},
        {"long": 16},
        {"long": 8, "short": 6},
    ]
    assert [result.outputs for result, _ in steps[:2]] == [[], []]
    finals = {out.request_id: out for out in steps[2][0].outputs}
    assert finals["long"].finish_reason == finals["short"].finish_reason == "stop"
    assert finals["long"].new_token_ids == [] and finals["long"].embedding == [32.0]
    assert finals["short"].embedding == [0.0]
    assert finals["short"].queue_time is not None
    assert sched.kv_cache.usage() == 0.0


def test_a_full_prefix_cache_hit_still_computes_the_last_token() -> None:
    sched = make_scheduler(block_size=4, max_num_batched_tokens=32)
    sched.add_request(embedding_request("first", 12))
    pool_step(sched)
    again = embedding_request("again", 12)
    sched.add_request(again)
    result, scheduled = pool_step(sched)
    # Blocks 0-1 hit; block 2 is given back so that its last token runs, and pools.
    assert scheduled == {"again": 4} and again.num_cached_tokens == 8
    (out,) = result.outputs
    assert out.embedding == [8.0] and out.num_cached_tokens == 8
    assert again.status is RequestStatus.FINISHED_STOPPED


def test_an_embedding_may_fill_max_model_len_a_generation_may_not() -> None:
    sched = make_scheduler(max_model_len=16)
    sched.add_request(embedding_request("fits", 16))
    with pytest.raises(RequestValidationError) as refused:
        sched.add_request(embedding_request("over", 17))
    assert refused.value.param == "input"
    generation = Request("gen", list(range(100, 116)), EMBEDDING_PARAMS)
    with pytest.raises(RequestValidationError, match="no room to generate"):
        sched.add_request(generation)
