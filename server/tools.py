"""Tool calling: the `tools`, `tool_choice` and `parallel_tool_calls` fields, and what they
make the engine do.

`auto` lets the model write calls itself (the Hermes parser reads them back, see
server/tool_parser.py); `required` and a named function are enforced by a grammar, so the
answer is always well-formed calls whose arguments match the function's JSON schema:

    start: call ("\\n" call)*          (just `call` for a named function or no parallel calls)
    call: "<tool_call>\\n" (f0 | f1 | ...) "\\n</tool_call>"
    f0: %json {"properties": {"name": {"const": "get_weather"}, "arguments": <schema>}, ...}

With `parallel_tool_calls: false` under `auto`, generation stops after the first call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine import StructuredOutputsParams
from server.errors import OpenAIError
from server.structured import Constraint
from server.tool_parser import CLOSE, OPEN


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolPlan:
    """The tools a request offers the model and how it must use them."""

    tools: list[Tool]
    mode: Literal["auto", "required", "named"]
    parallel: bool
    named: str | None = None

    def constraint(self) -> Constraint | None:
        """The grammar of `required` and named choice; None for `auto`."""
        if self.mode == "auto":
            return None
        offered = [t for t in self.tools if self.named in (None, t.function.name)]
        rules = [f"f{i}: %json {json.dumps(_call_schema(t))}" for i, t in enumerate(offered)]
        alternatives = " | ".join(f"f{i}" for i in range(len(offered)))
        start = (
            'start: call ("\\n" call)*'
            if self.parallel and self.mode == "required"
            else ("start: call")
        )
        call = f"call: {json.dumps(OPEN + chr(10))} ({alternatives}) {json.dumps(chr(10) + CLOSE)}"
        grammar = "\n".join([start, call, *rules])
        return Constraint(StructuredOutputsParams(grammar=grammar), "tools")

    def stop(self) -> tuple[str, ...]:
        """Stop strings the plan adds: under `auto` without parallel calls, the first
        call's closing tag ends generation."""
        return (CLOSE,) if self.mode == "auto" and not self.parallel else ()

    def system_prompt(self) -> str:
        """The built-in Hermes-style instructions, for chat templates without tool support."""
        listed = "\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in self.tools)
        return (
            "You can call functions to help with the user's request. The functions you may "
            f"call are listed, one JSON signature per line, between <tools> and </tools>:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "To call a function, answer with a JSON object holding its name and arguments "
            f"between {OPEN} and {CLOSE} tags:\n"
            f'{OPEN}\n{{"name": "function-name", "arguments": {{"argument": "value"}}}}\n{CLOSE}'
        )


def _call_schema(tool: Tool) -> dict[str, Any]:
    """One function's call as a JSON schema; the parameters' $defs move to its root, where
    their "#/$defs/..." references point."""
    parameters = dict(tool.function.parameters or {"type": "object", "properties": {}})
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},
    }
    for defs in ("$defs", "definitions"):
        if defs in parameters:
            schema[defs] = parameters.pop(defs)
    return schema


def plan_tools(
    tools: list[Tool] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    parser: str,
) -> ToolPlan | None:
    """None when the model gets no tools (none given, or tool_choice "none"). Raises
    OpenAIError 400 naming the field for a choice that cannot be met."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise OpenAIError(400, "tool_choice needs tools", "tool_choice")
        return None
    if parser == "none":
        raise OpenAIError(
            400, "tool calling is off on this server (--tool-call-parser none)", "tools"
        )
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise OpenAIError(400, "tool function names must be unique", "tools")
    choice = tool_choice or "auto"
    if choice == "none":
        return None
    parallel = parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise OpenAIError(
                400,
                f"tool_choice names function '{choice.function.name}', which is not in tools",
                "tool_choice.function.name",
            )
        return ToolPlan(tools, "named", parallel, choice.function.name)
    return ToolPlan(tools, choice, parallel)
