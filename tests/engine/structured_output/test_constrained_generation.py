"""Constrained generation end to end on a tiny random model with a byte-level tokenizer.

A random model writes nothing sensible on its own, so every valid output here is the
grammar's doing. The schema bounds every value, so outputs finish within max_tokens.
"""

from __future__ import annotations

import ctypes
import json
import re
import struct
import threading
from pathlib import Path

import jsonschema
import pytest
import torch

from engine import (
    LLM,
    EngineHooks,
    RequestValidationError,
    SamplingParams,
    StructuredOutputsParams,
)
from engine.request import Request, RequestStatus
from engine.structured_output import CompiledGrammar, GrammarKey, StructuredOutputManager
from engine.structured_output.backend import LLGuidanceBackend
from engine.worker.grammar_bitmask import GrammarBitmask
from tests.tiny_models import make_tiny_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["a", "bb"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "point": {"$ref": "#/$defs/point"},
    },
    "required": ["name", "n", "kind", "tags", "point"],
    "additionalProperties": False,
    "$defs": {
        "point": {
            "type": "object",
            "properties": {"x": {"anyOf": [{"type": "null"}, {"enum": [1, 2]}]}},
            "required": ["x"],
            "additionalProperties": False,
        }
    },
}
JSON = StructuredOutputsParams(json=SCHEMA)
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], list(range(100, 150))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-bytes"), byte_level=True)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=128, max_model_len=256)


def check_valid(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


SAMPLING = {
    "greedy": dict(temperature=0.0),
    "random": dict(temperature=1.0, seed=1),
    "top_k": dict(temperature=1.5, top_k=5, seed=2),
    "top_p": dict(temperature=1.0, top_p=0.5, seed=3),
    "min_p": dict(temperature=1.0, min_p=0.2, seed=4),
    "penalties": dict(temperature=0.7, repetition_penalty=1.5, presence_penalty=1.0, seed=5),
    # A huge bias towards a filler token the grammar forbids must not leak through.
    "logit_bias": dict(temperature=1.0, logit_bias={500: 100.0}, seed=6),
}


@pytest.mark.parametrize("mode", SAMPLING)
def test_every_sampling_mode_stays_inside_the_schema(llm: LLM, mode: str) -> None:
    params = SamplingParams(max_tokens=120, n=2, structured_outputs=JSON, **SAMPLING[mode])
    for output in llm.generate(PROMPTS, params):
        for choice in output.outputs:
            assert choice.finish_reason == "stop", choice.text
            check_valid(choice.text)
            assert llm.tokenizer.eos_token_id not in choice.token_ids  # ended by the grammar


def test_seeded_choices_differ_and_repeat(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=120, structured_outputs=JSON)
    first = [c.text for c in llm.generate(PROMPTS[:1], params)[0].outputs]
    again = [c.text for c in llm.generate(PROMPTS[:1], params)[0].outputs]
    assert first == again and len(set(first)) > 1


def test_unconstrained_neighbours_are_unchanged_by_a_constrained_one(llm: LLM) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain)]
    constrained = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=JSON)
    mixed = llm.generate([*PROMPTS, PROMPTS[0]], [plain, plain, plain, constrained])
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    check_valid(mixed[3].outputs[0].text)
    # The same prompt unconstrained writes something else: the mask did the work.
    assert mixed[3].outputs[0].token_ids != alone[0][: len(mixed[3].outputs[0].token_ids)]


def test_preemption_and_chunked_prefill_keep_the_output_exact(model_dir: Path, llm: LLM) -> None:
    """A tiny step budget chunks every prompt; a tiny KV pool forces preemptions. The
    matcher keeps its state across both, so greedy outputs equal the roomy engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=JSON)
    prompts = [list(range(20 + i, 60 + i)) for i in range(6)]
    expected = [o.outputs[0].text for o in llm.generate(prompts, params)]
    tight = LLM(
        str(model_dir),
        hooks=EngineHooks(check_invariants=True),
        dtype="float32",
        block_size=16,
        num_kv_blocks=16,
        max_model_len=256,
        max_num_batched_tokens=24,
    )
    got = [o.outputs[0].text for o in tight.generate(prompts, params)]
    assert tight.core.scheduler.total_preemptions > 0
    assert got == expected
    for text in got:
        check_valid(text)


def test_max_tokens_cuts_an_object_with_length(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=JSON)
    choice = llm.generate(PROMPTS[:1], params)[0].outputs[0]
    assert choice.finish_reason == "length" and len(choice.token_ids) == 4
    assert choice.text.startswith('{"name":"')


def test_stop_strings_still_apply(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=120, stop=['"n"'], structured_outputs=JSON)
    choice = llm.generate(PROMPTS[:1], params)[0].outputs[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == '"n"'
    assert choice.text.startswith('{"name":"') and choice.text.endswith(",")


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        (StructuredOutputsParams(choice=("yes", 'no "way"', "ünïcode")), None),
        (StructuredOutputsParams(regex=r"[a-c]{2,5}-\d\d"), r"[a-c]{2,5}-\d\d"),
        (StructuredOutputsParams(grammar='start: "x" ("," "x")* "!"'), r"x(,x)*!"),
        (StructuredOutputsParams(grammar='root ::= "ab" | "cd"'), r"ab|cd"),  # GBNF
        (StructuredOutputsParams(json_object=True), None),
    ],
    ids=["choice", "regex", "lark", "gbnf", "json_object"],
)
def test_other_constraint_kinds(llm: LLM, constraint: StructuredOutputsParams, check) -> None:
    params = SamplingParams(
        temperature=1.0, seed=3, n=4, max_tokens=60, structured_outputs=constraint
    )
    for choice in llm.generate(PROMPTS[:1], params)[0].outputs:
        if constraint.choice is not None:
            assert choice.text in constraint.choice
        elif check is not None:
            assert re.fullmatch(check, choice.text), choice.text
        elif choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)


@pytest.mark.parametrize(
    ("constraint", "param", "message"),
    [
        (StructuredOutputsParams(json={"type": "object", "not": {}}), "json", "not"),
        (StructuredOutputsParams(json={"type": "strin"}), "json", "strin"),
        (StructuredOutputsParams(regex="a(b"), "regex", "unclosed group"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "grammar", "undefined_rule"),
    ],
)
def test_a_grammar_that_cannot_compile_is_refused_before_it_runs(
    llm: LLM, constraint: StructuredOutputsParams, param: str, message: str
) -> None:
    with pytest.raises(RequestValidationError) as err:
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=constraint))
    assert err.value.param == f"structured_outputs.{param}"
    assert message in str(err.value)
    assert not llm.core.has_unfinished_requests()


class BitsMatcher:
    """Allows exactly `allowed`, written as the GrammarMatcher protocol says."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def fill_bitmask(self, address: int, num_bytes: int) -> None:
        words = [0] * (num_bytes // 4)
        for token in self.allowed:
            words[token // 32] |= 1 << (token % 32)
        ctypes.memmove(address, struct.pack(f"<{len(words)}I", *words), num_bytes)


@pytest.mark.parametrize(
    "allowed",
    [{0: [0, 31, 32, 69], 2: [5]}, {0: [1], 1: [30, 31, 63], 2: [64, 69]}],
    ids=["some-rows", "every-row"],
)
def test_bitmask_masks_exactly_the_forbidden_tokens_of_constrained_rows(
    allowed: dict[int, list[int]],
) -> None:
    vocab = 70  # not a multiple of 32; logits one column wider, as a padded head may be
    bitmask = GrammarBitmask(vocab, torch.device("cpu"))
    logits = torch.randn(3, vocab + 1)
    before = logits.clone()
    bitmask.apply(logits, list(allowed), [BitsMatcher(a) for a in allowed.values()])
    for row in range(3):
        for token in range(vocab + 1):
            if row not in allowed or token in allowed[row]:
                assert logits[row, token] == before[row, token]
            else:
                assert logits[row, token] == float("-inf"), (row, token)


def test_a_request_whose_grammar_compiles_waits_while_others_step(llm: LLM) -> None:
    """Through EngineCore directly (the front-ends compile before they submit): the step
    runs the plain request and passes over the compiling one until its grammar is ready."""
    release = threading.Event()
    arch = llm.config.model.arch
    backend = LLGuidanceBackend(llm.tokenizer, arch.vocab_size, arch.eos_token_ids)

    def slow_compile(key: GrammarKey) -> CompiledGrammar:
        release.wait(timeout=30)
        return backend.compile(key)

    slow = StructuredOutputManager(lambda: slow_compile)
    core, saved = llm.core, llm.core.grammars
    core.grammars = slow
    try:
        schema = {**SCHEMA, "title": "compiled-slowly"}
        params = SamplingParams(
            temperature=0.0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=schema)
        )
        waiting = Request("slow", PROMPTS[0], params, (2,))
        plain = Request("plain", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=3))
        core.add_request(waiting)
        core.add_request(plain)
        finished: list[str] = []
        while not finished:
            outputs = core.step().outputs
            assert {out.request_id for out in outputs} <= {"plain"}
            finished += [out.request_id for out in outputs if out.finished]
            assert waiting.status is RequestStatus.WAITING_FOR_GRAMMAR
        release.set()
        text = []
        while core.has_unfinished_requests():
            text += [t for out in core.step().outputs for t in out.new_token_ids]
        check_valid(llm.tokenizer.decode(text))
    finally:
        release.set()
        core.grammars = saved
        slow.shutdown()
