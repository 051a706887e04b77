"""A grammar that starts where the reasoning ends: the thinking is free, the answer valid.

Two filler tokens of the byte-level tokenizer stand for <think> (500) and </think> (501):
the engine knows markers only by id. A random model picks them because of a logit bias.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest

from engine import LLM, EngineHooks, ReasoningBounds, RequestValidationError, SamplingParams
from tests.engine.structured_output.test_constrained_generation import JSON, PROMPTS, SCHEMA
from tests.tiny_models import make_tiny_model

THINK, END, EOS = 500, 501, 2  # EOS is kept out of the thinking


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-bytes"), byte_level=True)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=128, max_model_len=384)


def answer(llm: LLM, token_ids: list[int], opened: bool) -> tuple[list[int], str]:
    """The reasoning's tokens and the answer's text (after the end marker)."""
    if not opened and (not token_ids or token_ids[0] != THINK):
        return [], llm.tokenizer.decode(token_ids)
    assert END in token_ids, token_ids
    end = token_ids.index(END)
    return token_ids[:end], llm.tokenizer.decode(token_ids[end + 1 :])


def params(opened: bool, seed: int, **kw: object) -> SamplingParams:
    bounds = ReasoningBounds(end_ids=((END,),), start_ids=(THINK,), opened=opened)
    return SamplingParams(
        temperature=1.0,
        seed=seed,
        n=4,
        max_tokens=300,
        logit_bias={THINK: 4.0, END: 4.5, EOS: -100.0},
        structured_outputs=replace(JSON, reasoning=bounds),
        **kw,
    )


@pytest.mark.parametrize("opened", [True, False], ids=["prompt-opened", "model-opens"])
def test_the_thinking_is_free_and_the_answer_follows_the_schema(llm: LLM, opened: bool) -> None:
    thoughts = []
    for output in llm.generate(PROMPTS, params(opened, seed=11)):
        for choice in output.outputs:
            assert choice.finish_reason == "stop", choice.token_ids
            reasoning, text = answer(llm, choice.token_ids, opened)
            jsonschema.validate(json.loads(text), SCHEMA)
            thoughts.append(reasoning)
    # The grammar would allow neither marker nor filler: the thinking was not masked.
    free = [t for t in thoughts if any(token >= 259 for token in t[1:])]
    assert free, thoughts


def test_a_model_that_does_not_open_it_is_constrained_from_its_first_token(llm: LLM) -> None:
    bounds = ReasoningBounds(end_ids=((END,),), start_ids=(THINK,), opened=False)
    constrained = replace(JSON, reasoning=bounds)
    never = {THINK: -100.0}  # this model never opens its reasoning
    sampling = SamplingParams(
        temperature=0.0, max_tokens=120, logit_bias=never, structured_outputs=constrained
    )
    plain = SamplingParams(
        temperature=0.0, max_tokens=120, logit_bias=never, structured_outputs=JSON
    )
    with_bounds = llm.generate(PROMPTS, sampling)
    without = llm.generate(PROMPTS, plain)
    assert [o.outputs[0].text for o in with_bounds] == [o.outputs[0].text for o in without]


def test_multi_token_end_markers_and_preemption(model_dir: Path, llm: LLM) -> None:
    """An end marker of two tokens; a tiny KV pool preempts requests mid-reasoning, and the
    phase they were in survives it: outputs equal the roomy engine's."""
    bounds = ReasoningBounds(end_ids=((END, THINK),), opened=True)
    sampling = SamplingParams(
        temperature=1.0,
        seed=5,
        max_tokens=200,
        logit_bias={THINK: 6.0, END: 6.0, EOS: -100.0},
        structured_outputs=replace(JSON, reasoning=bounds),
    )
    prompts = [list(range(20 + i, 60 + i)) for i in range(6)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, sampling)]
    tight = LLM(
        str(model_dir),
        hooks=EngineHooks(check_invariants=True),
        dtype="float32",
        block_size=16,
        num_kv_blocks=24,
        max_model_len=384,
        max_num_batched_tokens=24,
    )
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, sampling)]
    assert tight.core.scheduler.total_preemptions > 0
    assert got == expected
    for tokens in got:
        ends = [i for i in range(1, len(tokens)) if tokens[i - 1 : i + 1] == [END, THINK]]
        assert ends, tokens
        jsonschema.validate(json.loads(llm.tokenizer.decode(tokens[ends[0] + 1 :])), SCHEMA)


def test_bounds_need_an_end() -> None:
    with pytest.raises(RequestValidationError):
        ReasoningBounds(end_ids=())


def test_speculative_drafts_inside_the_reasoning(model_dir: Path, llm: LLM) -> None:
    """With n-gram speculation, drafts are taken inside the reasoning (unconstrained) up to
    the one that would end it, and the greedy outputs are the plain engine's token for
    token, reasoning (a two-token end marker) and constrained answer."""
    from engine.request import Request

    bounds = ReasoningBounds(end_ids=((END, THINK),), opened=True)
    sampling = SamplingParams(
        temperature=0.0,
        max_tokens=200,
        logit_bias={THINK: 2.5, END: 1.5, EOS: -100.0},
        structured_outputs=replace(JSON, reasoning=bounds),
    )
    # Prompts that repeat themselves, so that their n-grams recur in the reasoning.
    prompts = [list(range(20 + i, 40 + i)) * 3 for i in range(4)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, sampling)]
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    fast = LLM(
        str(model_dir), dtype="float32", num_kv_blocks=128, max_model_len=384,
        speculative_config=spec,
    )  # fmt: skip
    core = fast.core
    for i, prompt in enumerate(prompts):
        core.add_request(Request(str(i), prompt, sampling))
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    in_reasoning = 0
    while core.has_unfinished_requests():
        reasoning = {
            r.request_id: r.structured.phase == "reasoning"
            for r in core.scheduler.running
            if r.structured is not None
        }
        result = core.step()
        accepted = result.stats.spec_num_accepted_tokens
        if accepted and all(reasoning.values()) and reasoning:
            in_reasoning += accepted
        for o in result.outputs:
            got[o.request_id].extend(o.new_token_ids)
    assert [got[str(i)] for i in range(len(prompts))] == expected
    assert in_reasoning > 0
    for tokens in expected:
        assert any(tokens[i - 1 : i + 1] == [END, THINK] for i in range(1, len(tokens)))
