"""Async scheduling (EngineCore._overlapped_step): step N+1 is scheduled and its forward
run before step N's output is applied, its decode inputs read from N's sampled tokens.

It must not change any output. On the CPU nothing overlaps, but every mechanism runs:
placeholders in the scheduler, placeholder input ids filled from the last step's tokens,
rows of requests that ended on the step before skipped, a preempted request still taking
the token its last step sampled. Checked against transformers (greedy, float32) and
against the same engine without async scheduling (stop tokens, logprobs, penalties,
seeds, grammars, aborts), with the block pool verified after every step.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.request import Request
from tests.engine.test_correctness import (
    CHECKED,
    GREEDY,
    LENGTHS,
    MAX_TOKENS,
    engine_tokens,
    hf_greedy,
    make_prompts,
    tiny_llm,
)
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    path = make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"))
    prompts = make_prompts(1, LENGTHS)
    prefix = make_prompts(2, [3 * 16 + 5])[0]
    shared = [prefix + tail for tail in make_prompts(3, [4, 11, 1, 20])]
    reference = hf_greedy(path, prompts + shared, MAX_TOKENS)
    return path, prompts, shared, reference[: len(prompts)], reference[len(prompts) :]


def async_llm(path: Path, **kwargs: object) -> LLM:
    llm = tiny_llm(path, async_scheduling=True, **kwargs)
    assert llm.core.async_scheduling
    return llm


def test_off_by_default_on_cpu(model) -> None:
    assert not tiny_llm(model[0]).core.async_scheduling


@pytest.mark.parametrize(
    "mode", ["alone", "batched", "chunked", "prefix-hits", "preempted", "one-block-short"]
)
def test_greedy_matches_transformers(model, mode: str) -> None:
    path, prompts, shared, reference, shared_reference = model
    if mode == "alone":
        llm = async_llm(path, enable_prefix_caching=False)
        assert [engine_tokens(llm, [p])[0] for p in prompts] == reference
    elif mode == "batched":
        assert engine_tokens(async_llm(path), prompts) == reference
    elif mode == "chunked":
        assert engine_tokens(async_llm(path, max_num_batched_tokens=16), prompts) == reference
    elif mode == "prefix-hits":
        llm = async_llm(path)
        first = engine_tokens(llm, shared[:1])
        outputs = llm.generate(shared[1:], GREEDY)
        assert first + [o.outputs[0].token_ids for o in outputs] == shared_reference
        assert all(o.num_cached_tokens >= 48 for o in outputs)
        assert engine_tokens(async_llm(path), shared) == shared_reference
    elif mode == "preempted":
        llm = async_llm(path, num_kv_blocks=10, max_model_len=160)
        assert engine_tokens(llm, prompts) == reference
        assert llm.core.scheduler.total_preemptions > 0
    else:
        # Prompts one token short of a block: the token in flight fills the block, whose
        # hash can only be taken (and the block cached) once that token is known.
        short = make_prompts(4, [15, 31, 47])
        llm = async_llm(path)
        assert engine_tokens(llm, short) == hf_greedy(path, short, MAX_TOKENS)
        assert engine_tokens(llm, short) == hf_greedy(path, short, MAX_TOKENS)  # from the cache
        assert llm.core.scheduler.kv_cache.counters.hits >= 16 + 32 + 48 - 3 * 16


def outputs_of(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """Each prompt's logprobs, then every choice's tokens, finish reason, stop reason and
    logprobs."""
    result = []
    for output in llm.generate(prompts, params):
        prompt_logprobs = [
            (lp.token_id, round(lp.logprob, 4)) for lp in output.prompt_logprobs or []
        ]
        result.append(prompt_logprobs)
        for c in output.outputs:
            logprobs = [
                (lp.token_id, round(lp.logprob, 4), lp.rank, [t for t, _ in lp.top])
                for lp in c.logprobs or []
            ]
            result.append((c.token_ids, c.finish_reason, c.stop_reason, logprobs))
    return result


def test_same_outputs_as_synchronous_steps(model) -> None:
    """Requests that stop on a token (wasting the row the next step ran for them), end by
    length (never scheduled past it), ask for logprobs, prompt logprobs, penalties, seeds
    or n > 1: the
    same outputs as without async scheduling, batched, chunked and preempted."""
    path, prompts, _, reference, _ = model
    stop_at = [tokens[3] for tokens in reference]  # each request's 4th greedy token
    params = []
    for i, stop in enumerate(stop_at):
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop]))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.0, max_tokens=1 + i, logprobs=2))
        elif kind == 2:
            params.append(
                SamplingParams(
                    temperature=0.0,
                    max_tokens=9,
                    repetition_penalty=1.3,
                    frequency_penalty=0.5,
                    prompt_logprobs=1,
                )
            )
        else:
            params.append(SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=10, n=2))
    for options in ({}, {"max_num_batched_tokens": 16}, {"num_kv_blocks": 10}):
        expected = outputs_of(tiny_llm(path, max_model_len=160, **options), prompts, params)
        got = outputs_of(async_llm(path, max_model_len=160, **options), prompts, params)
        assert got == expected, options
    choices = [o for o in expected if isinstance(o, tuple)]
    assert len([o for o in choices if o[2] is not None]) == 2  # the stop-token requests stopped
    assert sum(1 for o in expected if isinstance(o, list) and o) == 2  # prompt logprobs


def test_length_limited_requests_get_no_extra_rows(model) -> None:
    """A request whose in-flight token is its last by max_tokens is not scheduled again:
    async steps compute exactly the tokens synchronous ones do."""
    path, prompts, *_ = model
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)

    def scheduled_tokens(llm: LLM) -> int:
        for i, prompt in enumerate(prompts):
            llm.core.add_request(Request(str(i), prompt, params))
        total = 0
        while llm.core.has_unfinished_requests():
            total += llm.core.step().stats.num_scheduled_tokens
        return total

    sync, overlapped = tiny_llm(path), async_llm(path)
    assert (
        scheduled_tokens(overlapped)
        == scheduled_tokens(sync)
        == sum(map(len, prompts)) + (len(prompts) * 4)
    )
    assert overlapped.core.scheduler.kv_cache.usage() == 0.0


def test_abort_while_a_step_is_in_flight(model) -> None:
    """Aborting requests between steps, while a step that samples for them has run but
    not been applied: no output for them after the abort, the others unchanged, and every
    block back in the pool at the end."""
    path, prompts, _, reference, _ = model
    llm = async_llm(path)
    core = llm.core
    for i, prompt in enumerate(prompts):
        core.add_request(Request(str(i), prompt, GREEDY))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    aborted = {"1", "4"}
    step = 0
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            assert not (step > 3 and out.request_id in aborted)
            tokens[out.request_id].extend(out.new_token_ids)
        step += 1
        if step == 3:
            assert core._in_flight is not None
            assert {r.request_id for r in core.abort_requests(aborted)} == aborted
    for i, expected in enumerate(reference):
        if str(i) not in aborted:
            assert tokens[str(i)] == expected
        else:
            assert tokens[str(i)] == expected[: len(tokens[str(i)])]
            assert len(tokens[str(i)]) < len(expected)
    assert core.scheduler.kv_cache.usage() == 0.0


def test_grammars_advance_before_the_next_token_is_sampled(tmp_path: Path) -> None:
    """A constrained request's next row is sampled after its last token advanced the
    grammar, so its output is valid and equal to the synchronous one's."""
    path = make_tiny_model("llama", tmp_path / "bytes", byte_level=True)
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "maximum": 999}, "b": {"enum": ["x", "yy"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    constrained = SamplingParams(
        temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema)
    )
    sampled = replace(constrained, temperature=1.0, seed=3)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], list(range(100, 150))]
    params = [constrained, sampled, constrained]
    options: dict[str, object] = dict(dtype="float32", num_kv_blocks=128, max_model_len=256)
    results = []
    for overlap in (False, True):
        llm = LLM(str(path), hooks=CHECKED, async_scheduling=overlap, **options)
        outputs = llm.generate(prompts, params)
        texts = [o.outputs[0].text for o in outputs]
        for text in texts:
            value = json.loads(text)
            assert set(value) == {"a", "b"} and value["b"] in ("x", "yy")
        results.append(texts)
    assert results[0] == results[1]


def test_refused_with_tensor_parallelism(model) -> None:
    with pytest.raises(ValueError, match="--async-scheduling"):
        LLM(str(model[0]), dtype="float32", tensor_parallel_size=2, async_scheduling=True)
