"""Reasoning parsers: a model's thinking, split from its answer, the same way whole or
streamed.

    --reasoning-parser   thinking                                  opened by
    qwen3                <think> ... </think> answer               the model (or the prompt)
    deepseek_r1          [<think>] ... </think> answer             the prompt, always assumed
    granite              Here is my thought process: ...           the model
                         Here is my response: answer
                         (or Granite 3.3's <think>...</think><response>answer</response>)

Where the output starts is read from the end of the prompt: a prompt that ends with an
opening marker started the reasoning (DeepSeek-R1's template, Qwen3-Thinking's), one that
ends with a closing marker has none (Qwen3 with `enable_thinking: false`). `split(text,
final)` is a pure function of the text so far that only grows as the text does, so a
stream of differences reassembles the final split. Both parts lose the whitespace at their
edges.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from engine import ReasoningBounds
from server.tool_parsers.base import without_partial

_WS = " \t\n\r"
Phase = Literal["open", "maybe", "closed"]


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # None: the output has no reasoning (yet)
    content: str
    ended: bool  # the reasoning has ended (or there is none): what follows is the answer


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    starts: tuple[str, ...]
    ends: tuple[str, ...]
    # DeepSeek-R1: the output is reasoning until the end marker, whether or not it opens.
    always_open: bool = False
    # Granite 3.3 wraps the answer in tags.
    answer_tags: tuple[str, str] | None = None

    def phase(self, prompt_tail: str) -> Phase:
        """Where an output starts, from the end of its prompt's text."""
        tail = prompt_tail.rstrip(_WS)
        if any(tail.endswith(end) for end in self.ends):
            return "closed"
        if self.always_open or any(tail.endswith(start) for start in self.starts):
            return "open"
        return "maybe"

    def split(self, text: str, final: bool, phase: Phase) -> Split:
        if phase == "closed":
            return Split(None, self._answer(text, final), True)
        body = text.lstrip(_WS)
        start = next((s for s in self.starts if body.startswith(s)), None)
        if start is not None:
            body = body[len(start) :]
        elif not final and any(s.startswith(body) for s in self.starts):
            return Split(None, "", False)  # an opening marker may be coming
        elif phase == "maybe":
            return Split(None, self._answer(text, final), True)
        found = [(body.find(end), end) for end in self.ends if end in body]
        if not found:
            thinking = body if final else without_partial(body, self.ends)
            return Split(thinking.strip(_WS), "", False)
        at, end = min(found)
        return Split(body[:at].strip(_WS), self._answer(body[at + len(end) :], final), True)

    def _answer(self, text: str, final: bool) -> str:
        text = text.lstrip(_WS)
        if self.answer_tags is None:
            return text
        open_tag, close_tag = self.answer_tags
        if text.startswith(open_tag):
            text = text[len(open_tag) :].lstrip(_WS)
        elif not final and open_tag.startswith(text):
            return ""
        cut = text.find(close_tag)
        if cut >= 0:
            return text[:cut].rstrip(_WS)
        return text if final else without_partial(text, (close_tag,))

    def bounds(self, tokenizer: Any, phase: Phase) -> ReasoningBounds | None:
        """What the engine needs to start a grammar after the reasoning (None: from the
        first token). Opening markers count only as single tokens."""
        if phase == "closed":
            return None
        ends = tuple(tuple(tokenizer.encode(e, add_special_tokens=False)) for e in self.ends)
        starts = [tokenizer.encode(s, add_special_tokens=False) for s in self.starts]
        single = tuple(ids[0] for ids in starts if len(ids) == 1)
        return ReasoningBounds(ends, single, opened=phase == "open")


_THINK = ("<think>",), ("</think>",)
FORMATS = {
    "qwen3": ReasoningFormat("qwen3", *_THINK),
    "deepseek_r1": ReasoningFormat("deepseek_r1", *_THINK, always_open=True),
    "granite": ReasoningFormat(
        "granite",
        ("<think>", "Here is my thought process:", "Here's my thought process:"),
        ("</think>", "Here is my response:", "Here's my response:"),
        answer_tags=("<response>", "</response>"),
    ),
}


def reasoning_tokens(
    token_ids: list[int], decode: Callable[[list[int]], str], fmt: ReasoningFormat, phase: Phase
) -> int:
    """How many of the output's tokens are reasoning, its end marker included: the shortest
    prefix whose text has ended the reasoning (all of them if it never ends)."""
    whole = fmt.split(decode(token_ids), True, phase)
    if whole.reasoning is None:
        return 0
    if not whole.ended:
        return len(token_ids)
    low, high = 1, len(token_ids)
    while low < high:
        middle = (low + high) // 2
        if fmt.split(decode(token_ids[:middle]), False, phase).ended:
            high = middle
        else:
            low = middle + 1
    return low
