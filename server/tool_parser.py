"""Hermes-style tool calls in model output, parsed the same way whole or streamed.

A call is written `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (whitespace
around the JSON is free). `parse(text, final)` is a pure function of the text so far; with
`final=False` it reports only what no continuation of the text can change:

    text so far                                   content      calls
    'Sure. <tool_c'                               'Sure.'      []           (tag may follow)
    'Sure. <tool_call>{"name": "f", "argum'       'Sure.'      [f, '']
    'Sure. <tool_call>{"name": "f", "arguments": {"a": 1'
                                                  'Sure.'      [f, '{"a": 1']
    ... '}}</tool_call> Done'  (final)            'Sure. Done' [f, '{"a": 1}']

Each report extends the previous one (content and arguments only grow), so a stream that
sends the differences reassembles exactly the final parse, however the text was chunked.
`arguments` is the model's own JSON text, not a re-serialisation, for the same reason. A
block whose name cannot be read (not JSON, no name) is content. Text around calls loses the
whitespace that touches them (pieces on both sides are joined by one space); with no call
at all the content is the text unchanged.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_WS = " \t\n\r"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str


@dataclass(frozen=True)
class Parsed:
    content: str
    calls: list[ParsedCall]


class _Pending(Exception):
    """The text ends before the block's name could be read."""


class _NotACall(Exception):
    """The block is not a call (it becomes content); `at` is where reading stopped."""

    def __init__(self, at: int = 0) -> None:
        super().__init__(at)
        self.at = at


def parse(text: str, final: bool) -> Parsed:
    # Content pieces between calls; None marks where a call stood.
    segments: list[str | None] = []
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        if start < 0:
            segments.append(text[pos:] if final else _without_partial_tag(text[pos:]))
            break
        body = start + len(OPEN)
        call: ParsedCall | None
        try:
            call, read = _read_call(text[body:], final)
        except _Pending:
            segments.append(text[pos:start])
            break
        except _NotACall as failed:
            call, read = None, failed.at
        # The block ends at the first CLOSE after what was read (one inside a JSON string of
        # the call is the call's text, not its end).
        end = text.find(CLOSE, body + read)
        block_end = len(text) if end < 0 else end + len(CLOSE)
        if call is None:
            segments.append(text[pos:block_end])
        else:
            calls.append(call)
            segments += [text[pos:start], None]
        if end < 0:
            break
        pos = block_end
    return Parsed(_content(segments, final), calls)


def _without_partial_tag(tail: str) -> str:
    """Holds back the end of `tail` while it could still become OPEN."""
    for size in range(min(len(OPEN) - 1, len(tail)), 0, -1):
        if OPEN.startswith(tail[-size:]):
            return tail[:-size]
    return tail


def _content(segments: list[str | None], final: bool) -> str:
    """Joins the text between calls: whitespace that touches a call is trimmed and text on
    both sides of calls is joined by one space; before the end, trailing whitespace waits
    (a call may follow it)."""
    pieces: list[str] = []
    after_call = False
    for i, segment in enumerate(segments):
        if segment is None:
            after_call = True
            continue
        if i > 0 and segments[i - 1] is None:
            segment = segment.lstrip(_WS)
        last = i == len(segments) - 1
        if (not last and segments[i + 1] is None) or (last and not final):
            segment = segment.rstrip(_WS)
        if segment:
            pieces.append(" " + segment if pieces and after_call else segment)
            after_call = False
    return "".join(pieces)


def _read_call(body: str, final: bool) -> tuple[ParsedCall, int]:
    """The call at the start of a block's body, and how far into the body it was read;
    raises _Pending or _NotACall.

    Once the name has been read the block is a call, whatever follows (the decision never
    changes as the text grows); before that, a block that breaks JSON is content."""
    scanner = _ObjectScanner(body)
    read_whole = True
    try:
        scanner.fields()
    except _Pending:
        read_whole = False
        if not final and not isinstance(scanner.found.get("name"), str):
            raise
    except _NotACall:
        pass  # what follows the break cannot change what was read before it
    name = scanner.found.get("name")
    if not isinstance(name, str):
        raise _NotACall(scanner.i)
    arguments = scanner.raw.get("arguments", scanner.raw.get("parameters"))
    if arguments is None:
        # A whole call without arguments takes none; a cut-off one has shown none yet.
        arguments = "{}" if read_whole else ""
    return ParsedCall(name, arguments), scanner.i


class _ObjectScanner:
    """Reads the top level of a JSON object: string values decoded (`found`), every value's
    raw text (`raw`, partial for a value the text cuts off)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.i = 0
        self.found: dict[str, object] = {}
        self.raw: dict[str, str] = {}

    def fields(self) -> None:
        self._skip_ws()
        self._expect("{")
        while True:
            self._skip_ws()
            if self._peek() == "}":
                return
            key = self._string()
            self._skip_ws()
            self._expect(":")
            self._skip_ws()
            self._value(key)
            self._skip_ws()
            if self._peek() == ",":
                self.i += 1
            elif self._peek() == "}":
                return
            else:
                raise _NotACall

    def _peek(self) -> str:
        if self.i >= len(self.text):
            raise _Pending
        return self.text[self.i]

    def _skip_ws(self) -> None:
        while self.i < len(self.text) and self.text[self.i] in _WS:
            self.i += 1

    def _expect(self, char: str) -> None:
        if self._peek() != char:
            raise _NotACall
        self.i += 1

    def _string(self) -> str:
        start = self.i
        self._expect('"')
        while self._peek() != '"':
            self.i += 2 if self.text[self.i] == "\\" else 1
        self.i += 1
        try:
            return str(json.loads(self.text[start : self.i]))
        except json.JSONDecodeError:
            raise _NotACall from None

    def _value(self, key: str) -> None:
        start = self.i
        try:
            if self._peek() == '"':
                self.found[key] = self._string()
            else:
                self._skip_value()
        finally:
            self.raw[key] = self.text[start : self.i]

    def _skip_value(self) -> None:
        """An object, array, number or literal; strings inside are skipped whole."""
        depth = 0
        while True:
            char = self._peek()
            if char == '"':
                self._string()
                continue
            if char in "{[":
                depth += 1
            elif char in "}]":
                if depth == 0:
                    return
                depth -= 1
            elif depth == 0 and (char in _WS or char == ","):
                return
            self.i += 1
            if depth == 0 and char in "}]":
                return


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tool_call_dicts(calls: list[ParsedCall]) -> list[dict[str, Any]]:
    """A message's `tool_calls`, as OpenAI writes them."""
    return [
        {
            "id": new_call_id(),
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in calls
    ]


class ToolCallStream:
    """One streamed choice: its growing text in, OpenAI chat deltas out. A call's first
    delta carries its index, id, type and name (arguments ""); argument fragments follow."""

    def __init__(self) -> None:
        self._content = ""
        # Per call already announced: its id and how much of its arguments went out.
        self._sent: list[tuple[str, int]] = []

    @property
    def has_calls(self) -> bool:
        return bool(self._sent)

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """Mutates what has been sent; returns the new deltas, one per chunk."""
        parsed = parse(text, final)
        out: list[dict[str, Any]] = []
        if len(parsed.content) > len(self._content):
            out.append({"content": parsed.content[len(self._content) :]})
            self._content = parsed.content
        for index, call in enumerate(parsed.calls):
            if index == len(self._sent):
                self._sent.append((new_call_id(), 0))
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
