"""Chat messages as the OpenAI SDK sends them, validated at the edge.

Text is the only content this server reads: a content part of another type (image_url,
input_audio, file, ...) is a 400 that names the part's type and where it is, rather than a
pydantic path. Assistant messages may carry `refusal`, `tool_calls` (then `content` may be
null) and their thinking (`reasoning`, or `reasoning_content`); tool results come as
`role: tool` with the `tool_call_id` they answer.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from server.errors import OpenAIError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ContentPart(BaseModel):
    """Any content part; only `text` parts (and `refusal` parts of assistant messages) pass
    `check_messages`. Other fields are kept so that unknown part types reach the check."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    refusal: str | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # An assistant turn's thinking, as this server returns it (`reasoning`) or under the
    # older name (`reasoning_content`); templates read it as `reasoning_content`.
    reasoning: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        """What the model reads: the text (a refusal is what the assistant said)."""
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or part.refusal or "" for part in self.content)


def check_messages(messages: list[ChatMessage]) -> None:
    """Raises OpenAIError 400, naming the field, for a message this server cannot read."""
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        _check_parts(message, where)
        if message.role == "tool" and not message.tool_call_id:
            raise OpenAIError(
                400, "a tool message needs the tool_call_id it answers", f"{where}.tool_call_id"
            )
        for field in ("tool_calls", "refusal", "reasoning", "reasoning_content"):
            if getattr(message, field) is not None and message.role != "assistant":
                raise OpenAIError(400, f"only assistant messages carry {field}", f"{where}.{field}")
        if message.tool_call_id is not None and message.role != "tool":
            raise OpenAIError(400, "only tool messages carry tool_call_id", f"{where}.tool_call_id")


def _check_parts(message: ChatMessage, where: str) -> None:
    if not isinstance(message.content, list):
        return
    allowed = {"text", "refusal"} if message.role == "assistant" else {"text"}
    for j, part in enumerate(message.content):
        param = f"{where}.content[{j}]"
        if part.type not in allowed:
            raise OpenAIError(
                400,
                f"content parts of type '{part.type}' are not supported: this model reads "
                f"text only ({' and '.join(sorted(allowed))} parts in {message.role} messages)",
                f"{param}.type",
            )
        if part.type == "text" and part.text is None:
            raise OpenAIError(400, "a text content part needs its text", f"{param}.text")
