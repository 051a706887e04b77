"""llguidance as pagedserve's grammar engine (chosen by benchmarks/grammar_engines.py).

Why llguidance: it compiles a schema in under a millisecond (xgrammar took up to ~190 ms
for a schema with maxLength), it rejects JSON Schema keywords it cannot enforce with an
error that names them (xgrammar ignored `allOf` and `not`), and it needs neither torch nor
triton. Its per-token mask costs a few microseconds more, which is small beside a step.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf

from engine.errors import RequestValidationError
from engine.structured_output.params import GrammarKey

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared in the type stub only

# Where each kind of constraint came from in a request, for error messages.
PARAMS = {
    "json": "structured_outputs.json",
    "json_object": "structured_outputs.json_object",
    "regex": "structured_outputs.regex",
    "choice": "structured_outputs.choice",
    "grammar": "structured_outputs.grammar",
}


class LLGuidanceMatcher:
    """The GrammarMatcher protocol over an llguidance LLMatcher."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.consume_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_stopped())

    def fill_bitmask(self, address: int, num_bytes: int) -> None:
        self._matcher.unsafe_compute_mask_ptr(address, num_bytes)

    def validate_tokens(self, token_ids: list[int]) -> int:
        return int(self._matcher.validate_tokens(token_ids))

    def rollback(self, num_tokens: int) -> None:
        if not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"the grammar matcher could not roll back {num_tokens} tokens")


class LLGuidanceGrammar:
    """A compiled grammar: a matcher at its start, copied for each request."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._prototype = matcher

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._prototype.deep_copy())


class LLGuidanceBackend:
    """Compiles GrammarKeys for one tokenizer. Thread-safe; compiling drops the GIL."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]):
        """Builds the token trie (about a second for a 50k vocabulary): call it off the loop."""
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(
                hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None
            )
        except ValueError as exc:
            raise RequestValidationError(
                f"structured outputs need a fast tokenizer: {exc}", "structured_outputs"
            ) from None

    def compile(self, key: GrammarKey) -> LLGuidanceGrammar:
        """Raises RequestValidationError, naming the request field, for a grammar that
        cannot compile (an unsupported JSON Schema keyword among them)."""
        grammar = self._grammar(key)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestValidationError(_describe(key, matcher.get_error()), PARAMS[key.kind])
        return LLGuidanceGrammar(matcher)

    @staticmethod
    def _grammar(key: GrammarKey) -> str:
        try:
            if key.kind in ("json", "json_object"):
                options: JsonCompileOptions = {"whitespace_flexible": key.any_whitespace}
                if key.whitespace_pattern is not None:
                    options["whitespace_pattern"] = key.whitespace_pattern
                return str(llguidance.LLMatcher.grammar_from_json_schema(key.spec, options))
            if key.kind == "choice":
                return llguidance.grammar_from("choice", json.loads(key.spec))
            if key.kind == "regex":
                return str(llguidance.LLMatcher.grammar_from_regex(key.spec))
            return llguidance.grammar_from("grammar", key.spec)
        except ValueError as exc:
            raise RequestValidationError(_describe(key, str(exc)), PARAMS[key.kind]) from None


def _describe(key: GrammarKey, error: str) -> str:
    what = {"json": "JSON schema", "json_object": "JSON schema", "choice": "choice list"}
    first_line = error.strip().splitlines()[0] if error.strip() else "unknown error"
    detail = error.strip() if len(error) < 400 else first_line
    if "Unimplemented keys" in error:
        return f"the JSON schema uses keywords this server cannot enforce: {first_line}"
    return f"invalid {what.get(key.kind, key.kind)}: {detail}"
