"""What a request's output must match: one constraint, validated once (pure Python).

The fields follow vLLM's `StructuredOutputsParams` (the `structured_outputs` request object):
exactly one of `json`, `regex`, `choice`, `grammar`, `json_object` is set. Unlike vLLM's,
`disable_any_whitespace` defaults to True: a small model that may put any whitespace between
JSON tokens tends to pad with newlines until max_tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.errors import RequestValidationError

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class GrammarKey:
    """A constraint as the compile cache knows it: equal keys share one compiled grammar."""

    kind: str  # one of CONSTRAINTS
    spec: str  # the constraint's text (JSON for schemas and choice lists)
    any_whitespace: bool = False
    whitespace_pattern: str | None = None


@dataclass(frozen=True)
class ReasoningBounds:
    """Free reasoning before the constrained answer: the grammar applies from the end of
    the reasoning, not from the first token.

    `end_ids` lists the token sequences that end the reasoning (`</think>`). When the
    prompt already opened it (`opened`), output starts inside it. Otherwise the model may
    open it with its first token, one of `start_ids` (`<think>`), which the grammar's first
    mask then also allows; any other first token starts the answer.
    """

    end_ids: tuple[tuple[int, ...], ...]
    start_ids: tuple[int, ...] = ()
    opened: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "end_ids", tuple(tuple(e) for e in self.end_ids))
        object.__setattr__(self, "start_ids", tuple(self.start_ids))
        if not self.end_ids or not all(self.end_ids):
            raise RequestValidationError("reasoning bounds need end token ids", "reasoning")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint. `json` is a JSON schema (a dict, or its JSON text); `grammar`
    is a Lark grammar (llguidance's dialect) or a GBNF one; `choice` lists exact outputs.
    `disable_additional_properties` closes every object schema that does not say otherwise.
    With `reasoning`, the constraint starts where the model's reasoning ends.
    Raises RequestValidationError naming the field when the combination is invalid."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    reasoning: ReasoningBounds | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            found = ", ".join(given) or "none"
            raise RequestValidationError(
                f"structured outputs take exactly one of {', '.join(CONSTRAINTS)}; got {found}",
                "structured_outputs",
            )
        if self.json_object is False:
            raise RequestValidationError(
                "json_object must be true when given", "structured_outputs.json_object"
            )
        if self.choice is not None and not self.choice:
            raise RequestValidationError(
                "choice must list at least one string", "structured_outputs.choice"
            )
        if self.whitespace_pattern is not None and self.disable_any_whitespace:
            raise RequestValidationError(
                "whitespace_pattern needs disable_any_whitespace=false",
                "structured_outputs.whitespace_pattern",
            )

    @property
    def kind(self) -> str:
        return next(name for name in CONSTRAINTS if getattr(self, name) is not None)

    def key(self) -> GrammarKey:
        """The cache key. Raises RequestValidationError for a `json` text that is not JSON."""
        kind = self.kind
        if kind == "json":
            schema = self.schema()
            if self.disable_additional_properties:
                schema = close_objects(schema)
            # Key order is kept: properties are generated in the order the schema lists them.
            spec = json.dumps(schema)
        elif kind == "json_object":
            spec = json.dumps({"type": "object"})
        elif kind == "choice":
            spec = json.dumps(list(self.choice or ()))
        else:
            spec = str(getattr(self, kind))
        return GrammarKey(kind, spec, not self.disable_any_whitespace, self.whitespace_pattern)

    def schema(self) -> Any:
        if not isinstance(self.json, str):
            return self.json
        try:
            return json.loads(self.json)
        except json.JSONDecodeError as exc:
            raise RequestValidationError(
                f"the JSON schema is not valid JSON: {exc}", "structured_outputs.json"
            ) from None


# Keywords whose value maps names to subschemas, and keywords whose value is data.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA = ("enum", "const", "default", "examples")


def close_objects(schema: Any) -> Any:
    """A copy of `schema` in which every object schema without `additionalProperties`
    gets `additionalProperties: false`."""
    if isinstance(schema, list):
        return [close_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: close_objects(sub) for name, sub in value.items()}
        else:
            closed[key] = value if key in _DATA else close_objects(value)
    is_object = schema.get("type") == "object" or "properties" in schema
    if is_object and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed
