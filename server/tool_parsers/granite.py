"""Granite 3.x's calls: `<|tool_call|>` then a JSON array of call objects, after any text:

<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from server.tool_parsers.base import CallParser, ToolFormat, call_schema
from server.tool_parsers.mistral import MarkedCalls

if TYPE_CHECKING:
    from server.tools import Tool

TOOL_CALL = "<|tool_call|>"


class Granite(ToolFormat):
    name = "granite"
    marker = TOOL_CALL
    token_markers = (TOOL_CALL,)
    keep_special_tokens = True

    @staticmethod
    def recognises(template: str) -> bool:
        return TOOL_CALL in template

    def parser(self, tools: list[Tool]) -> CallParser:
        return MarkedCalls(TOOL_CALL, named=False)

    def calls_grammar(self, rules: list[str], many: bool) -> list[str]:
        body = '"[" call (", " call)* "]"' if many else '"[" call "]"'
        return [f"start: {self.lark(TOOL_CALL)} {body}", f"call: {' | '.join(rules)}"]

    def function_rule(self, index: int, tool: Tool) -> list[str]:
        return [f"f{index}: %json {json.dumps(call_schema(tool))}"]
