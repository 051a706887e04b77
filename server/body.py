"""Request bodies from raw bytes, as a hostile client may send them.

JSON is parsed with a depth limit, every string (keys included) must be text UTF-8 can
carry (JSON's `\\ud800` escape yields a lone surrogate that no tokenizer or encoder
accepts), and every error names the client's own field: `messages[0].content`, never a
pydantic union tag such as `prompt.list[int]`, and `[""]` for an empty key.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from server.errors import OpenAIError

Body = TypeVar("Body", bound=BaseModel)
# Deeper than any real request (a tool's JSON schema included), far below the recursion
# limit that json.loads and pydantic would otherwise hit.
MAX_DEPTH = 64
# json.loads recurses once per level, so whether it parses a very deep body depends on the
# interpreter's recursion limit, which libraries may raise. Bodies that open more than this
# many levels are refused before parsing, the same way whatever else is loaded.
MAX_PARSE_DEPTH = 512
Path = tuple[str | int, ...]
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(rb"[\[\]{}]")


def parse_body(raw: bytes, model: type[Body]) -> Body:
    """The body as `model`; raises a 400 OpenAIError that names the offending field."""
    data = load_json(raw)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc, data) from None


def load_json(raw: bytes) -> dict[str, Any]:
    """A JSON object whose nesting and strings are safe to hand on."""
    too_deep = OpenAIError(400, f"the JSON body is nested deeper than {MAX_DEPTH} levels")
    if _deeper_than(raw, MAX_PARSE_DEPTH):
        raise too_deep
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise too_deep from None
    except ValueError as exc:  # also invalid UTF-8 and over-long integer literals
        raise OpenAIError(400, f"We could not parse the JSON body of your request: {exc}") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    _check_tree(data)
    return data


def _deeper_than(raw: bytes, limit: int) -> bool:
    """Whether the body's arrays and objects open more than `limit` levels (brackets inside
    strings do not count)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    depth = 0
    for bracket in _BRACKET.findall(_JSON_STRING.sub(b'""', raw)):
        depth += 1 if bracket in (b"[", b"{") else -1
        if depth > limit:
            return True
    return False


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# What _check_tree looks into: text, and containers (a subclass cannot come out of json.loads).
_CHECKED = frozenset({str, dict, list})


def _check_tree(data: Any) -> None:
    """Walks the parsed body without recursion: depth and encodable text."""
    stack: list[tuple[Any, Path]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if len(path) >= MAX_DEPTH:
            name = field_name(path[:1])
            raise OpenAIError(
                400, f"'{name}' is nested deeper than {MAX_DEPTH} levels in the JSON body", name
            )
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, (*path, key))
                stack.append((item, (*path, key)))
        elif isinstance(value, list):
            if len(path) + 1 >= MAX_DEPTH:
                stack.extend((item, (*path, i)) for i, item in enumerate(value))
            else:
                # Numbers, booleans and nulls hold nothing to check: a prompt's token ids
                # (thousands of them) cost a type test each, not a path.
                stack.extend(
                    (item, (*path, i)) for i, item in enumerate(value) if type(item) in _CHECKED
                )


def _check_text(text: str, path: Path) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        name = field_name(path)
        raise OpenAIError(
            400,
            f"Invalid value for '{name}': the text holds a lone surrogate (U+"
            f"{ord(text[exc.start]):04X} at character {exc.start}), which is not valid Unicode",
            name,
        ) from None


def field_name(path: Path) -> str:
    """OpenAI's spelling of a field path: `messages[0].content`; odd keys JSON-quoted."""
    name = ""
    for part in path:
        if isinstance(part, int):
            name += f"[{part}]"
        elif _PLAIN_KEY.fullmatch(part):
            name += f".{part}" if name else part
        else:
            name += f"[{json.dumps(part)}]"
    return name


def from_validation_error(exc: ValidationError, data: Any) -> OpenAIError:
    """The first pydantic error, phrased as OpenAI phrases it, naming the client's field."""
    errors = exc.errors()
    first = errors[0]
    path = client_path(first["loc"], data, keep_last=first["type"] == "missing")
    param = field_name(path) if path else None
    if first["type"] == "extra_forbidden":
        return OpenAIError(400, f"Unrecognized request argument supplied: {param}", param)
    if first["type"] == "missing":
        return OpenAIError(400, f"Missing required parameter: '{param}'", param)
    alternatives = _union_alternatives(errors, first["loc"][: len(path) + 1], data)
    if len(alternatives) > 1:
        expected = ", ".join(alternatives)
        return OpenAIError(400, f"Invalid value for '{param}': expected one of {expected}", param)
    return OpenAIError(400, f"Invalid value for '{param}': {first['msg']}", param)


def client_path(loc: tuple[str | int, ...], data: Any, keep_last: bool = False) -> Path:
    """`loc` without pydantic's union tags: only the steps that exist in the client's data
    (the last one too for a missing field)."""
    path: list[str | int] = []
    for i, part in enumerate(loc):
        if _has_step(data, part):
            data = data[part]
        elif not (keep_last and i == len(loc) - 1):
            continue
        path.append(part)
    return tuple(path)


def _has_step(data: Any, part: str | int) -> bool:
    if isinstance(data, dict):
        return part in data
    return isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data)


def _union_alternatives(errors: list[Any], prefix: tuple[Any, ...], data: Any) -> list[str]:
    """The union members a value failed, when the first error's next step is a union tag."""
    depth = len(prefix) - 1
    if not prefix or len(client_path(prefix, data)) > depth:
        return []
    tags: list[str] = []
    for error in errors:
        loc = error["loc"]
        if tuple(loc[:depth]) == prefix[:depth] and len(loc) > depth:
            tag = str(loc[depth])
            if tag not in tags:
                tags.append(tag)
    return tags
