"""A request's grammar state, as the scheduler and the worker see it (pure Python).

The scheduler only asks whether the grammar is compiled (`ready`) and advances it with each
accepted token (`advance`); the worker only asks for the next-token bitmask. Neither knows
which grammar engine is behind the `GrammarMatcher` protocol.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Protocol

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


class CompiledGrammar(Protocol):
    """A grammar compiled once and shared by every request with the same constraint."""

    def new_matcher(self) -> GrammarMatcher: ...


class StructuredOutputRequest:
    """Waits for its grammar's compilation (on the manager's threads), then owns a matcher.

    Preemption needs nothing here: it keeps the request's output tokens, and the matcher has
    accepted exactly those, so it stays at the right point when the request resumes.
    """

    def __init__(self, compiled: Future[CompiledGrammar]) -> None:
        self.compiled = compiled
        self.matcher: GrammarMatcher | None = None
        self.error: BaseException | None = None

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
        if not self.matcher.accept_token(token_id):
            # The bitmask allowed only grammatical tokens, so this is an engine bug: end the
            # request rather than sample from a broken matcher.
            logger.error("grammar rejected sampled token %d", token_id)
            return True
        return self.matcher.is_terminated()
