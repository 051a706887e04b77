"""Llama 3.1-3.3's JSON calls: the whole answer is `{"name": ..., "parameters": {...}}`,
optionally after `<|python_tag|>`, several joined by ";". An answer that does not start
with a call object is content; text after the calls is content too."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from server.tool_parsers.base import (
    CallParser,
    Parsed,
    ParsedCall,
    ToolFormat,
    call_schema,
    join_content,
)
from server.tool_parsers.json_scan import WS, NotJson, Pending, read_call, skip_ws

if TYPE_CHECKING:
    from server.tools import Tool

PYTHON_TAG = "<|python_tag|>"
_ARGUMENTS = ("parameters", "arguments")


class _Parser:
    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]):
            return Parsed("", [])  # the tag, or the answer's first character, may follow
        if i == len(text) and not final:
            return Parsed("", [])
        calls: list[ParsedCall] = []
        pos = i
        while pos < len(text) and text[pos] == "{":
            try:
                name, arguments, end = read_call(text, pos, final, _ARGUMENTS)
            except Pending:
                return Parsed("", calls)
            except NotJson:
                break
            calls.append(ParsedCall(name, arguments))
            after = skip_ws(text, end)
            if after < len(text) and text[after] == ";":
                after = skip_ws(text, after + 1)
            elif after == len(text) and not final:
                return Parsed("", calls)  # a ";" and another call may follow
            pos = after
            if pos == len(text):
                return Parsed("", calls)
        if not calls:
            return Parsed(text, [])
        return Parsed(join_content([None, text[pos:]], final), calls)


class Llama3Json(ToolFormat):
    name = "llama3_json"
    marker = PYTHON_TAG

    def looks_like_call(self, text: str) -> bool:
        return text.lstrip(WS).startswith(("{", PYTHON_TAG))

    @staticmethod
    def recognises(template: str) -> bool:
        return PYTHON_TAG in template or '"parameters": dictionary of argument name' in template

    def parser(self, tools: list[Tool]) -> CallParser:
        return _Parser()

    def calls_grammar(self, rules: list[str], many: bool) -> list[str]:
        return ['start: call ("; " call)*' if many else "start: call", f"call: {' | '.join(rules)}"]

    def function_rule(self, index: int, tool: Tool) -> list[str]:
        return [f"f{index}: %json {json.dumps(call_schema(tool, 'parameters'))}"]
