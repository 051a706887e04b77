"""--speculative-config: vLLM's JSON spelling, the keys this engine implements."""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram",)
# vLLM's methods that are not implemented here: refused by name rather than as unknown.
NOT_YET = ("suffix", "draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp")
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_LOOKUP_MIN, DEFAULT_LOOKUP_MAX = 2, 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """N-gram (prompt lookup) speculation: up to `num_speculative_tokens` drafts a step, the
    tokens that followed the latest earlier occurrence of the request's last n tokens, for
    the longest n from `prompt_lookup_max` down to `prompt_lookup_min` that occurs."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_LOOKUP_MAX

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of {METHODS}")
        k = self.num_speculative_tokens
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be 1-{MAX_SPECULATIVE_TOKENS}, got {k}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )

    def describe(self) -> str:
        return (
            f"{self.method}, {self.num_speculative_tokens} tokens, n-grams of "
            f"{self.prompt_lookup_min}-{self.prompt_lookup_max}"
        )


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """The JSON object of --speculative-config, or None for no speculation. Raises
    ValueError naming what is wrong: bad JSON, an unknown or unimplemented key or method,
    a value out of range. One of the lookup bounds alone sets the other: a minimum
    raises the maximum to it if needed; a maximum lowers the minimum to it."""
    if text is None or not text.strip():
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--speculative-config must be a JSON object")
    method = raw.get("method")
    if method in NOT_YET:
        raise ValueError(
            f"speculative method {method!r} is not implemented yet; this server runs "
            f"{', '.join(METHODS)}"
        )
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ValueError(
            f"--speculative-config: unsupported keys {unknown}; it takes {', '.join(KEYS)}"
        )
    if "num_speculative_tokens" not in raw:
        raise ValueError("--speculative-config needs num_speculative_tokens")
    for key in KEYS[1:]:
        value = raw.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"--speculative-config: {key} must be an integer, got {value!r}")
    given_low, given_high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    low = DEFAULT_LOOKUP_MIN if given_low is None else given_low
    high = DEFAULT_LOOKUP_MAX if given_high is None else given_high
    if given_high is None:
        high = max(low, high)
    elif given_low is None:
        low = min(low, high)
    return SpeculativeConfig(str(method), raw["num_speculative_tokens"], low, high)
