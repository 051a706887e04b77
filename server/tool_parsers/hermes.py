"""Hermes-style calls (Hermes, Qwen2.5, Qwen3, and the built-in prompt for templates without
tool support): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in free
text, whitespace around the JSON free. "parameters" is read as "arguments"."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from server.tool_parsers.base import (
    CallParser,
    ParsedCall,
    ToolFormat,
    call_schema,
)
from server.tool_parsers.json_scan import read_call
from server.tool_parsers.tagged import TaggedCalls

if TYPE_CHECKING:
    from server.tools import Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _read_body(text: str, start: int, final: bool) -> tuple[ParsedCall, int]:
    name, arguments, end = read_call(text, start, final, ("arguments", "parameters"))
    return ParsedCall(name, arguments), end


PARSER = TaggedCalls(OPEN, CLOSE, _read_body)


class Hermes(ToolFormat):
    name = "hermes"
    marker = OPEN
    token_markers = (OPEN, CLOSE)
    call_end = CLOSE

    @staticmethod
    def recognises(template: str) -> bool:
        return OPEN in template

    def parser(self, tools: list[Tool]) -> CallParser:
        return PARSER

    def calls_grammar(self, rules: list[str], many: bool) -> list[str]:
        head, tail = self.lark(OPEN + "\n"), self.lark("\n" + CLOSE)
        call = f"call: {head} ({' | '.join(rules)}) {tail}"
        return ['start: call ("\\n" call)*' if many else "start: call", call]

    def function_rule(self, index: int, tool: Tool) -> list[str]:
        return [f"f{index}: %json {json.dumps(call_schema(tool))}"]

    def system_prompt(self, tools: list[Tool]) -> str:
        listed = "\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in tools)
        return (
            "You can call functions to help with the user's request. The functions you may "
            f"call are listed, one JSON signature per line, between <tools> and </tools>:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "To call a function, answer with a JSON object holding its name and arguments "
            f"between {OPEN} and {CLOSE} tags:\n"
            f'{OPEN}\n{{"name": "function-name", "arguments": {{"argument": "value"}}}}\n{CLOSE}'
        )
