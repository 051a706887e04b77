"""What a hostile client sends: each case gets an OpenAI-shaped 4xx naming the real field,
and the server keeps serving."""

from __future__ import annotations

import json
import sys
from typing import Any

import httpx
import pytest

from server.body import MAX_DEPTH, load_json
from server.errors import OpenAIError
from tests.server.live import LiveServer

SURROGATE = '"\\ud800"'  # JSON's escape for a lone surrogate, as raw body text


def body(text: str) -> bytes:
    return text.encode()


def nested(depth: int) -> bytes:
    return body('{"prompt": "t10", "logit_bias": ' + "[" * depth + "]" * depth + "}")


# (path, raw body, status, param)
CASES: dict[str, tuple[str, bytes, int, str | None]] = {
    "json-1000-deep": ("/v1/completions", nested(1000), 400, None),
    "json-100000-deep": ("/v1/completions", body('{"x": ' + "[" * 100_000 + "}"), 400, None),
    "json-70-deep": ("/v1/completions", nested(70), 400, "logit_bias"),
    "surrogate-prompt": ("/v1/completions", body(f'{{"prompt": {SURROGATE}}}'), 400, "prompt"),
    "surrogate-prompt-item": (
        "/v1/completions",
        body(f'{{"prompt": ["t10", {SURROGATE}]}}'),
        400,
        "prompt[1]",
    ),
    "surrogate-chat": (
        "/v1/chat/completions",
        body(f'{{"messages": [{{"role": "user", "content": {SURROGATE}}}]}}'),
        400,
        "messages[0].content",
    ),
    "surrogate-chat-part": (
        "/v1/chat/completions",
        body('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}'),
        400,
        "messages[0].content[0].text",
    ),
    "surrogate-tokenize": ("/tokenize", body(f'{{"prompt": {SURROGATE}}}'), 400, "prompt"),
    "surrogate-tokenize-chat": (
        "/tokenize",
        body(f'{{"messages": [{{"role": "user", "content": {SURROGATE}}}]}}'),
        400,
        "messages[0].content",
    ),
    "surrogate-model": (
        "/v1/completions",
        body(f'{{"prompt": "t10", "model": {SURROGATE}}}'),
        400,
        "model",
    ),
    "surrogate-key": (
        "/v1/completions",
        body(f'{{"prompt": "t10", {SURROGATE}: 1}}'),
        400,
        '["\\ud800"]',
    ),
    "surrogate-stop": (
        "/v1/completions",
        body(f'{{"prompt": "t10", "stop": [{SURROGATE}]}}'),
        400,
        "stop[0]",
    ),
    "invalid-utf8": ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
    "integral-float-n": ("/v1/completions", body('{"prompt": "t10", "n": 17.0}'), 400, "n"),
    "integral-float-max-tokens": (
        "/v1/completions",
        body('{"prompt": "t10", "max_tokens": 5000.0}'),
        400,
        "max_tokens",
    ),
    "bool-as-int": ("/v1/completions", body('{"prompt": "t10", "n": true}'), 400, "n"),
    "string-as-bool": ("/v1/completions", body('{"prompt": "t10", "echo": "yes"}'), 400, "echo"),
    "float-token-id": ("/v1/completions", body('{"prompt": [10, 11.0]}'), 400, "prompt"),
    "nan": ("/v1/completions", body('{"prompt": "t10", "temperature": NaN}'), 400, None),
    "overflow-to-inf": (
        "/v1/completions",
        body('{"prompt": "t10", "temperature": 1e400}'),
        400,
        "temperature",
    ),
    "huge-integer": (
        "/v1/completions",
        body('{"prompt": "t10", "max_tokens": ' + "9" * 5000 + "}"),
        400,
        None,
    ),
    "empty-key": ("/v1/completions", body('{"prompt": "t10", "": 1}'), 400, '[""]'),
    "nested-empty-key": (
        "/v1/completions",
        body('{"prompt": "t10", "stream": true, "stream_options": {"": 1}}'),
        400,
        'stream_options[""]',
    ),
    "dotted-key": ("/v1/completions", body('{"prompt": "t10", "a.b": 1}'), 400, '["a.b"]'),
    "prompt-of-wrong-type": ("/v1/completions", body('{"prompt": {"a": 1}}'), 400, "prompt"),
    "chat-role-of-wrong-type": (
        "/v1/chat/completions",
        body('{"messages": [{"role": 7, "content": "t10"}]}'),
        400,
        "messages[0].role",
    ),
    "missing-messages": ("/v1/chat/completions", body("{}"), 400, "messages"),
    "array-body": ("/v1/completions", body("[1, 2]"), 400, None),
    "detokenize-negative": ("/detokenize", body('{"tokens": [-1]}'), 400, "tokens"),
}


def check_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize(("path", "raw", "status", "param"), CASES.values(), ids=CASES.keys())
def test_hostile_input_gets_a_4xx_naming_the_field(
    tiny_server: LiveServer, path: str, raw: bytes, status: int, param: str | None
) -> None:
    response = httpx.post(
        f"{tiny_server.url}{path}",
        content=raw,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    error = check_openai_error(response, status)
    assert error["param"] == param, error
    ok = httpx.post(f"{tiny_server.url}/v1/completions", json={"prompt": "t10", "max_tokens": 2})
    assert ok.status_code == 200


def test_union_errors_list_what_the_field_may_be(tiny_server: LiveServer) -> None:
    response = httpx.post(f"{tiny_server.url}/v1/completions", json={"prompt": 12.5})
    message = check_openai_error(response, 400)["message"]
    assert message == (
        "Invalid value for 'prompt': expected one of str, list[str], list[int], list[list[int]]"
    )


def test_a_plain_unknown_field_names_itself(tiny_server: LiveServer) -> None:
    response = httpx.post(f"{tiny_server.url}/v1/completions", json={"prompt": "t", "frob": 1})
    error = check_openai_error(response, 400)
    assert (error["message"], error["param"]) == (
        "Unrecognized request argument supplied: frob",
        "frob",
    )


def test_integral_floats_stay_accepted_where_floats_belong(tiny_server: LiveServer) -> None:
    body = {"prompt": "t10", "max_tokens": 2, "temperature": 1, "top_p": 1, "logit_bias": {"5": 1}}
    assert (
        httpx.post(f"{tiny_server.url}/v1/completions", content=json.dumps(body)).status_code == 200
    )


@pytest.mark.parametrize("limit", [1000, 2500, 100_000])
def test_a_very_deep_body_gets_the_same_answer_whatever_the_recursion_limit(limit: int) -> None:
    """Libraries raise the interpreter's limit (cel-python sets 2500); a body that only a
    higher limit lets json.loads parse must still be refused before parsing."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        with pytest.raises(OpenAIError) as refused:
            load_json(nested(1000))
    finally:
        sys.setrecursionlimit(before)
    assert refused.value.status == 400 and refused.value.param is None
    assert load_json(body('{"prompt": "' + "[" * 1000 + '"}'))["prompt"] == "[" * 1000


def test_a_number_deep_in_arrays_counts_toward_the_depth_limit() -> None:
    """The body check looks into no number, but still counts the level one sits at: a number
    inside MAX_DEPTH - 1 arrays under a key is one level too deep; one array fewer is not."""

    def deep_number(arrays: int) -> bytes:
        return body('{"logit_bias": ' + "[" * arrays + "1" + "]" * arrays + "}")

    with pytest.raises(OpenAIError) as refused:
        load_json(deep_number(MAX_DEPTH - 1))
    assert refused.value.status == 400 and refused.value.param == "logit_bias"
    assert load_json(deep_number(MAX_DEPTH - 2))["logit_bias"]
