"""Pythonic calls (Llama 3.2 and 4's pythonic templates, ToolACE): the whole answer is a
Python list of calls with keyword arguments, optionally between `<|python_start|>` and
`<|python_end|>`:

    [get_weather(city="Paris", days=3), get_time(tz='UTC')]

Arguments become a JSON object built one keyword at a time, as each value is complete, so
the streamed arguments only grow: `{"city": "Paris"` then `, "days": 3` then `}`. Values
are Python literals (JSON's true/false/null are read too). An answer that does not start
with a call is content, and so is the text from where the list stops being calls.
"""

from __future__ import annotations

import ast
import json
import re
from typing import TYPE_CHECKING, Any

from server.tool_parsers.base import (
    TIGHT,
    CallParser,
    Parsed,
    ParsedCall,
    ToolFormat,
    join_content,
    lark_literal,
    parameters_schema,
)
from server.tool_parsers.json_scan import WS, NotJson, Pending, skip_ws

if TYPE_CHECKING:
    from server.tools import Tool

START, END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_JSON_WORDS = {"true": True, "false": False, "null": None}


def _value_end(text: str, i: int) -> int:
    """Where the Python literal starting at `i` ends (at a top-level "," or ")")."""
    stack: list[str] = []
    while True:
        if i >= len(text):
            raise Pending
        char = text[i]
        if char in "\"'":
            i = _string_end(text, i)
            continue
        if char in "([{":
            stack.append(char)
        elif char in ")]}":
            if not stack:
                if char == ")":
                    return i
                raise NotJson(i)
            stack.pop()
        elif char == "," and not stack:
            return i
        i += 1


def _string_end(text: str, i: int) -> int:
    quote = text[i]
    i += 1
    while True:
        if i >= len(text):
            raise Pending
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == quote:
            return i + 1
        if text[i] == "\n":
            raise NotJson(i)
        i += 1


def _literal(source: str, at: int) -> Any:
    source = source.strip()
    if source in _JSON_WORDS:
        return _JSON_WORDS[source]
    try:
        return ast.literal_eval(source)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        try:
            return json.loads(source)
        except json.JSONDecodeError:
            raise NotJson(at) from None


class _Call:
    """One call being read: its name and the JSON text of its complete arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pairs: list[str] = []
        self.closed = False

    def parsed(self, final: bool) -> ParsedCall:
        body = "{" + ", ".join(self.pairs)
        return ParsedCall(self.name, body + "}" if self.closed or final else body)


class _Parser:
    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        if text.startswith(START, i):
            i = skip_ws(text, i + len(START))
        elif not final and START.startswith(text[i:]):
            return Parsed("", [])
        calls: list[_Call] = []
        try:
            pos = self._list(text, i, calls)
        except Pending:
            if not calls and final:
                return Parsed(text, [])
            return Parsed("", [c.parsed(final) for c in calls])
        except NotJson as stop:
            pos = stop.at
        if not calls:
            return Parsed(text, [])
        tail = text[pos:]
        stripped = tail.lstrip(WS)
        if stripped.startswith(END):
            tail = stripped[len(END) :]
        elif not final and END.startswith(stripped):
            tail = ""
        return Parsed(join_content([None, tail], final), [c.parsed(final) for c in calls])

    def _list(self, text: str, i: int, calls: list[_Call]) -> int:
        """Reads `[call, call]` from `i`, appending to `calls` as they begin; returns the
        index after the list. Raises Pending at the text's end, NotJson where it breaks."""
        if i >= len(text):
            raise Pending
        if text[i] != "[":
            raise NotJson(i)
        i = skip_ws(text, i + 1)
        while True:
            name = _NAME.match(text, i)
            if name is None or name.end() == len(text):
                if i == len(text) or name is not None:
                    raise Pending
                raise NotJson(i)
            after = skip_ws(text, name.end())
            if after == len(text):
                raise Pending
            if text[after] != "(":
                raise NotJson(i)
            call = _Call(name.group())
            calls.append(call)
            i = self._arguments(text, after + 1, call)
            i = skip_ws(text, i)
            if i == len(text):
                raise Pending
            if text[i] == "]":
                return i + 1
            if text[i] != ",":
                raise NotJson(i)
            i = skip_ws(text, i + 1)

    @staticmethod
    def _arguments(text: str, i: int, call: _Call) -> int:
        """Reads `key=value, ...)`; returns the index after ")"."""
        while True:
            i = skip_ws(text, i)
            if i == len(text):
                raise Pending
            if text[i] == ")":
                call.closed = True
                return i + 1
            key = _NAME.match(text, i)
            if key is None:
                raise NotJson(i)
            equals = skip_ws(text, key.end())
            if equals == len(text):
                raise Pending
            if text[equals] != "=":
                raise NotJson(i)
            end = _value_end(text, equals + 1)
            value = _literal(text[equals + 1 : end], i)
            call.pairs.append(f"{json.dumps(key.group())}: {json.dumps(value, ensure_ascii=False)}")
            i = end + 1 if text[end] == "," else end


class Pythonic(ToolFormat):
    name = "pythonic"
    marker = START

    def looks_like_call(self, text: str) -> bool:
        return text.lstrip(WS).startswith(("[", START))

    @staticmethod
    def recognises(template: str) -> bool:
        # Llama 4's own template has <|python_start|> but asks for JSON calls.
        return "[func_name1(" in template

    def parser(self, tools: list[Tool]) -> CallParser:
        return _Parser()

    def calls_grammar(self, rules: list[str], many: bool) -> list[str]:
        body = '"[" call (", " call)* "]"' if many else '"[" call "]"'
        return [f"start: {body}", f"call: {' | '.join(rules)}"]

    def function_rule(self, index: int, tool: Tool) -> list[str]:
        """Required keyword arguments, in the schema's order, each a JSON value (which
        this parser reads back; Python would need True/False/None for the literals)."""
        schema = parameters_schema(tool)
        properties = schema.get("properties") or {}
        required = [k for k in properties if k in (schema.get("required") or [])]
        lines, parts = [], []
        for j, key in enumerate(required):
            lines.append(f"v{index}_{j}: %json {json.dumps(properties[key] | TIGHT)}")
            parts.append(f"{lark_literal(key + '=')} v{index}_{j}")
        body = [lark_literal(tool.function.name + "("), ' ", " '.join(parts), lark_literal(")")]
        return [f"f{index}: " + " ".join(piece for piece in body if piece), *lines]
