"""Admission control: a bounded engine queue, checked before any tokenization.

A request is admitted when the engine's queue (choices not yet running, from
AsyncLLM.num_queued_requests and num_queued_tokens) plus the requests admitted but not yet
handed to the engine leave room for all of its choices (`n` per prompt). Past either
limit it gets 503 with Retry-After, which the OpenAI SDKs retry with backoff; a request
that could never fit gets 400. The choice count is checked before tokenization and
chat-template rendering, so a rejection costs next to nothing; the token count, which
needs the tokens, right after.

Default sizes aim at a queued request starting within about a minute at the configured
batch: `max_num_queued_reqs = 8 * max_num_seqs` (eight full batches; at a typical few
seconds per request that is under a minute) and `max_num_queued_tokens` the larger of
64 full prefill steps (`64 * max_num_batched_tokens`) and 8 prompts of the longest length
(`8 * max_model_len`): a step budget made small for latency does not shrink the queue.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine import AsyncLLM
from server.errors import OpenAIError

QUEUE_BATCHES = 8
QUEUE_PREFILL_STEPS = 64
QUEUE_LONGEST_PROMPTS = 8
# Seconds a rejected client should wait: the queue moves every engine step.
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class QueueLimits:
    max_requests: int
    max_tokens: int

    @classmethod
    def resolve(
        cls,
        max_requests: int | None,
        max_tokens: int | None,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> QueueLimits:
        """The limits given, else the defaults sized from the engine's batch."""
        default_tokens = max(
            QUEUE_PREFILL_STEPS * max_num_batched_tokens, QUEUE_LONGEST_PROMPTS * max_model_len
        )
        return cls(
            max_requests if max_requests is not None else QUEUE_BATCHES * max_num_seqs,
            max_tokens if max_tokens is not None else default_tokens,
        )


class Admission:
    """Admits requests against the queue limits. Runs on the event loop only."""

    def __init__(
        self, engine: AsyncLLM, limits: QueueLimits, on_reject: Callable[[str], None]
    ) -> None:
        self.engine = engine
        self.limits = limits
        self._on_reject = on_reject
        # Admitted and not yet handed to the engine: (choices, tokens).
        self.reserved = [0, 0]

    def admit(self, num_choices: int) -> Ticket:
        """Reserves room for `num_choices`; raises a 400 or 503 OpenAIError."""
        limit = self.limits.max_requests
        if num_choices > limit:
            raise OpenAIError(
                400,
                f"this request asks for {num_choices} choices (n for each prompt), more than "
                f"the server ever queues (--max-num-queued-reqs {limit})",
                "n",
            )
        if self.engine.num_queued_requests + self.reserved[0] + num_choices > limit:
            raise self.queue_full("max_num_queued_reqs", "requests")
        if self.engine.num_queued_tokens + self.reserved[1] >= self.limits.max_tokens:
            raise self.queue_full("max_num_queued_tokens", "tokens")
        return Ticket(self, num_choices)

    def queue_full(self, reason: str, what: str) -> OpenAIError:
        self._on_reject(reason)
        return OpenAIError(
            503,
            f"the server's queue is full ({what}); retry shortly",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )


class Ticket:
    """Room reserved in the queue until the request is handed to the engine (`release`)."""

    def __init__(self, admission: Admission, num_choices: int) -> None:
        self._admission = admission
        self._held = [num_choices, 0]
        admission.reserved[0] += num_choices

    def reserve_tokens(self, num_tokens: int, param: str) -> None:
        """Adds the request's tokens (each choice's prompt); raises a 400 or 503 OpenAIError
        naming `param` when they do not fit."""
        admission = self._admission
        limit = admission.limits.max_tokens
        if num_tokens > limit:
            raise OpenAIError(
                400,
                f"this request's prompts need {num_tokens} tokens in the queue (each choice "
                f"counts), more than the server ever queues (--max-num-queued-tokens {limit})",
                param,
            )
        if admission.engine.num_queued_tokens + admission.reserved[1] + num_tokens > limit:
            raise admission.queue_full("max_num_queued_tokens", "tokens")
        self._held[1] += num_tokens
        admission.reserved[1] += num_tokens

    def release(self) -> None:
        """Gives the room back (the engine counts the request now, or it never will)."""
        reserved = self._admission.reserved
        reserved[0] -= self._held[0]
        reserved[1] -= self._held[1]
        self._held = [0, 0]
