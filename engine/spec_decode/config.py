"""--speculative-config: vLLM's JSON spelling, the keys this engine implements."""

from __future__ import annotations

from dataclasses import dataclass

from engine.utils import json_flag

METHODS = ("ngram", "suffix", "draft_model")
# vLLM's methods that are not implemented here: refused by name rather than as unknown.
NOT_YET = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp")
# Each method's keys beyond method and num_speculative_tokens, with their defaults.
METHOD_KEYS: dict[str, dict[str, int | float | str]] = {
    "ngram": {"prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": {
        "suffix_decoding_max_tree_depth": 24,
        "suffix_decoding_max_cached_requests": 10000,
        "suffix_decoding_max_spec_factor": 1.0,
        "suffix_decoding_min_token_prob": 0.1,
    },
    # A draft model's path, and how its weights run (--quantization's choices; by default
    # as --quantization auto would run that model).
    "draft_model": {"model": "", "quantization": "auto"},
}
DRAFT_QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4")
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
    # Suffix decoding (engine/spec_decode/suffix.py), under vLLM's suffix_decoding_* keys.
    suffix_max_tree_depth: int = 24
    suffix_max_cached_requests: int = 10000
    suffix_max_spec_factor: float = 1.0
    suffix_min_token_prob: float = 0.1
    # A draft model (engine/worker/draft_runner.py): its path and --quantization choice.
    draft_model: str | None = None
    draft_quantization: str = "auto"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of {METHODS}")
        k = self.num_speculative_tokens
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be 1-{MAX_SPECULATIVE_TOKENS}, got {k}")
        if not 2 <= self.suffix_max_tree_depth <= 64:
            raise ValueError(
                f"suffix_decoding_max_tree_depth must be 2-64, got {self.suffix_max_tree_depth}"
            )
        if self.suffix_max_cached_requests < 0 or self.suffix_max_spec_factor <= 0:
            raise ValueError(
                "suffix_decoding_max_cached_requests must be >= 0 and "
                "suffix_decoding_max_spec_factor > 0"
            )
        if (self.method == "draft_model") != (self.draft_model is not None):
            raise ValueError("a draft model is named by, and only by, the draft_model method")
        if self.draft_quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(
                f"draft quantization {self.draft_quantization!r} is not one of "
                f"{DRAFT_QUANTIZATIONS}"
            )
        if not 0.0 <= self.suffix_min_token_prob <= 1.0:
            raise ValueError("suffix_decoding_min_token_prob must be within 0-1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )

    def describe(self) -> str:
        if self.method == "draft_model":
            return (
                f"draft model {self.draft_model} ({self.draft_quantization}), "
                f"{self.num_speculative_tokens} tokens"
            )
        if self.method == "suffix":
            return (
                f"suffix, {self.num_speculative_tokens} tokens, depth "
                f"{self.suffix_max_tree_depth}, {self.suffix_max_cached_requests} cached requests"
            )
        return (
            f"{self.method}, {self.num_speculative_tokens} tokens, n-grams of "
            f"{self.prompt_lookup_min}-{self.prompt_lookup_max}"
        )


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """The JSON object of --speculative-config, or None for no speculation. Raises
    ValueError naming what is wrong: bad JSON, an unknown or unimplemented key or method,
    a value out of range. One of the lookup bounds alone sets the other: a minimum
    raises the maximum to it if needed; a maximum lowers the minimum to it."""
    raw = json_flag(text, "--speculative-config")
    if raw is None:
        return None
    method = raw.get("method")
    if method in NOT_YET:
        raise ValueError(
            f"speculative method {method!r} is not implemented yet; this server runs "
            f"{', '.join(METHODS)}"
        )
    if method not in METHODS:
        raise ValueError(f"speculative method {method!r} is not one of {METHODS}")
    keys = METHOD_KEYS[method]
    unknown = sorted(set(raw) - {"method", "num_speculative_tokens", *keys})
    if unknown:
        raise ValueError(
            f"--speculative-config: unsupported keys {unknown} for {method}; it takes "
            f"method, num_speculative_tokens, {', '.join(keys)}"
        )
    if "num_speculative_tokens" not in raw:
        raise ValueError("--speculative-config needs num_speculative_tokens")
    if method == "draft_model":
        return _draft_model_config(raw)
    for key in ("num_speculative_tokens", *keys):
        value = raw.get(key)
        want = float if isinstance(keys.get(key), float) else int
        ok = isinstance(value, (int, float) if want is float else int)
        if value is not None and (not ok or isinstance(value, bool)):
            kind = "a number" if want is float else "an integer"
            raise ValueError(f"--speculative-config: {key} must be {kind}, got {value!r}")
    k = raw["num_speculative_tokens"]
    if method == "suffix":
        return SpeculativeConfig(
            "suffix",
            k,
            suffix_max_tree_depth=raw.get("suffix_decoding_max_tree_depth", 24),
            suffix_max_cached_requests=raw.get("suffix_decoding_max_cached_requests", 10000),
            suffix_max_spec_factor=float(raw.get("suffix_decoding_max_spec_factor", 1.0)),
            suffix_min_token_prob=float(raw.get("suffix_decoding_min_token_prob", 0.1)),
        )
    given_low, given_high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    low = DEFAULT_LOOKUP_MIN if given_low is None else given_low
    high = DEFAULT_LOOKUP_MAX if given_high is None else given_high
    if given_high is None:
        high = max(low, high)
    elif given_low is None:
        low = min(low, high)
    return SpeculativeConfig("ngram", k, low, high)


def _draft_model_config(raw: dict) -> SpeculativeConfig:
    """{"method": "draft_model", "model": path, "num_speculative_tokens": k} and an optional
    "quantization"."""
    model, k = raw.get("model"), raw["num_speculative_tokens"]
    if not isinstance(model, str) or not model:
        raise ValueError('--speculative-config: draft_model needs "model", the draft\'s path')
    if not isinstance(k, int) or isinstance(k, bool):
        raise ValueError(
            f"--speculative-config: num_speculative_tokens must be an integer, got {k!r}"
        )
    quantization = raw.get("quantization", "auto")
    if quantization is None:  # vLLM's default spelling
        quantization = "auto"
    if not isinstance(quantization, str):
        raise ValueError(
            f"--speculative-config: quantization must be a string, got {quantization!r}"
        )
    return SpeculativeConfig("draft_model", k, draft_model=model, draft_quantization=quantization)
