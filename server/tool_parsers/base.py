"""What every tool-call format shares: the parse result, the format's interface, and the
stream that turns growing parses into OpenAI chat deltas.

A format's parser is a pure function of the text so far, `parse(text, final)`. With
`final=False` it reports only what no continuation of the text can change, so each report
extends the previous one (content and each call's arguments only grow, calls are only
added) and a stream that sends the differences reassembles exactly the final parse,
however the text was chunked. Arguments are the model's own JSON text where the format
writes JSON, never a re-serialisation, for the same reason.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from server.tools import Tool


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str


@dataclass(frozen=True)
class Parsed:
    content: str
    calls: list[ParsedCall]


class CallParser(Protocol):
    def parse(self, text: str, final: bool) -> Parsed: ...


class ToolFormat(ABC):
    """One model family's way of writing tool calls: how to read them back, and the grammar
    that makes a model write them (tool_choice `required` or a named function)."""

    name: ClassVar[str]
    # The format's markers are special tokens, which the text must keep.
    keep_special_tokens: ClassVar[bool] = False
    # A stop string that ends one call: with parallel_tool_calls false under `auto`,
    # generation stops there. Formats without one keep only the first call.
    call_end: ClassVar[str | None] = None
    # What a call starts with: text holding it but no call is logged as unparseable.
    marker: ClassVar[str]
    # The format's markers that tokenizers may hold as single tokens (see `lark`).
    token_markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tokenizer: Any = None, template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = template or ""

    @staticmethod
    @abstractmethod
    def recognises(template: str) -> bool:
        """Whether a chat template renders calls in this format (for `auto`)."""

    @abstractmethod
    def parser(self, tools: list[Tool]) -> CallParser:
        """A parser for one request (some formats type arguments by the tools' schemas)."""

    @abstractmethod
    def calls_grammar(self, rules: list[str], many: bool) -> list[str]:
        """Lark lines defining `start` over the call rules f0, f1, ... (one per offered
        function, built by `function_rule`): one call, or several when `many`."""

    @abstractmethod
    def function_rule(self, index: int, tool: Tool) -> list[str]:
        """Lark lines defining rule f{index}: one call of `tool`, whole."""

    def grammar(self, tools: list[Tool], many: bool) -> str:
        lines: list[str] = []
        for i, tool in enumerate(tools):
            lines += self.function_rule(i, tool)
        return "\n".join(self.calls_grammar([f"f{i}" for i in range(len(tools))], many) + lines)

    def looks_like_call(self, text: str) -> bool:
        return self.marker in text

    def system_prompt(self, tools: list[Tool]) -> str | None:
        """Instructions for chat templates without tool support; None: no built-in prompt."""
        return None

    def new_call_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    def special_token_id(self, text: str) -> int | None:
        """The id of `text` when the tokenizer has it as one token."""
        if self.tokenizer is None:
            return None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def lark(self, text: str) -> str:
        """`text` as a Lark sequence. A marker the tokenizer holds as one token becomes that
        token (`<[id]>`): the grammar engine counts added tokens as special, so it would
        never match them against the marker's characters."""
        pieces = [text]
        for marker in self.token_markers:
            token = self.special_token_id(marker)
            if token is None:
                continue
            split: list[str] = []
            for piece in pieces:
                if piece.startswith("<["):
                    split.append(piece)
                    continue
                parts = piece.split(marker)
                for i, part in enumerate(parts):
                    split += ([f"<[{token}]>"] if i else []) + ([part] if part else [])
            pieces = split
        return " ".join(p if p.startswith("<[") else lark_literal(p) for p in pieces if p)


def call_schema(tool: Tool, arguments_key: str = "arguments") -> dict[str, Any]:
    """One function's call as a JSON object schema {"name": const, arguments_key: schema};
    the parameters' $defs move to its root, where their "#/$defs/..." references point."""
    parameters = parameters_schema(tool)
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},
    }
    for defs in ("$defs", "definitions"):
        if defs in parameters:
            schema[defs] = parameters.pop(defs)
    return schema


def parameters_schema(tool: Tool) -> dict[str, Any]:
    return dict(tool.function.parameters or {"type": "object", "properties": {}})


# JSON values in call grammars: no free whitespace, which a small model pads forever.
TIGHT = {"x-guidance": {"whitespace_flexible": False}}


def lark_literal(text: str) -> str:
    return json.dumps(text)


def tool_call_dicts(fmt: ToolFormat, calls: list[ParsedCall]) -> list[dict[str, Any]]:
    """A message's `tool_calls`, as OpenAI writes them."""
    return [
        {
            "id": fmt.new_call_id(),
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in calls
    ]


class ToolCallStream:
    """One streamed choice: its growing content in, OpenAI chat deltas out. A call's first
    delta carries its index, id, type and name (arguments ""); argument fragments follow."""

    def __init__(self, fmt: ToolFormat, parser: CallParser, max_calls: int | None) -> None:
        self._fmt = fmt
        self._parser = parser
        self._max_calls = max_calls
        self._content = ""
        # Per call already announced: its id and how much of its arguments went out.
        self._sent: list[tuple[str, int]] = []

    @property
    def has_calls(self) -> bool:
        return bool(self._sent)

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """Mutates what has been sent; returns the new deltas, one per chunk."""
        parsed = self._parser.parse(text, final)
        out: list[dict[str, Any]] = []
        if len(parsed.content) > len(self._content):
            out.append({"content": parsed.content[len(self._content) :]})
            self._content = parsed.content
        for index, call in enumerate(parsed.calls[: self._max_calls]):
            if index == len(self._sent):
                self._sent.append((self._fmt.new_call_id(), 0))
                head = {"name": call.name, "arguments": ""}
                out.append(_call_delta(index, head, id=self._sent[index][0], type="function"))
            call_id, num_sent = self._sent[index]
            if len(call.arguments) > num_sent:
                fragment = {"arguments": call.arguments[num_sent:]}
                out.append(_call_delta(index, fragment))
                self._sent[index] = (call_id, len(call.arguments))
        return out


def _call_delta(index: int, function: dict[str, str], **head: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, **head, "function": function}]}


def join_content(segments: list[str | None], final: bool) -> str:
    """Joins the text between calls (None marks where a call stood): whitespace that
    touches a call is trimmed and text on both sides of calls is joined by one space;
    before the end, trailing whitespace waits (a call may follow it)."""
    pieces: list[str] = []
    after_call = False
    for i, segment in enumerate(segments):
        if segment is None:
            after_call = True
            continue
        if i > 0 and segments[i - 1] is None:
            segment = segment.lstrip(" \t\n\r")
        last = i == len(segments) - 1
        if (not last and segments[i + 1] is None) or (last and not final):
            segment = segment.rstrip(" \t\n\r")
        if segment:
            pieces.append(" " + segment if pieces and after_call else segment)
            after_call = False
    return "".join(pieces)


def without_partial(tail: str, markers: tuple[str, ...]) -> str:
    """Holds back the end of `tail` while it could still become one of `markers`."""
    longest = max(len(m) for m in markers)
    for size in range(min(longest - 1, len(tail)), 0, -1):
        if any(m.startswith(tail[-size:]) for m in markers):
            return tail[:-size]
    return tail
