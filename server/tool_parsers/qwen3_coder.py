"""Qwen3-Coder's XML calls, as tagged blocks in free text:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Values are raw text (one newline on each side is the format's); each becomes a JSON value
by the parameter's type in the tool's schema: a string stays text, anything else is read
as JSON (then as a Python literal), falling back to text. Arguments are built one
parameter at a time, as each closes, so streamed arguments only grow.
"""

from __future__ import annotations

import ast
import json
from typing import TYPE_CHECKING, Any

from server.tool_parsers.base import (
    TIGHT,
    CallParser,
    ParsedCall,
    ToolFormat,
    lark_literal,
    parameters_schema,
)
from server.tool_parsers.json_scan import NotJson, Pending, skip_ws
from server.tool_parsers.tagged import TaggedCalls

if TYPE_CHECKING:
    from server.tools import Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


def _expect(text: str, i: int, literal: str) -> int:
    """The index after `literal` at `i`; Pending while the text could still become it."""
    if text.startswith(literal, i):
        return i + len(literal)
    if literal.startswith(text[i:]):
        raise Pending
    raise NotJson(i)


def _header(text: str, i: int) -> tuple[str, int]:
    """A tag's `NAME>`: the name and the index after ">"."""
    close = text.find(">", i)
    newline = text.find("\n", i)
    if close < 0:
        if newline >= 0:
            raise NotJson(i)
        raise Pending
    if 0 <= newline < close or close == i:
        raise NotJson(i)
    return text[i:close].strip(), close + 1


def typed(raw: str, schema: dict[str, Any] | None) -> Any:
    kinds = (schema or {}).get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "string" in kinds and len([k for k in kinds if k != "null"]) == 1:
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        try:
            return ast.literal_eval(raw)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return raw


class _Reader:
    """Reads one block's body, typing values by the request's tools."""

    def __init__(self, tools: list[Tool]) -> None:
        self._properties = {
            t.function.name: parameters_schema(t).get("properties") or {} for t in tools
        }

    def __call__(self, text: str, start: int, final: bool) -> tuple[ParsedCall, int]:
        i = _expect(text, skip_ws(text, start), FUNCTION)
        name, i = _header(text, i)
        properties = self._properties.get(name, {})
        pairs: list[str] = []
        while True:
            try:
                i = skip_ws(text, i)
                if text.startswith(FUNCTION_END, i) or text.startswith(CLOSE, i):
                    end = i + len(FUNCTION_END) if text.startswith(FUNCTION_END, i) else i
                    return ParsedCall(name, "{" + ", ".join(pairs) + "}"), end
                i = _expect(text, i, PARAMETER)
                key, i = _header(text, i)
                value_end = text.find(PARAMETER_END, i)
                if value_end < 0:
                    raise Pending
            except Pending:
                body = "{" + ", ".join(pairs)
                return ParsedCall(name, body + "}" if final else body), len(text)
            except NotJson:
                return ParsedCall(name, "{" + ", ".join(pairs) + "}"), i
            raw = text[i:value_end]
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            value = typed(raw, properties.get(key))
            pairs.append(f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
            i = value_end + len(PARAMETER_END)


class Qwen3Coder(ToolFormat):
    name = "qwen3_coder"
    marker = OPEN
    token_markers = (OPEN, CLOSE)
    call_end = CLOSE

    @staticmethod
    def recognises(template: str) -> bool:
        return FUNCTION in template and PARAMETER in template

    def parser(self, tools: list[Tool]) -> CallParser:
        return TaggedCalls(OPEN, CLOSE, _Reader(tools))

    def calls_grammar(self, rules: list[str], many: bool) -> list[str]:
        call = f"call: {self.lark(OPEN + chr(10))} ({' | '.join(rules)}) {self.lark(CLOSE)}"
        return ['start: call ("\\n" call)*' if many else "start: call", call]

    def function_rule(self, index: int, tool: Tool) -> list[str]:
        """Required parameters, in the schema's order (see `_value`)."""
        schema = parameters_schema(tool)
        properties = schema.get("properties") or {}
        required = [k for k in properties if k in (schema.get("required") or [])]
        lines, parts = [], []
        for j, key in enumerate(required):
            rule = f"v{index}_{j}"
            lines.append(f"{rule}: {_value(properties[key])}")
            head = lark_literal(f"{PARAMETER}{key}>\n")
            parts.append(f"{head} {rule} {lark_literal(chr(10) + PARAMETER_END + chr(10))}")
        head = lark_literal(f"{FUNCTION}{tool.function.name}>\n")
        tail = lark_literal(FUNCTION_END + "\n")
        return [f"f{index}: {' '.join([head, *parts, tail])}", *lines]


def _value(schema: dict[str, Any]) -> str:
    """A parameter value's grammar: strings are raw text (one of an enum's values, or one
    line without "<", as long as the schema allows), other types JSON."""
    if schema.get("type") != "string":
        return f"%json {json.dumps(schema | TIGHT)}"
    if "enum" in schema:
        return " | ".join(lark_literal(str(v)) for v in schema["enum"])
    low = max(1, int(schema.get("minLength", 1)))
    high = schema.get("maxLength")
    return f"/[^<\\n]{{{low},{'' if high is None else int(high)}}}/"
