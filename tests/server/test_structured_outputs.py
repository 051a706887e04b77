"""Structured outputs and tool calling through a real server and the openai SDK, on a tiny
random model with a byte-level tokenizer: whatever it writes that is valid, the grammar
made valid. The default model's behaviour is in test_structured_default_model.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from engine import AsyncLLM, EngineArgs
from tests.server import shapes
from tests.server.live import LiveServer
from tests.tiny_models import make_tiny_model

WEATHER_ARGS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
SEARCH_ARGS = {
    "type": "object",
    "properties": {"query": {"$ref": "#/$defs/q"}},
    "required": ["query"],
    "additionalProperties": False,
    "$defs": {"q": {"type": "string", "maxLength": 10}},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_ARGS}},
    {
        "type": "function",
        "function": {"name": "search", "description": "web", "parameters": SEARCH_ARGS},
    },
]
ARGS = {"get_weather": WEATHER_ARGS, "search": SEARCH_ARGS}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "score": {"type": "integer", "minimum": -5, "maximum": 5},
        "kind": {"enum": ["x", "y"]},
    },
    "required": ["name", "score", "kind"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = make_tiny_model("llama", tmp_path_factory.mktemp("tiny-bytes"), byte_level=True)
    engine = AsyncLLM.from_engine_args(
        EngineArgs(model=str(path), dtype="float32", num_kv_blocks=512, max_model_len=2048)
    )
    with LiveServer(engine, served_model_name="tiny", tool_call_parser="hermes") as live:
        yield live


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def chat(server: LiveServer, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", USER)
    kwargs.setdefault("max_tokens", 120)
    return client(server).chat.completions.create(model="tiny", **kwargs)


def stream_chat(server: LiveServer, **kwargs: Any) -> tuple[str | None, list[dict], str]:
    """Content, tool calls and finish reason, reassembled from a stream's deltas."""
    content, calls, finish = None, {}, None
    for chunk in chat(server, stream=True, **kwargs):
        (choice,) = chunk.choices
        delta = choice.delta
        if delta.content:
            content = (content or "") + delta.content
        for call in delta.tool_calls or []:
            if call.id is not None:  # a call's first delta: index, id, type and name
                assert call.index not in calls and call.type == "function"
                assert call.function.name and call.function.arguments == ""
                calls[call.index] = {"name": call.function.name, "arguments": ""}
            else:
                assert call.function.name is None and call.index in calls
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def calls_of(message: Any) -> list[dict]:
    return [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls or []
    ]


def check_calls(calls: list[dict], allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["name"] in allowed
        jsonschema.validate(json.loads(call["arguments"]), ARGS[call["name"]])


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls_are_declared_valid_and_stream_identically(
    server: LiveServer, seed: int, parallel: bool
) -> None:
    kwargs: dict[str, Any] = dict(
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        temperature=1.0,
        seed=seed,
        max_tokens=400,
    )
    response = chat(server, **kwargs)
    choice = response.choices[0]
    calls = calls_of(choice.message)
    check_calls(calls, {"get_weather", "search"})
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    if not parallel:
        assert len(calls) == 1
    assert stream_chat(server, **kwargs) == (None, calls, "tool_calls")


def test_named_tool_choice_calls_that_function(server: LiveServer) -> None:
    named = {"type": "function", "function": {"name": "search"}}
    for seed in (4, 5):
        response = chat(server, tools=TOOLS, tool_choice=named, temperature=1.0, seed=seed)
        calls = calls_of(response.choices[0].message)
        assert len(calls) == 1
        check_calls(calls, {"search"})


def test_auto_without_calls_is_plain_content(server: LiveServer) -> None:
    response = chat(server, tools=TOOLS, max_tokens=8, temperature=0.0)
    choice = response.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    plain = chat(server, max_tokens=8, temperature=0.0).choices[0]
    # Tools change the prompt (their system block), not how text comes back.
    assert isinstance(choice.message.content, str) and isinstance(plain.message.content, str)


def test_tool_round_trip_renders_calls_and_results(server: LiveServer) -> None:
    first = chat(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=1)
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *USER,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    final = chat(server, messages=messages, tools=TOOLS, max_tokens=6)
    assert final.choices[0].message.role == "assistant"
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert f'<tool_call>\n{{"name": "{call.function.name}", "arguments": ' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text


def test_json_schema_and_json_object_outputs_are_valid(server: LiveServer) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    for seed in range(4):
        response = chat(server, response_format=response_format, temperature=1.0, seed=seed, n=2)
        shapes.check_chat(response.model_dump(exclude_unset=True), n_choices=2)
        for choice in response.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        content, calls, finish = stream_chat(
            server, response_format=response_format, temperature=1.0, seed=seed
        )
        assert (content, calls, finish) == (response.choices[0].message.content, [], "stop")
    plain = chat(server, response_format={"type": "json_object"}, temperature=0.0, max_tokens=200)
    if plain.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(plain.choices[0].message.content), dict)


def test_structured_outputs_on_both_endpoints(server: LiveServer) -> None:
    c = client(server)
    extra = {"structured_outputs": {"choice": ["red", "green", "blue"]}}
    for stream in (False, True):
        result = c.completions.create(
            model="tiny", prompt="Pick a colour:", max_tokens=10, stream=stream, extra_body=extra
        )
        text = "".join(ch.choices[0].text for ch in result) if stream else result.choices[0].text
        assert text in ("red", "green", "blue")
    # [0-9], not \d: the grammar engine's \d is every Unicode digit, newer than Python's.
    regex = {"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}
    answer = chat(server, extra_body=regex).choices[0].message.content
    assert len(answer) == 6 and answer[3] == "-" and answer[:3].isdigit()
    schema = {"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}}
    jsonschema.validate(
        json.loads(chat(server, extra_body=schema).choices[0].message.content), SCHEMA
    )


def test_chat_message_shapes_the_sdk_sends(server: LiveServer) -> None:
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": None, "refusal": "I can't.", "tool_calls": []},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
        {"role": "user", "content": "Again?"},
    ]
    response = chat(server, messages=messages, max_tokens=3, logprobs=True, top_logprobs=2)
    shapes.check_chat(response.model_dump(exclude_unset=True), n_choices=1, logprobs=True)
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()["prompt"]
    for said in ("Be brief.", "Hi", "I can't.", "No.", "Again?"):
        assert f"\n{said}</s>" in text


def post(server: LiveServer, body: dict[str, Any], path: str = "/v1/chat/completions") -> Any:
    return httpx.post(f"{server.url}{path}", json={"max_tokens": 4, **body}, timeout=60)


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


NAMED_MISSING = {"type": "function", "function": {"name": "nope"}}
BAD = [
    ({"response_format": json_schema_format({"type": "strin"})}, "response_format", "strin"),
    ({"response_format": json_schema_format({"not": {}})}, "response_format", "not"),
    ({"tools": TOOLS, "tool_choice": NAMED_MISSING}, "tool_choice", "nope"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools", "name"),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}],
            "tool_choice": "required",
        },
        "tools",
        "type",
    ),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "tools"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0].type",
        "image_url",
    ),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "tool"),
    ({"guided_json": SCHEMA}, "guided_json", "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "one of"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("body", "param", "named"), BAD)
def test_bad_constraints_and_tools_are_openai_400s(
    server: LiveServer, body: dict, param: str, named: str, stream: bool
) -> None:
    response = post(server, {"messages": USER, "stream": stream, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param)
    assert named in error["message"]


def test_bad_schema_on_completions_is_a_400(server: LiveServer) -> None:
    body = {"prompt": "x", "structured_outputs": {"json": {"type": "object", "not": {}}}}
    response = post(server, body, "/v1/completions")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "structured_outputs.json"
