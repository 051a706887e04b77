"""Per-request sampling and stopping parameters (pure Python, validated once)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from engine.errors import RequestValidationError
from engine.structured_output.params import StructuredOutputsParams

# Sampling with temperature below this is treated as greedy, as vLLM does.
GREEDY_EPSILON = 1e-5


class RequestOutputKind(enum.Enum):
    """How much of a request's result each output carries (see engine.outputs)."""

    CUMULATIVE = "cumulative"  # everything so far
    DELTA = "delta"  # only what is new since the previous output
    FINAL_ONLY = "final_only"  # nothing until the request ends, then everything


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop. Immutable; `validate()` runs in `__post_init__`.

    `top_k <= 0` and `top_p == 1.0` disable those filters. `logprobs` is the number of
    top alternatives returned beside the sampled token (None: no logprobs at all).
    `stop` strings are matched on detokenized text by the output processor, not by the
    scheduler. `structured_outputs` constrains the output to a grammar (a JSON schema, a
    regex, ...): every sampling mode then draws only tokens the grammar allows, and the
    request ends ("stop") once the grammar is complete. Invalid values raise
    RequestValidationError naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    def for_child(self, index: int) -> SamplingParams:
        """The params of the `index`-th of `n` samples: n=1, and a distinct seed if seeded."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        """Raises RequestValidationError, naming the field, for an out-of-range value."""
        checks: list[tuple[bool, str, str]] = [
            (self.n >= 1, "n", f"n must be at least 1, got {self.n}"),
            (
                self.temperature >= 0.0,
                "temperature",
                f"temperature must be non-negative, got {self.temperature}",
            ),
            (0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (
                self.top_k >= -1,
                "top_k",
                f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}",
            ),
            (0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                "presence_penalty",
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                "frequency_penalty",
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.repetition_penalty > 0.0,
                "repetition_penalty",
                f"repetition_penalty must be positive, got {self.repetition_penalty}",
            ),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                "max_tokens",
                f"max_tokens must be at least 1, got {self.max_tokens}",
            ),
            (
                self.min_tokens >= 0,
                "min_tokens",
                f"min_tokens must be non-negative, got {self.min_tokens}",
            ),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= 20,
                "logprobs",
                f"logprobs must be in [0, 20], got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                "prompt_logprobs",
                f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}",
            ),
            (all(s for s in self.stop), "stop", "stop strings must not be empty"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise RequestValidationError(message, param)
        for token_id, bias in (self.logit_bias or {}).items():
            if not -100.0 <= bias <= 100.0:
                raise RequestValidationError(
                    f"logit_bias for token {token_id} must be in [-100, 100]", "logit_bias"
                )
