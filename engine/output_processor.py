"""Detokenization and stop strings, shared by the offline LLM API and the HTTP gateway."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams
from engine.scheduler.output import EngineCoreOutput, Logprobs

# Prompt tokens kept as context, so the first output token decodes with the right spacing.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Emits text as tokens arrive, never splitting a multi-byte UTF-8 character.

    Decodes a short window twice per token: the text of the tokens already emitted, and
    the same window plus the new ones. The difference is the new text, held back while it
    ends in an incomplete character (U+FFFD).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        """Mutates: appends one token and returns the text it completes (maybe "")."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before) :]

    def _decode(self, ids: list[int]) -> str:
        return str(
            self.tokenizer.decode(
                ids,
                skip_special_tokens=self.skip_special_tokens,
                clean_up_tokenization_spaces=False,
            )
        )


@dataclass
class Delta:
    """What one engine output adds to a request's visible result."""

    text: str
    token_ids: list[int]
    logprobs: list[Logprobs]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestTracker:
    """Accumulates one request's output and applies its stop strings.

    While the request runs, the last `max(len(stop)) - 1` characters are held back, so a
    stop string never leaks any part of itself into a stream. When a stop string matches,
    `needs_abort` tells the caller to abort the engine request.
    """

    tokenizer: Any
    prompt_token_ids: list[int]
    params: SamplingParams
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: list[Logprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    needs_abort: bool = False
    _sent: int = 0
    _detok: IncrementalDetokenizer = field(init=False)

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(
            self.tokenizer, self.prompt_token_ids, self.params.skip_special_tokens
        )
        self._hold = max((len(s) for s in self.params.stop), default=1) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, out: EngineCoreOutput) -> Delta:
        """Mutates: folds in one engine output; returns what became visible."""
        self.prompt_logprobs += out.prompt_logprobs
        self.num_cached_tokens = out.num_cached_tokens
        new_ids = out.new_token_ids
        for i, token_id in enumerate(new_ids):
            self.token_ids.append(token_id)
            if i < len(out.new_logprobs):
                self.logprobs.append(out.new_logprobs[i])
            start = len(self.text)
            self.text += self._detok.add(token_id)
            if self._match_stop(start):
                break
        if out.finish_reason is not None and self.finish_reason is None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        end = len(self.text) if self.finished else max(self._sent, len(self.text) - self._hold)
        delta = Delta(
            self.text[self._sent : end],
            new_ids,
            out.new_logprobs,
            self.finish_reason,
            self.stop_reason,
        )
        self._sent = end
        return delta

    def _match_stop(self, start: int) -> bool:
        """Mutates: truncates at the earliest stop string that ends in the new text."""
        if not self.params.stop or self.finished:
            return False
        search_from = max(0, start - self._hold)
        hits = [(self.text.find(s, search_from), s) for s in self.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        self.text = self.text[
            : index + len(stop) if self.params.include_stop_str_in_output else index
        ]
        self.finish_reason, self.stop_reason = "stop", stop
        self.needs_abort = True
        return True
