"""One chat choice's text, read as the message a client gets: the reasoning (with a
reasoning parser), the answer's content, and its tool calls (with tools), whole or as
stream deltas that add up to exactly the whole.

    text --reasoning format--> reasoning | answer --tool format--> content | tool_calls
"""

from __future__ import annotations

import json
import logging
from typing import Any

from server.reasoning import Phase, ReasoningFormat
from server.tool_parsers import ToolCallStream, tool_call_dicts
from server.tools import ToolPlan

logger = logging.getLogger(__name__)


class ChoiceReader:
    def __init__(
        self, reasoning: ReasoningFormat | None, phase: Phase, plan: ToolPlan | None
    ) -> None:
        self.reasoning = reasoning
        self.phase = phase
        self.plan = plan
        self._calls: ToolCallStream | None = None if plan is None else plan.stream()
        self._reasoning_sent = 0
        self._content_sent = 0

    def _split(self, text: str, final: bool) -> tuple[str | None, str]:
        if self.reasoning is None:
            return None, text
        split = self.reasoning.split(text, final, self.phase)
        return split.reasoning, split.content

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], bool]:
        """The message's fields, and whether it holds tool calls."""
        reasoning, answer = self._split(text, True)
        fields: dict[str, Any] = {"content": answer}
        if self.reasoning is not None:
            fields["reasoning"] = reasoning
        if self.plan is None:
            return fields, False
        parsed = self.plan.parser().parse(answer, True)
        calls = parsed.calls[: self.plan.max_calls]
        broken = calls and finish_reason == "stop" and not all(_is_json(c.arguments) for c in calls)
        if broken or (not calls and self.plan.fmt.looks_like_call(answer)):
            # The format and the size only: log lines never carry a request's text.
            logger.warning(
                "unparseable %s tool call returned as content (%d characters)",
                self.plan.fmt.name,
                len(answer),
            )
        if broken or not calls:
            return fields, False
        fields["content"] = parsed.content or None
        fields["tool_calls"] = tool_call_dicts(self.plan.fmt, calls)
        return fields, True

    @property
    def has_calls(self) -> bool:
        return self._calls is not None and self._calls.has_calls

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """Mutates what has been sent; the new deltas, one per chunk."""
        reasoning, answer = self._split(text, final)
        out: list[dict[str, Any]] = []
        if reasoning is not None and len(reasoning) > self._reasoning_sent:
            out.append({"reasoning": reasoning[self._reasoning_sent :]})
            self._reasoning_sent = len(reasoning)
        if self._calls is not None:
            return out + self._calls.deltas(answer, final)
        if len(answer) > self._content_sent:
            out.append({"content": answer[self._content_sent :]})
            self._content_sent = len(answer)
        return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
