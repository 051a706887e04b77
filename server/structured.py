"""Output constraints from request bodies: OpenAI's `response_format` (chat) and vLLM's
`structured_outputs` object (both endpoints), as engine StructuredOutputsParams.

`structured_outputs` is vLLM's current spelling (the `guided_*` fields were removed in vLLM
0.12); those old fields get a 400 that points to it. The grammar compiles before the request
runs, so a schema the grammar engine cannot enforce is a 400 naming the field it came from,
for streams too, never a silently unconstrained answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine import RequestValidationError, SamplingParams, StructuredOutputsParams
from server.errors import OpenAIError
from server.serving import ServingContext


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    # OpenAI's schema is optional; without one any JSON object will do.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    # Every schema is enforced; `strict` is accepted for the SDK, which always sends it.
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs` request object (the fields pagedserve implements)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    structural_tag: Any | None = None


REMOVED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_whitespace_pattern": "whitespace_pattern",
    "guided_decoding_backend": None,
}


class StructuredOutputFields(_Strict):
    """The constraint fields both endpoints take (mixed into their request bodies)."""

    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: Any | None = None
    guided_regex: Any | None = None
    guided_choice: Any | None = None
    guided_grammar: Any | None = None
    guided_whitespace_pattern: Any | None = None
    guided_decoding_backend: Any | None = None

    def check_removed_fields(self) -> None:
        for name, replacement in REMOVED_FIELDS.items():
            if getattr(self, name) is not None:
                use = f'structured_outputs: {{"{replacement}": ...}}' if replacement else "nothing"
                raise OpenAIError(
                    400, f"`{name}` is not supported; use {use} (vLLM's current API)", name
                )


@dataclass(frozen=True)
class Constraint:
    """An engine constraint and the request field it came from (for error messages)."""

    params: StructuredOutputsParams
    param: str


def from_structured_outputs(body: StructuredOutputsRequest) -> Constraint:
    if body.structural_tag is not None:
        raise OpenAIError(
            400, "structural_tag is not supported", "structured_outputs.structural_tag"
        )
    options = {
        "disable_any_whitespace": body.disable_any_whitespace,
        "disable_additional_properties": body.disable_additional_properties,
    }
    given = {k: v for k, v in options.items() if v is not None}
    try:
        params = StructuredOutputsParams(
            json=body.json_,
            regex=body.regex,
            choice=None if body.choice is None else tuple(body.choice),
            grammar=body.grammar,
            json_object=body.json_object,
            whitespace_pattern=body.whitespace_pattern,
            **given,
        )
    except RequestValidationError as exc:
        raise OpenAIError(400, str(exc), exc.param) from None
    return Constraint(params, "structured_outputs")


def from_response_format(body: ResponseFormat) -> Constraint | None:
    if body.type == "text":
        if body.json_schema is not None:
            raise OpenAIError(
                400, "json_schema goes with type json_schema", "response_format.json_schema"
            )
        return None
    if body.type == "json_object":
        return Constraint(StructuredOutputsParams(json_object=True), "response_format")
    if body.json_schema is None:
        raise OpenAIError(
            400, "response_format of type json_schema needs json_schema", "response_format"
        )
    schema = body.json_schema.schema_
    params = StructuredOutputsParams(json=schema if schema is not None else {"type": "object"})
    return Constraint(params, "response_format.json_schema.schema")


async def check_constraint(
    ctx: ServingContext, params: SamplingParams, constraint: Constraint | None
) -> None:
    """Compiles the constraint now (off the event loop, cached for the request itself);
    a grammar that cannot compile is a 400 naming the field it came from."""
    if constraint is None:
        return
    try:
        await ctx.engine.check_constraints(params)
    except RequestValidationError as exc:
        param = exc.param
        if constraint.param != "structured_outputs":
            param = constraint.param
        raise OpenAIError(400, str(exc), param) from None
