"""The Hermes tool-call parser: whole text and any chunking of it give the same result."""

from __future__ import annotations

import json
import random

import pytest

from server.tool_parser import Parsed, ParsedCall, ToolCallStream, parse

TEXTS = {
    "content-call-content": (
        'Sure. <tool_call>{"name": "f", "arguments": {"a": 1, "s": "x}y\\"z"}}</tool_call> Done'
    ),
    "two-calls": (
        '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name":"g","arguments":{}}\n</tool_call>'
    ),
    "not-a-call": "hello <tool_call> not json </tool_call> bye <tool_c",
    "plain": "plain text with trailing ws  \n",
    "arguments-first": '<tool_call>{"arguments": [1,2], "name": "late"}</tool_call>',
    "cut-off": '<tool_call>{"name": "cut", "arguments": {"a": "unfinish',
    "name-not-a-string": '<tool_call>{"name": 5}</tool_call>x',
    "junk-after-the-object": 'a <tool_call>{"name":"f"} junk</tool_call> b',
    "unicode": '<tool_call>{"name": "f", "parameters": {"ville": "Besançon ✓"}}</tool_call>',
    # Seen from the default model: a closing tag inside a string is part of the arguments.
    "close-tag-in-a-string": (
        '<tool_call>\n{"name":"t","arguments":{"tz":"UTC}}</tool_call>Bien"}}\n</tool_call> ok'
    ),
    "empty-block": "<tool_call></tool_call> x",
    "cut-before-arguments": 'x <tool_call>{"name": "f", "argu',
}
EXPECTED = {
    "content-call-content": ("Sure. Done", [("f", '{"a": 1, "s": "x}y\\"z"}')]),
    "two-calls": ("", [("get_weather", '{"city":"Paris"}'), ("g", "{}")]),
    "not-a-call": ("hello <tool_call> not json </tool_call> bye <tool_c", []),
    "plain": ("plain text with trailing ws  \n", []),
    "arguments-first": ("", [("late", "[1,2]")]),
    "cut-off": ("", [("cut", '{"a": "unfinish')]),
    "name-not-a-string": ('<tool_call>{"name": 5}</tool_call>x', []),
    "junk-after-the-object": ("a b", [("f", "{}")]),
    "unicode": ("", [("f", '{"ville": "Besançon ✓"}')]),
    "close-tag-in-a-string": ("ok", [("t", '{"tz":"UTC}}</tool_call>Bien"}')]),
    "empty-block": ("<tool_call></tool_call> x", []),
    "cut-before-arguments": ("x", [("f", "")]),
}


@pytest.mark.parametrize("name", TEXTS)
def test_final_parse(name: str) -> None:
    content, calls = EXPECTED[name]
    assert parse(TEXTS[name], final=True) == parse_result(content, calls)


def parse_result(content: str, calls: list[tuple[str, str]]) -> Parsed:
    return Parsed(content, [ParsedCall(n, a) for n, a in calls])


def reassemble(chunks: list[str]) -> tuple[str, list[dict[str, str]]]:
    """Feeds the text chunk by chunk, as a stream does, and rebuilds what a client sees."""
    stream, text, content, calls = ToolCallStream(), "", "", {}
    for i, chunk in enumerate(chunks):
        text += chunk
        for delta in stream.deltas(text, final=i == len(chunks) - 1):
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    assert call["id"].startswith("call_") and call["type"] == "function"
                    assert call["function"]["arguments"] == ""
                    calls[call["index"]] = dict(call["function"])
                else:
                    calls[call["index"]]["arguments"] += call["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("name", TEXTS)
def test_any_chunking_reassembles_the_final_parse(name: str, seed: int) -> None:
    text = TEXTS[name]
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 12))))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    content, calls = EXPECTED[name]
    assert reassemble(chunks) == (content, [{"name": n, "arguments": a} for n, a in calls])


def test_one_character_at_a_time_never_retracts() -> None:
    text = TEXTS["content-call-content"] + " " + TEXTS["two-calls"]
    previous = parse("", final=False)
    for end in range(1, len(text) + 1):
        current = parse(text[:end], final=False)
        assert current.content.startswith(previous.content)
        for before, after in zip(previous.calls, current.calls, strict=False):
            assert before.name == after.name and after.arguments.startswith(before.arguments)
        assert len(current.calls) >= len(previous.calls)
        previous = current
    assert [json.loads(c.arguments) for c in parse(text, final=True).calls] == [
        {"a": 1, "s": 'x}y"z'},
        {"city": "Paris"},
        {},
    ]
