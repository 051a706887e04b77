"""Mistral's calls, after the `[TOOL_CALLS]` control token, in either of its two shapes:

    [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]       (tokenizer v3 to v7: Nemo, Small 3.1)
    [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}            (v11 on: Small 3.2, Magistral)

Text before the first marker is content. Mistral's templates require call ids of nine
letters and digits."""

from __future__ import annotations

import json
import secrets
import string
from typing import TYPE_CHECKING

from server.tool_parsers.base import (
    TIGHT,
    CallParser,
    Parsed,
    ParsedCall,
    ToolFormat,
    call_schema,
    join_content,
    lark_literal,
    parameters_schema,
    without_partial,
)
from server.tool_parsers.json_scan import NotJson, ObjectScanner, Pending, read_call, skip_ws

if TYPE_CHECKING:
    from server.tools import Tool

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ID_CHARS = string.ascii_letters + string.digits


class MarkedCalls:
    """Calls after a marker, as a JSON array of call objects, or (with `named`) as
    `name[ARGS]{...}` calls each behind the marker. Text before the marker is content."""

    def __init__(self, marker: str, named: bool) -> None:
        self.marker = marker
        self.named = named

    def parse(self, text: str, final: bool) -> Parsed:
        start = text.find(self.marker)
        if start < 0:
            held = text if final else without_partial(text, (self.marker,))
            return Parsed(join_content([held], final), [])
        calls: list[ParsedCall] = []
        pos = skip_ws(text, start + len(self.marker))
        try:
            if pos < len(text) and text[pos] == "[":
                pos = self._array(text, pos + 1, final, calls)
            elif self.named:
                pos = self._named(text, pos, final, calls)
            elif pos == len(text) and not final:
                raise Pending
        except Pending:
            if final and not calls:
                return Parsed(text, [])
            return Parsed(join_content([text[:start], None], False), calls)
        if not calls:
            return Parsed(text, [])  # the marker starts no call: all of it is content
        return Parsed(join_content([text[:start], None, text[pos:]], final), calls)

    @staticmethod
    def _array(text: str, pos: int, final: bool, calls: list[ParsedCall]) -> int:
        """Reads `{call}, {call}]`; returns where the content after it starts."""
        while True:
            pos = skip_ws(text, pos)
            if pos == len(text):
                raise Pending
            try:
                name, arguments, end = read_call(text, pos, final, ("arguments", "parameters"))
            except NotJson:
                return pos
            calls.append(ParsedCall(name, arguments))
            pos = skip_ws(text, end)
            if pos == len(text):
                raise Pending
            if text[pos] == "]":
                return pos + 1
            if text[pos] != ",":
                return pos
            pos += 1

    @staticmethod
    def _named(text: str, pos: int, final: bool, calls: list[ParsedCall]) -> int:
        """Reads `name[ARGS]{...}` calls, each after the first behind another marker."""
        while True:
            args = text.find(ARGS, pos)
            # v13 writes `name[CALL_ID]id[ARGS]`; the id is the server's to give.
            name = text[pos:args].split(CALL_ID)[0].strip() if args >= 0 else ""
            if args < 0 or not name or any(c in name for c in "[]{}\n"):
                if args < 0 and not final and "\n" not in text[pos:]:
                    raise Pending
                return pos
            scanner = ObjectScanner(text, skip_ws(text, args + len(ARGS)))
            value_start = scanner.i
            try:
                scanner.skip_value()
                if scanner.i < len(text) and text[scanner.i] in "}]":
                    scanner.i += 1
            except Pending:
                calls.append(ParsedCall(name, text[value_start:]))
                if final:
                    return len(text)
                raise
            except NotJson:
                return pos
            calls.append(ParsedCall(name, text[value_start : scanner.i]))
            pos = scanner.i
            after = skip_ws(text, pos)
            if text.startswith(TOOL_CALLS, after):
                pos = after + len(TOOL_CALLS)
            elif not final and TOOL_CALLS.startswith(text[after:]):
                raise Pending
            else:
                return pos


class Mistral(ToolFormat):
    name = "mistral"
    marker = TOOL_CALLS
    token_markers = (TOOL_CALLS, ARGS)
    keep_special_tokens = True

    @staticmethod
    def recognises(template: str) -> bool:
        return TOOL_CALLS in template

    @property
    def named_shape(self) -> bool:
        return ARGS in self.template

    def parser(self, tools: list[Tool]) -> CallParser:
        return MarkedCalls(TOOL_CALLS, named=True)

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def calls_grammar(self, rules: list[str], many: bool) -> list[str]:
        call = f"call: {' | '.join(rules)}"
        if self.named_shape:
            return ["start: call+" if many else "start: call", call]
        body = '"[" call (", " call)* "]"' if many else '"[" call "]"'
        return [f"start: {self.lark(TOOL_CALLS)} {body}", call]

    def function_rule(self, index: int, tool: Tool) -> list[str]:
        if not self.named_shape:
            return [f"f{index}: %json {json.dumps(call_schema(tool))}"]
        head = f"{self.lark(TOOL_CALLS)} {lark_literal(tool.function.name)} {self.lark(ARGS)}"
        return [
            f"f{index}: {head} a{index}",
            f"a{index}: %json {json.dumps(parameters_schema(tool) | TIGHT)}",
        ]
