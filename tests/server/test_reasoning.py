"""Reasoning parsers: the thinking and the answer, whole and however the text is chunked,
with the tool formats reading calls from the answer only."""

from __future__ import annotations

import json
import random

import pytest

from server.chat_output import ChoiceReader
from server.reasoning import FORMATS, Split, reasoning_tokens
from server.tool_parsers import FORMATS as TOOL_FORMATS
from server.tools import Tool, plan_tools

# format -> case -> (phase, output, expected reasoning, expected content)
CASES = {
    "qwen3": {
        "thinks": ("maybe", "<think>\nLet me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
        "no-thinking": ("maybe", "Paris, at once.", None, "Paris, at once."),
        "thinking-off": ("closed", "Paris.", None, "Paris."),
        "prompt-opened": ("open", "hmm, 2+2\n</think>\n\n4", "hmm, 2+2", "4"),
        "cut-off": (
            "maybe",
            "<think>\nstill thinking about </thi",
            "still thinking about </thi",
            "",
        ),
        "markers-in-thinking": (
            "maybe",
            "<think>a <think> b</think>c</think>",
            "a <think> b",
            "c</think>",
        ),
    },
    "deepseek_r1": {
        "template-opened": ("open", "First, 3*4.\n</think>\n\n12", "First, 3*4.", "12"),
        "model-repeats-the-tag": ("open", "<think>\nok\n</think>\n\nyes", "ok", "yes"),
        "never-ends": ("open", "thinking forever", "thinking forever", ""),
    },
    "granite": {
        "granite-3.2": (
            "maybe",
            "Here is my thought process:\nEasy.\nHere is my response:\nParis.",
            "Easy.",
            "Paris.",
        ),
        "granite-3.3": (
            "maybe",
            "<think>Easy.</think><response>Paris.</response>",
            "Easy.",
            "Paris.",
        ),
        "no-thinking": ("maybe", "Paris.", None, "Paris."),
    },
}
PARAMS = [(f, c) for f, cases in CASES.items() for c in cases]


@pytest.mark.parametrize(("fmt", "case"), PARAMS)
def test_whole_output(fmt: str, case: str) -> None:
    phase, text, reasoning, content = CASES[fmt][case]
    split = FORMATS[fmt].split(text, True, phase)
    assert (split.reasoning, split.content) == (reasoning, content)


def stream(reader: ChoiceReader, chunks: list[str]) -> dict[str, object]:
    """What a client rebuilds from the deltas."""
    text, out, calls = "", {"reasoning": None, "content": ""}, {}
    for i, chunk in enumerate(chunks):
        text += chunk
        for delta in reader.deltas(text, final=i == len(chunks) - 1):
            if "reasoning" in delta:
                out["reasoning"] = (out["reasoning"] or "") + delta["reasoning"]
            out["content"] += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                entry["name"] += call["function"].get("name", "")
                entry["arguments"] += call["function"]["arguments"]
    if calls:
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out


def pieces(text: str, seed: int) -> list[str]:
    if seed < 0:
        return list(text)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 10))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("seed", [-1, 0, 1, 2, 3])
@pytest.mark.parametrize(("fmt", "case"), PARAMS)
def test_streamed_deltas_add_up_to_the_whole(fmt: str, case: str, seed: int) -> None:
    phase, text, reasoning, content = CASES[fmt][case]
    reader = ChoiceReader(FORMATS[fmt], phase, None)
    got = stream(reader, pieces(text, seed))
    # A stream that never sends reasoning has none, as the whole message says.
    assert got == {"reasoning": reasoning or None, "content": content}


@pytest.mark.parametrize("fmt", CASES)
def test_splits_only_grow(fmt: str) -> None:
    for phase, text, _, _ in CASES[fmt].values():
        previous = Split(None, "", False)
        for end in range(1, len(text) + 1):
            current = FORMATS[fmt].split(text[:end], False, phase)
            assert (current.reasoning or "").startswith(previous.reasoning or "")
            assert current.content.startswith(previous.content)
            previous = current


TOOL = Tool.model_validate(
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
)


@pytest.mark.parametrize("seed", [-1, 0, 1])
def test_calls_are_read_from_the_answer_only(seed: int) -> None:
    """A call written while thinking is thinking; the answer's call is a call."""
    hermes = TOOL_FORMATS["hermes"]()
    plan = plan_tools([TOOL], "auto", None, hermes, "")
    thought = '<tool_call>{"name": "get_weather", "arguments": {"draft": 1}}</tool_call>'
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    text = f"<think>maybe {thought}</think>\n\nSure. {call}"
    reader = ChoiceReader(FORMATS["qwen3"], "maybe", plan)
    message, has_calls = reader.message(text, "stop")
    assert has_calls and message["reasoning"] == f"maybe {thought}"
    assert message["content"] == "Sure."
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
        {"city": "Paris"}
    ]
    streamed = stream(ChoiceReader(FORMATS["qwen3"], "maybe", plan), pieces(text, seed))
    assert streamed == {
        "reasoning": message["reasoning"],
        "content": "Sure.",
        "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}],
    }


def test_an_unparseable_call_is_content(caplog: pytest.LogCaptureFixture) -> None:
    plan = plan_tools([TOOL], "auto", None, TOOL_FORMATS["hermes"](), "")
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>'
    message, has_calls = ChoiceReader(None, "closed", plan).message(text, "stop")
    assert not has_calls and message == {"content": text}
    assert "unparseable hermes tool call" in caplog.text and "city" not in caplog.text


def test_reasoning_tokens_count_up_to_the_end_marker() -> None:
    vocab = ["<think>", "a", " b", "</think>", "\n\n", "x"]

    def decode(ids: list[int]) -> str:
        return "".join(vocab[i] for i in ids)

    fmt = FORMATS["qwen3"]
    assert reasoning_tokens([0, 1, 2, 3, 4, 5], decode, fmt, "maybe") == 4
    assert reasoning_tokens([5, 5], decode, fmt, "maybe") == 0
    assert reasoning_tokens([0, 1, 2], decode, fmt, "maybe") == 3
    assert reasoning_tokens([1, 3, 5], decode, FORMATS["deepseek_r1"], "open") == 2
