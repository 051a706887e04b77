"""Every tool-call format: the whole text gives the expected calls, and any chunking of it
(a character, a token-sized piece or a random-sized piece at a time) streams deltas that
reassemble exactly the whole parse."""

from __future__ import annotations

import json
import random
import re

import pytest

from server.tool_parsers import FORMATS, Parsed, ParsedCall, ToolCallStream
from server.tools import Tool

TOOLS = [
    Tool.model_validate(
        {
            "type": "function",
            "function": {
                "name": name,
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "days": {"type": "integer"},
                        "tags": {"type": "array", "items": {"type": "string"}},
                    },
                },
            },
        }
    )
    for name in ("get_weather", "g", "f")
]

# format -> case -> (model output, expected content, expected [(name, arguments)]).
CASES: dict[str, dict[str, tuple[str, str, list[tuple[str, str]]]]] = {
    "hermes": {
        "none": ("Just text, no calls.", "Just text, no calls.", []),
        "one": (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "",
            [("get_weather", '{"city": "Paris"}')],
        ),
        "text-then-two": (
            'Sure. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n'
            '<tool_call>{"name":"g","arguments":{}}</tool_call> Done',
            "Sure. Done",
            [("f", '{"a": 1}'), ("g", "{}")],
        ),
        "delimiters-in-arguments": (
            '<tool_call>{"name": "f", "arguments": {"s": "</tool_call><tool_call>}{\\""}}'
            "</tool_call>",
            "",
            [("f", '{"s": "</tool_call><tool_call>}{\\""}')],
        ),
        "not-a-call": (
            "hi <tool_call> not json </tool_call> bye",
            "hi <tool_call> not json </tool_call> bye",
            [],
        ),
        "arguments-first": (
            '<tool_call>{"arguments": [1,2], "name": "late"}</tool_call>',
            "",
            [("late", "[1,2]")],
        ),
        "cut-off": (
            '<tool_call>{"name": "cut", "arguments": {"a": "unfin',
            "",
            [("cut", '{"a": "unfin')],
        ),
        "name-not-a-string": (
            '<tool_call>{"name": 5}</tool_call>x',
            '<tool_call>{"name": 5}</tool_call>x',
            [],
        ),
        "junk-after-the-object": (
            'a <tool_call>{"name":"f"} junk</tool_call> b',
            "a b",
            [("f", "{}")],
        ),
        "unicode": (
            '<tool_call>{"name": "f", "parameters": {"ville": "Besançon ✓"}}</tool_call>',
            "",
            [("f", '{"ville": "Besançon ✓"}')],
        ),
        "empty-block": ("<tool_call></tool_call> x", "<tool_call></tool_call> x", []),
        "cut-before-arguments": ('x <tool_call>{"name": "f", "argu', "x", [("f", "")]),
    },
    "llama3_json": {
        "none": ("The weather is fine.", "The weather is fine.", []),
        "one": (
            '{"name": "get_weather", "parameters": {"city": "Paris"}}',
            "",
            [("get_weather", '{"city": "Paris"}')],
        ),
        "python-tag-two": (
            '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; '
            '{"name": "g", "arguments": {"b": [1, 2]}}',
            "",
            [("f", '{"a": 1}'), ("g", '{"b": [1, 2]}')],
        ),
        "delimiters-in-arguments": (
            '{"name": "f", "parameters": {"s": "}; {\\"name\\": \\"x\\"}"}}',
            "",
            [("f", '{"s": "}; {\\"name\\": \\"x\\"}"}')],
        ),
        "object-without-name": ('{"city": "Paris"}', '{"city": "Paris"}', []),
        "text-after": ('{"name": "g", "parameters": {}} thanks', "thanks", [("g", "{}")]),
    },
    "mistral": {
        "none": ("No tools needed.", "No tools needed.", []),
        "array-one": (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
            "",
            [("get_weather", '{"city": "Paris"}')],
        ),
        "array-text-before-two": (
            'Let me check. [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, '
            '{"name": "g", "arguments": {}}]',
            "Let me check.",
            [("f", '{"a": 1}'), ("g", "{}")],
        ),
        "named-two": (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]g[ARGS]{"tags": ["x"]}',
            "",
            [("get_weather", '{"city": "Paris"}'), ("g", '{"tags": ["x"]}')],
        ),
        "delimiters-in-arguments": (
            '[TOOL_CALLS]f[ARGS]{"s": "[TOOL_CALLS]g[ARGS]{}"}',
            "",
            [("f", '{"s": "[TOOL_CALLS]g[ARGS]{}"}')],
        ),
        "v13-call-id": (
            '[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{"a": 1}',
            "",
            [("f", '{"a": 1}')],
        ),
    },
    "granite": {
        "none": ("Paris is sunny.", "Paris is sunny.", []),
        "array-one": (
            '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
            "",
            [("get_weather", '{"city": "Paris"}')],
        ),
        "text-then-two": (
            'Checking. <|tool_call|>[{"arguments": {"a": 1}, "name": "f"}, {"name": "g"}]',
            "Checking.",
            [("f", '{"a": 1}'), ("g", "{}")],
        ),
        "delimiters-in-arguments": (
            '<|tool_call|>[{"name": "f", "arguments": {"s": "<|tool_call|>[{\\"x\\"}]"}}]',
            "",
            [("f", '{"s": "<|tool_call|>[{\\"x\\"}]"}')],
        ),
        "marker-without-calls": ("<|tool_call|> sorry", "<|tool_call|> sorry", []),
    },
    "pythonic": {
        "none": ("Paris is sunny [citation needed].", "Paris is sunny [citation needed].", []),
        "one": ('[get_weather(city="Paris")]', "", [("get_weather", '{"city": "Paris"}')]),
        "two-python-literals": (
            "<|python_start|>[f(a=1, b='x', c=True, d=None, e=[1, 'y']), g()]<|python_end|>",
            "",
            [("f", '{"a": 1, "b": "x", "c": true, "d": null, "e": [1, "y"]}'), ("g", "{}")],
        ),
        "delimiters-in-arguments": (
            '[f(s=\'a), g(b="]"\', t="(x=1, [y])")]',
            "",
            [("f", '{"s": "a), g(b=\\"]\\"", "t": "(x=1, [y])"}')],
        ),
        "json-literals": ("[f(ok=true, no=null)]", "", [("f", '{"ok": true, "no": null}')]),
        "list-not-calls": ("[1, 2, 3]", "[1, 2, 3]", []),
    },
    "qwen3_coder": {
        "none": ("No call here.", "No call here.", []),
        "one": (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
            "",
            [("get_weather", '{"city": "Paris", "days": 3}')],
        ),
        "text-then-two": (
            'Checking.\n<tool_call>\n<function=get_weather>\n<parameter=tags>\n["a", "b"]\n'
            "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=g>\n</function>\n"
            "</tool_call>",
            "Checking.",
            [("get_weather", '{"tags": ["a", "b"]}'), ("g", "{}")],
        ),
        "delimiters-in-arguments": (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\n<b>x</b> </function> "
            '{"y"}\n</parameter>\n</function>\n</tool_call>',
            "",
            [("get_weather", '{"city": "<b>x</b> </function> {\\"y\\"}"}')],
        ),
        "string-that-looks-like-a-number": (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
            "</function>\n</tool_call>",
            "",
            [("get_weather", '{"city": "42"}')],
        ),
    },
}
PARAMS = [(fmt, case) for fmt, cases in CASES.items() for case in cases]


def parser(fmt: str):
    return FORMATS[fmt]().parser(TOOLS)


def expected(fmt: str, case: str) -> tuple[str, list[dict[str, str]]]:
    _, content, calls = CASES[fmt][case]
    return content, [{"name": n, "arguments": a} for n, a in calls]


@pytest.mark.parametrize(("fmt", "case"), PARAMS)
def test_whole_text(fmt: str, case: str) -> None:
    text, content, calls = CASES[fmt][case]
    assert parser(fmt).parse(text, final=True) == Parsed(
        content, [ParsedCall(n, a) for n, a in calls]
    )
    if not case.startswith("cut"):
        for _, arguments in calls:
            json.loads(arguments)


def reassemble(fmt: str, chunks: list[str]) -> tuple[str, list[dict[str, str]]]:
    """Feeds the text chunk by chunk, as a stream does, and rebuilds what a client sees."""
    tool_format = FORMATS[fmt]()
    stream = ToolCallStream(tool_format, tool_format.parser(TOOLS), None)
    text, content, calls = "", "", {}
    for i, chunk in enumerate(chunks):
        text += chunk
        for delta in stream.deltas(text, final=i == len(chunks) - 1):
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    assert call["type"] == "function" and call["function"]["arguments"] == ""
                    assert call["index"] not in calls
                    calls[call["index"]] = dict(call["function"])
                else:
                    calls[call["index"]]["arguments"] += call["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


def chunkings(text: str) -> dict[str, list[str]]:
    """One character at a time, token-sized pieces, and random-sized ones."""
    out = {"characters": list(text), "tokens": re.findall(r"\w+|\s+|[^\w\s]", text)}
    for seed in range(8):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 15))))
        out[f"random-{seed}"] = [
            text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)
        ]
    return out


@pytest.mark.parametrize(("fmt", "case"), PARAMS)
def test_any_chunking_reassembles_the_whole_parse(fmt: str, case: str) -> None:
    text = CASES[fmt][case][0]
    for name, chunks in chunkings(text).items():
        assert "".join(chunks) == text
        assert reassemble(fmt, chunks) == expected(fmt, case), name


@pytest.mark.parametrize("fmt", CASES)
def test_reports_only_grow(fmt: str) -> None:
    """Each prefix's parse extends the previous one's: nothing sent is ever taken back."""
    for text, _, _ in CASES[fmt].values():
        previous = Parsed("", [])
        for end in range(1, len(text) + 1):
            current = parser(fmt).parse(text[:end], final=False)
            assert current.content.startswith(previous.content), (text[:end], current)
            assert len(current.calls) >= len(previous.calls)
            for before, after in zip(previous.calls, current.calls, strict=False):
                assert before.name == after.name and after.arguments.startswith(before.arguments)
            previous = current


@pytest.mark.parametrize("fmt", CASES)
def test_cut_off_call_keeps_what_was_written(fmt: str) -> None:
    """A call that max_tokens cut short is still a call (what a client sees with
    finish_reason "length"): the formats that write JSON keep the arguments' text so far;
    those whose arguments this server writes keep the complete values, as a JSON object."""
    text = CASES[fmt]["one"][0] if "one" in CASES[fmt] else CASES[fmt]["array-one"][0]
    parsed = parser(fmt).parse(text[: text.index("Paris") + 3], final=True)
    assert [c.name for c in parsed.calls] == ["get_weather"]
    if fmt in ("pythonic", "qwen3_coder"):
        assert parsed.calls[0].arguments == "{}"
    else:
        assert parsed.calls[0].arguments.endswith('"Par')


def test_mistral_ids_are_nine_letters_and_digits() -> None:
    assert re.fullmatch(r"[A-Za-z0-9]{9}", FORMATS["mistral"]().new_call_id())
