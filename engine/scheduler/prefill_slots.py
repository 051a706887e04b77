"""Chunked prefill's per-step limits, as vLLM's flags of the same names, and which running
requests are prefills rather than decodes (pure Python).

- `long_prefill_token_threshold` (T, 0 = off) caps each request's prefill chunk at T
  tokens, as vLLM V1 does, and makes a prefill with more than T tokens still to compute
  *long*, as vLLM V0 counted them.
- In a step that also decodes, the prompt tokens of all its prefills together are capped
  at `beside` tokens (0 = off; the CPU's default where T is not given), so that the streams
  decoding wait for few prompt tokens, while a step of prompts alone keeps the whole budget.
  The scheduler sets `beside` each step: by --prefill-time-beside-decodes and the steps'
  times (step_cost.py) once those are known, else `prefill_chunk_beside_decodes`.
- A prefill is *partial* after a step when its chunk stops short of its prompt's end, cut
  by T, by `beside` or by the budget (a running prefill left out of a step is left out for
  want of budget, when nothing else is admitted either). At most `max_num_partial_prefills`
  (N) requests are partial at once, and at most `max_long_partial_prefills` (M) of them long.
  A chunk that finishes its prompt needs no slot, so short prompts are never held back by
  these limits.

With T = 64, N = 1, a budget of 256 and no cap beside decodes, a step beside 16 decodes:

    decodes           16 x 1 token    always first
    A (1500 left)     64 tokens       partial and long: takes the one slot
    B (1800 left)     waits           would be partial: no slot left; keeps its place
    C (40 left)       40 tokens       finishes its prompt: needs no slot

With `beside` = 80 as well, C gets 16 tokens and is left partial, which it may not be (A
holds the one slot): C waits, and keeps its place.
"""

from __future__ import annotations

from engine.config import SchedulerConfig
from engine.request import Request


class PrefillSlots:
    """One step's partial-prefill slots. `chunk` decides a prefill's tokens; `take` books them,
    and `decode` a decode, which the scheduler books first. A new instance per step."""

    def __init__(self, config: SchedulerConfig, beside: int) -> None:
        self.threshold = config.long_prefill_token_threshold
        self.max_partial = config.max_num_partial_prefills
        self.max_long = config.max_long_partial_prefills
        self.num_partial = 0
        self.num_long = 0
        # Prompt tokens still allowed in this step if it decodes (None: no cap); `beside`
        # is the scheduler's cap for the step (Scheduler.prefill_tokens_beside_decodes).
        self.beside_left: int | None = beside or None
        self.num_decodes = 0
        self.num_prompt_tokens = 0

    @property
    def decoding(self) -> bool:
        return self.num_decodes > 0

    def decode(self) -> None:
        """Books a decoding request."""
        self.num_decodes += 1

    def chunk(self, remaining: int, budget: int) -> int:
        """The tokens a prefill with `remaining` tokens to compute may take this step, at
        most `budget`; 0 when it would be left partial and the slots it needs are taken."""
        num_new = min(remaining, budget)
        if self.threshold:
            num_new = min(num_new, self.threshold)
        if self.decoding and self.beside_left is not None:
            num_new = min(num_new, self.beside_left)
            if num_new == 0:
                return 0
        if num_new == remaining:
            return num_new
        if self.num_partial >= self.max_partial:
            return 0
        if self._is_long(remaining) and self.num_long >= self.max_long:
            return 0
        return num_new

    def take(self, remaining: int, num_new: int) -> None:
        """Books the slots of a prefill given `num_new` of its `remaining` tokens."""
        self.num_prompt_tokens += num_new
        if self.decoding and self.beside_left is not None:
            self.beside_left -= num_new
        if num_new >= remaining:
            return
        self.num_partial += 1
        if self._is_long(remaining):
            self.num_long += 1

    def _is_long(self, remaining: int) -> bool:
        return 0 < self.threshold < remaining


def is_prefilling(request: Request) -> bool:
    """Whether a running request has more than one token to compute (the rest of its prompt,
    or its whole history after a preemption), rather than decoding its next token."""
    return request.num_tokens_with_placeholders - request.num_computed_tokens > 1


def decodes_first(running: list[Request]) -> list[Request]:
    """`running` with its decodes first, then its prefills, each in running order (a new
    list: the caller may preempt from `running` while it walks this one)."""
    prefills = [r for r in running if is_prefilling(r)]
    if not prefills:
        return list(running)
    return [r for r in running if not is_prefilling(r)] + prefills
