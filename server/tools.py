"""Tool calling: the `tools`, `tool_choice` and `parallel_tool_calls` fields, and what they
make the engine do.

`auto` lets the model write calls itself (the server's tool format reads them back, see
server/tool_parsers/); `required` and a named function are enforced by the format's
grammar, so the answer is always well-formed calls whose arguments match the function's
JSON schema. For Hermes:

    start: call ("\\n" call)*          (just `call` for a named function or no parallel calls)
    call: "<tool_call>\\n" (f0 | f1 | ...) "\\n</tool_call>"
    f0: %json {"properties": {"name": {"const": "get_weather"}, "arguments": <schema>}, ...}

With `parallel_tool_calls: false` under `auto`, generation stops after the first call where
the format marks a call's end, and only the first call is returned otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine import StructuredOutputsParams
from server.errors import OpenAIError
from server.structured import Constraint
from server.tool_parsers import CallParser, ToolCallStream, ToolFormat


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
    """The tools a request offers the model, how it must use them, and the format (the
    model family's) that its calls are written and read in."""

    tools: list[Tool]
    mode: Literal["auto", "required", "named"]
    parallel: bool
    fmt: ToolFormat
    named: str | None = None

    def constraint(self) -> Constraint | None:
        """The grammar of `required` and named choice; None for `auto`."""
        if self.mode == "auto":
            return None
        offered = [t for t in self.tools if self.named in (None, t.function.name)]
        many = self.parallel and self.mode == "required"
        grammar = self.fmt.grammar(offered, many)
        return Constraint(StructuredOutputsParams(grammar=grammar), "tools")

    def stop(self) -> tuple[str, ...]:
        """Stop strings the plan adds: under `auto` without parallel calls, the end of the
        first call ends generation, where the format marks it."""
        single = self.mode == "auto" and not self.parallel
        return (self.fmt.call_end,) if single and self.fmt.call_end else ()

    @property
    def max_calls(self) -> int | None:
        """Calls a choice may return: one without parallel calls."""
        return None if self.parallel else 1

    def parser(self) -> CallParser:
        return self.fmt.parser(self.tools)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.fmt, self.parser(), self.max_calls)


def plan_tools(
    tools: list[Tool] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    fmt: ToolFormat | None,
    refusal: str,
) -> ToolPlan | None:
    """None when the model gets no tools (none given, or tool_choice "none"). Raises
    OpenAIError 400 naming the field for a choice that cannot be met, and with `refusal`
    when the server has no tool format."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise OpenAIError(400, "tool_choice needs tools", "tool_choice")
        return None
    if fmt is None:
        raise OpenAIError(400, refusal, "tools")
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
        return ToolPlan(tools, "named", parallel, fmt, choice.function.name)
    return ToolPlan(tools, choice, parallel, fmt)
