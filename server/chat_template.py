"""From chat messages to the conversation a chat template renders, tools included.

A template that knows about tools (it mentions `tools`) gets them as Hugging Face passes
them: `tools=[...]`, assistant `tool_calls` with their arguments as objects, `tool`
messages, and an assistant turn's thinking as `reasoning_content`. A template without tool
support (SmolLM2's) gets the built-in Hermes-style form (with --tool-call-parser hermes):
the tool list in the system message, past calls as <tool_call> blocks in the assistant's
text, and tool results as user messages wrapped in <tool_response> tags (a role every
template accepts).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from server.errors import OpenAIError
from server.messages import ChatMessage, ToolCall
from server.tool_parsers.hermes import CLOSE, OPEN
from server.tools import ToolPlan


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file holding a Jinja template, or the template itself. Raises
    ValueError for a value that is neither."""
    if value is None or not value.strip():
        return None
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    raise ValueError(f"{value!r} is neither a readable file nor a Jinja template")


def conversation(
    messages: list[ChatMessage], plan: ToolPlan | None, native_tools: bool
) -> list[dict[str, Any]]:
    if native_tools:
        return [_native(m) for m in messages]
    turns: list[dict[str, Any]] = []
    for message in messages:
        turn = _builtin(message)
        previous = turns[-1] if turns else None
        if message.role == "tool" and previous is not None and previous.get("tool_results"):
            previous["content"] += "\n" + turn["content"]
        else:
            turns.append(turn)
    for turn in turns:
        turn.pop("tool_results", None)
    if plan is not None:
        prompt = plan.fmt.system_prompt(plan.tools)
        if prompt is None:
            raise OpenAIError(
                400,
                f"this model's chat template has no tool support, and the {plan.fmt.name} "
                "tool format has no built-in prompt; give a tool-aware template with "
                "--chat-template, or use --tool-call-parser hermes",
                "tools",
            )
        _add_system_prompt(turns, prompt)
    return turns


def _named(message: ChatMessage, turn: dict[str, Any]) -> dict[str, Any]:
    return turn | ({"name": message.name} if message.name else {})


def _native(message: ChatMessage) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        turn["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name,
             "arguments": _arguments(c)}}
            for c in message.tool_calls
        ]  # fmt: skip
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    thinking = message.reasoning if message.reasoning is not None else message.reasoning_content
    if thinking is not None:
        turn["reasoning_content"] = thinking
    return _named(message, turn)


def _builtin(message: ChatMessage) -> dict[str, Any]:
    if message.role == "tool":
        content = f"<tool_response>\n{message.text()}\n</tool_response>"
        return {"role": "user", "content": content, "tool_results": True}
    text = message.text()
    for call in message.tool_calls or []:
        body = json.dumps({"name": call.function.name, "arguments": _arguments(call)})
        text += ("\n" if text else "") + f"{OPEN}\n{body}\n{CLOSE}"
    return _named(message, {"role": message.role, "content": text})


def _arguments(call: ToolCall) -> Any:
    """The arguments as an object when they are JSON (what templates expect), else as sent."""
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return call.function.arguments


def _add_system_prompt(turns: list[dict[str, Any]], prompt: str) -> None:
    if turns and turns[0]["role"] in ("system", "developer"):
        turns[0]["content"] = f"{turns[0]['content']}\n\n{prompt}".lstrip()
    else:
        turns.insert(0, {"role": "system", "content": prompt})
