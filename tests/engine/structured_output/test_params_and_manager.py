"""Constraint validation and the compile manager, without a model (fake compilers)."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from engine import RequestValidationError, StructuredOutputsParams
from engine.structured_output import GrammarKey, StructuredOutputManager
from engine.structured_output.params import close_objects
from engine.structured_output.request import StructuredOutputRequest


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"json": {}, "regex": "a"}, {"json_object": False}, {"choice": []}],
    ids=["none", "two", "json_object-false", "empty-choice"],
)
def test_exactly_one_valid_constraint(kwargs: dict) -> None:
    with pytest.raises(RequestValidationError) as err:
        StructuredOutputsParams(**kwargs)
    assert err.value.param is not None and err.value.param.startswith("structured_outputs")


def test_key_keeps_property_order_and_whitespace_options() -> None:
    schema = {"type": "object", "properties": {"b": {}, "a": {}}}
    key = StructuredOutputsParams(json=schema).key()
    assert key == GrammarKey("json", '{"type": "object", "properties": {"b": {}, "a": {}}}')
    flexible = StructuredOutputsParams(json=schema, disable_any_whitespace=False).key()
    assert flexible.any_whitespace and flexible != key
    assert StructuredOutputsParams(json='{"type": "object", "properties": {"b": {}, "a": {}}}')


def test_json_text_that_is_not_json_is_a_validation_error() -> None:
    with pytest.raises(RequestValidationError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope").key()


def test_close_objects_closes_every_open_object_schema_only() -> None:
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "free": {"type": "object", "additionalProperties": True},
            "enum": {"enum": [{"type": "object"}]},
        },
        "$defs": {"d": {"properties": {"y": {}}}},
    }
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in props["properties"]["properties"]  # a name map
    assert props["free"]["additionalProperties"] is True
    assert props["enum"]["enum"] == [{"type": "object"}]  # data, untouched
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the input is not mutated


class FakeGrammar:
    def __init__(self, key: GrammarKey) -> None:
        self.key = key

    def new_matcher(self) -> object:
        return object()


def test_manager_compiles_each_key_once_and_builds_the_compiler_lazily() -> None:
    factory_calls, compiled = [], []
    release = threading.Event()

    def compile_key(key: GrammarKey) -> FakeGrammar:
        release.wait(timeout=10)
        compiled.append(key)
        if key.kind == "regex":
            raise RequestValidationError("bad regex", "structured_outputs.regex")
        return FakeGrammar(key)

    def factory():
        factory_calls.append(1)
        return compile_key

    manager = StructuredOutputManager(factory)
    assert factory_calls == []
    params = StructuredOutputsParams(json={"type": "object"})
    first, second = manager.request_grammar(params), manager.request_grammar(params)
    assert not first.ready() and first.matcher is None  # still compiling
    release.set()
    assert first.compiled.result(timeout=10) is second.compiled.result(timeout=10)
    assert first.ready() and second.ready() and first.matcher is not second.matcher
    with pytest.raises(RequestValidationError, match="bad regex"):
        manager.compile(StructuredOutputsParams(regex="(")).result(timeout=10)
    assert len(compiled) == 2 and factory_calls == [1]
    manager.shutdown()


def test_a_failed_compile_is_ready_with_its_error() -> None:
    future: Future = Future()
    grammar = StructuredOutputRequest(future)
    assert not grammar.ready()
    future.set_exception(RequestValidationError("nope"))
    assert grammar.ready() and grammar.matcher is None
    assert isinstance(grammar.error, RequestValidationError)
