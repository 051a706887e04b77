"""A request's grammar state, as the scheduler and the worker see it (pure Python).

The scheduler only asks whether the grammar is compiled (`ready`) and advances it with each
accepted token (`advance`); the worker only asks for the next-token bitmask. Neither knows
which grammar engine is behind the `GrammarMatcher` protocol.
"""

from __future__ import annotations

import ctypes
import logging
from concurrent.futures import Future
from typing import Protocol

from engine.structured_output.params import ReasoningBounds

logger = logging.getLogger(__name__)


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def accept_token(self, token_id: int) -> bool:
        """Advances by one token; False when the grammar does not allow it."""
        ...

    def is_terminated(self) -> bool:
        """True once the grammar allows nothing more (it is complete, or broken)."""
        ...

    def fill_bitmask(self, address: int, num_bytes: int) -> None:
        """Writes the allowed next tokens at `address`: bit t % 32 of 32-bit word t // 32
        is set iff token t is allowed. `num_bytes` is 4 * ceil(vocab_size / 32)."""
        ...

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, from the first, the grammar allows in turn; consumes
        nothing."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Takes back the last `num_tokens` accepted tokens."""
        ...


class CompiledGrammar(Protocol):
    """A grammar compiled once and shared by every request with the same constraint."""

    def new_matcher(self) -> GrammarMatcher: ...


class StructuredOutputRequest:
    r"""Waits for its grammar's compilation (on the manager's threads), then owns a matcher.

    With reasoning bounds the output goes through phases; only the last is constrained:

        "maybe" --start token--> "reasoning" --end tokens--> "grammar"
           \--------------any other first token--------------^

    Preemption needs nothing here: it keeps the request's output tokens, and the phase and
    matcher have seen exactly those, so they stay right when the request resumes.
    """

    def __init__(
        self, compiled: Future[CompiledGrammar], reasoning: ReasoningBounds | None = None
    ) -> None:
        self.compiled = compiled
        self.matcher: GrammarMatcher | None = None
        self.error: BaseException | None = None
        self.reasoning = reasoning
        if reasoning is None:
            self.phase = "grammar"
        else:
            self.phase = "reasoning" if reasoning.opened else "maybe"
        self._recent: list[int] = []  # the reasoning's last tokens, to match its end

    def constrains_next(self) -> bool:
        """Whether the next token is masked (not while reasoning)."""
        return self.phase != "reasoning"

    def fill_bitmask(self, address: int, num_bytes: int) -> None:
        """The matcher's bitmask, plus the tokens that may open reasoning where that is
        still possible (see GrammarMatcher.fill_bitmask for the layout)."""
        assert self.matcher is not None, "mask requested before the grammar was ready"
        self.matcher.fill_bitmask(address, num_bytes)
        if self.phase == "maybe" and self.reasoning is not None:
            for token in self.reasoning.start_ids:
                word = ctypes.c_uint32.from_address(address + 4 * (token // 32))
                word.value |= 1 << (token % 32)

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar allows from here (speculative
        decoding). Inside reasoning, which the grammar does not see: the drafts before the
        one that would end it, so that every verified position is unconstrained (the
        target model may still end it there itself). None while the output may still open
        reasoning."""
        if self.phase == "reasoning" and self.reasoning is not None:
            return drafts[: self._reasoning_room(self.reasoning, drafts)]
        if self.matcher is None or self.phase != "grammar" or self.matcher.is_terminated():
            return []
        return drafts[: self.matcher.validate_tokens(drafts)]

    def _reasoning_room(self, bounds: ReasoningBounds, drafts: list[int]) -> int:
        """How many of `drafts`, from the first, leave the reasoning open."""
        recent = list(self._recent)
        for i, token in enumerate(drafts):
            recent.append(token)
            if any(tuple(recent[-len(end) :]) == end for end in bounds.end_ids):
                return i
        return len(drafts)

    def fill_draft_bitmasks(self, drafts: list[int], addresses: list[int], num_bytes: int) -> None:
        """The bitmask before each draft and after the last (len(drafts) + 1 addresses):
        the matcher accepts the drafts one by one, then rolls them all back. The drafts
        must be valid_drafts'."""
        assert self.matcher is not None and self.phase == "grammar"
        for i, address in enumerate(addresses):
            self.matcher.fill_bitmask(address, num_bytes)
            if i < len(drafts) and not self.matcher.accept_token(drafts[i]):
                self.matcher.rollback(i)
                raise RuntimeError(f"draft {drafts[i]} was validated but the grammar refused it")
        self.matcher.rollback(len(drafts))

    def ready(self) -> bool:
        """True once compiled (or failed: see `error`); creates the matcher the first time."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self.compiled.done():
            return False
        self.error = self.compiled.exception()
        if self.error is None:
            self.matcher = self.compiled.result().new_matcher()
        return True

    def advance(self, token_id: int) -> bool:
        """Accepts a sampled token; True when the grammar has ended (nothing more allowed)."""
        assert self.matcher is not None, "advance() before the grammar was ready"
        if self.reasoning is not None and self._in_reasoning(self.reasoning, token_id):
            return False
        if not self.matcher.accept_token(token_id):
            # The bitmask allowed only grammatical tokens, so this is an engine bug: end the
            # request rather than sample from a broken matcher.
            logger.error("grammar rejected sampled token %d", token_id)
            return True
        return self.matcher.is_terminated()

    def _in_reasoning(self, bounds: ReasoningBounds, token_id: int) -> bool:
        """Mutates the phase; True when `token_id` belongs to the reasoning."""
        if self.phase == "maybe":
            self.phase = "reasoning" if token_id in bounds.start_ids else "grammar"
            return self.phase == "reasoning"
        if self.phase != "reasoning":
            return False
        self._recent.append(token_id)
        longest = max(len(end) for end in bounds.end_ids)
        del self._recent[:-longest]
        if any(tuple(self._recent[-len(end) :]) == end for end in bounds.end_ids):
            self.phase = "grammar"
        return True
