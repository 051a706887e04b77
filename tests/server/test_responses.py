"""/v1/responses through the official SDK against a real server: each response is the chat
completion of its items, streamed events add up to it, previous_response_id continues the
conversation (across a restart, and across replicas sharing Redis), stores are per tenant
and expire, background responses poll and cancel, and what is not supported is a 400."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine import AsyncLLM, EngineArgs
from server import response_store
from server.response_store import RedisStore, SqliteStore, StoredResponse
from tests.server.live import LiveServer
from tests.tiny_models import make_tiny_model

KEYS = {"key-a": "team-a", "key-b": "team-b"}
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
]
ANSWER = {
    "format": {
        "type": "json_schema",
        "name": "answer",
        "schema": {
            "type": "object",
            "properties": {"a": {"enum": ["yes", "no"]}},
            "required": ["a"],
            "additionalProperties": False,
        },
        "strict": True,
    }
}
GREEDY: dict[str, Any] = {"model": "tiny", "temperature": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("responses"), byte_level=True)


def engine(path: Path) -> AsyncLLM:
    args = EngineArgs(
        model=str(path),
        dtype="float32",
        num_kv_blocks=512,
        max_model_len=2048,
        engine_in_process=True,
    )
    return AsyncLLM.from_engine_args(args)


def serve(path: Path, store: str, **settings: Any) -> LiveServer:
    return LiveServer(
        engine(path),
        served_model_name="tiny",
        tool_call_parser="hermes",
        responses_store=store,
        **settings,
    )


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("".join(f"{key} {tenant}\n" for key, tenant in KEYS.items()))
    store = f"sqlite:{tmp_path_factory.mktemp('store') / 'responses.db'}"
    with serve(model_dir, store, api_keys_file=str(keys)) as live:
        yield live


def client(server: LiveServer, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def chat_text(server: LiveServer, messages: list[dict[str, Any]], **kwargs: Any) -> str | None:
    reply = client(server).chat.completions.create(messages=messages, **GREEDY, **kwargs)
    return reply.choices[0].message.content


def second_turn(server: LiveServer, first: Any) -> Any:
    """A turn after `first`, checked to be the chat completion of the conversation so far
    (instructions are not carried over, as OpenAI's are not)."""
    second = client(server).responses.create(
        input="And then?", previous_response_id=first.id, max_output_tokens=6, **GREEDY
    )
    messages = [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    assert second.output_text == chat_text(server, messages, max_tokens=6)
    return second


def test_a_response_is_the_chat_completion_of_its_items(server: LiveServer) -> None:
    sdk = client(server)
    made = sdk.responses.create(
        input="Hello there", instructions="Be brief.", max_output_tokens=8, **GREEDY
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
    ]
    assert made.output_text == chat_text(server, messages, max_tokens=8)
    assert made.status == "incomplete" and made.incomplete_details is not None
    assert made.incomplete_details.reason == "max_output_tokens"
    assert made.usage is not None and made.usage.output_tokens == 8
    assert [item.type for item in made.output] == ["message"]
    got = sdk.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    items = sdk.responses.input_items.list(made.id)
    assert [(i.type, i.role) for i in items.data] == [("message", "user")]


def test_previous_response_id_continues_the_conversation(server: LiveServer) -> None:
    sdk = client(server)
    first = sdk.responses.create(
        input="Hello there", instructions="Be brief.", max_output_tokens=6, **GREEDY
    )
    second = second_turn(server, first)
    assert second.previous_response_id == first.id
    items = sdk.responses.input_items.list(second.id).data
    assert [getattr(i, "role", i.type) for i in items] == ["user", "assistant", "user"]


def test_streamed_events_add_up_to_the_response(server: LiveServer) -> None:
    sdk = client(server)
    whole = sdk.responses.create(input="Yes or no?", text=ANSWER, max_output_tokens=40, **GREEDY)
    assert whole.status == "completed" and json.loads(whole.output_text)["a"] in ("yes", "no")
    with sdk.responses.stream(
        input="Yes or no?", text=ANSWER, max_output_tokens=40, **GREEDY
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    # Cut short by max_output_tokens, the stream ends with response.incomplete, as OpenAI's.
    raw = list(
        sdk.responses.create(input="Hello there", max_output_tokens=5, stream=True, **GREEDY)
    )
    assert raw[-1].type == "response.incomplete"
    assert raw[-1].response.incomplete_details.reason == "max_output_tokens"
    stored = sdk.responses.retrieve(raw[-1].response.id)
    assert stored.output_text == raw[-1].response.output_text


def test_a_function_calling_loop(server: LiveServer) -> None:
    sdk = client(server)
    asked = sdk.responses.create(
        input="The weather in Paris?",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        **GREEDY,
    )
    (call,) = asked.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    with sdk.responses.stream(
        input="The weather in Paris?",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        **GREEDY,
    ) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    (streamed_call,) = streamed.output
    assert streamed_call.type == "function_call" and streamed_call.arguments == call.arguments
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call.arguments
    answered = sdk.responses.create(
        previous_response_id=asked.id,
        tools=TOOLS,
        max_output_tokens=8,
        **GREEDY,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    messages = [
        {"role": "user", "content": "The weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    chat_tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS
    ]
    assert answered.output_text == chat_text(server, messages, tools=chat_tools, max_tokens=8)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"input": "x", "tools": [{"type": "file_search", "vector_store_ids": []}]},
            "tools[0].type",
        ),
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}
                ]
            },
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "web_search_call", "id": "ws"}]}, "input[0].type"),
        ({"input": "x", "background": True, "store": False}, "store"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"input": "x", "bogus": 1}, "bogus"),
        ({"input": "x", "tools": [{"type": "function", "name": 5}]}, "tools[0].function.name"),
    ],
)
def test_what_is_not_supported_is_a_400_naming_it(
    server: LiveServer, body: dict[str, Any], param: str
) -> None:
    reply = httpx.post(
        f"{server.url}/v1/responses", json=body, headers={"Authorization": "Bearer key-a"}
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_stored_responses_belong_to_their_tenant(server: LiveServer) -> None:
    mine = client(server).responses.create(input="Hello", max_output_tokens=2, **GREEDY)
    theirs = client(server, "key-b")
    for call in (
        lambda: theirs.responses.retrieve(mine.id),
        lambda: theirs.responses.delete(mine.id),
        lambda: theirs.responses.create(input="x", previous_response_id=mine.id, **GREEDY),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    not_found = server.metric(
        "pagedserve:api_requests_total", endpoint="GET /v1/responses/{id}", code="404"
    )
    client(server).responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        client(server).responses.retrieve(mine.id)
    after = server.metric(
        "pagedserve:api_requests_total", endpoint="GET /v1/responses/{id}", code="404"
    )
    assert after == not_found + 1
    unstored = client(server).responses.create(
        input="Hello", max_output_tokens=2, store=False, **GREEDY
    )
    with pytest.raises(openai.NotFoundError):
        client(server).responses.retrieve(unstored.id)


def test_background_responses_poll_and_cancel(server: LiveServer) -> None:
    sdk = client(server)
    queued = sdk.responses.create(input="Hello", background=True, max_output_tokens=4, **GREEDY)
    assert queued.status == "queued" and queued.output == []
    deadline = time.monotonic() + 30
    while (done := sdk.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert done.status == "incomplete" and done.usage is not None
    assert (
        done.output_text
        == sdk.responses.create(input="Hello", max_output_tokens=4, **GREEDY).output_text
    )
    long = sdk.responses.create(input="Hello", background=True, max_output_tokens=1900, **GREEDY)
    cancelled = sdk.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert sdk.responses.retrieve(long.id).status == "cancelled"
    assert server.wait_idle(10)
    foreground = sdk.responses.create(input="Hello", max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.BadRequestError):
        sdk.responses.cancel(foreground.id)


def test_a_conversation_spans_a_restart(model_dir: Path, tmp_path: Path) -> None:
    store = f"sqlite:{tmp_path / 'responses.db'}"
    with serve(model_dir, store) as before:
        first = client(before).responses.create(input="Hello there", max_output_tokens=6, **GREEDY)
    with serve(model_dir, store) as after:
        second_turn(after, first)


def test_the_sqlite_store_expires_and_keeps_tenants_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the store's own clock (set here: a sleep of 0.6 s against a 0.5 s TTL failed on
    a loaded CI machine, where the reopening alone took longer than the TTL)."""
    now = [1000.0]
    monkeypatch.setattr(response_store, "time", type("Clock", (), {"time": lambda: now[0]}))

    async def run() -> None:
        store = SqliteStore(tmp_path / "r.db", ttl=0.5)
        record = StoredResponse({"id": "resp_1", "status": "completed"}, [{"type": "message"}])
        await store.put("a", record)
        assert await store.get("b", "resp_1") is None
        await store.close()
        now[0] += 0.4
        reopened = SqliteStore(tmp_path / "r.db", ttl=0.5)
        assert await reopened.get("a", "resp_1") == record
        now[0] += 0.2
        assert await reopened.get("a", "resp_1") is None
        assert not await reopened.delete("a", "resp_1")
        await reopened.close()

    asyncio.run(run())


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    exe = shutil.which("redis-server")
    assert exe, "redis-server is missing: `make test` installs Debian's redis-server package"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    directory = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(directory),
        ],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None, "redis did not start"
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


def test_replicas_share_responses_through_redis(model_dir: Path, redis_url: str) -> None:
    with serve(model_dir, redis_url, responses_ttl=600) as replica:
        first = client(replica).responses.create(input="Hello there", max_output_tokens=6, **GREEDY)

        async def other_replica() -> tuple[StoredResponse | None, StoredResponse | None, int]:
            store = RedisStore(redis_url, ttl=600)
            seen = await store.get("", first.id)
            other_tenant = await store.get("team-b", first.id)
            ttl_ms = await store._redis.pttl(store._key("", first.id))
            await store.close()
            return seen, other_tenant, ttl_ms

        seen, other_tenant, ttl_ms = asyncio.run(other_replica())
        assert seen is not None and seen.response["id"] == first.id
        assert seen.response["output"][0]["content"][0]["text"] == first.output_text
        assert other_tenant is None and 590_000 < ttl_ms <= 600_000
    with serve(model_dir, redis_url) as another:
        second_turn(another, first)


def test_reasoning_content_and_calls_become_items_in_order() -> None:
    """The chat deltas of a reasoning model that answers and calls a tool, as events: each
    item opens, fills and closes before the next, and the closed items are the output."""
    from types import SimpleNamespace

    from server.protocol import ResponsesRequest
    from server.responses import EventStream, Shape, output_items

    ctx = SimpleNamespace(model_name="tiny")
    events = EventStream(Shape(ctx, ResponsesRequest(input="x"), "resp_" + "0" * 32))
    call = {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    deltas = [
        {"reasoning": "think "},
        {"reasoning": "more"},
        {"content": "Let me check."},
        {"tool_calls": [call]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
    ]
    sent = events.start() + [e for d in deltas for e in events.delta(d)] + events.close()
    kinds = [(e["type"], e.get("output_index")) for e in sent]
    assert kinds == [
        ("response.created", None),
        ("response.in_progress", None),
        ("response.output_item.added", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.content_part.added", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.done", 1),
        ("response.content_part.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2),
    ]
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    streamed = [(i["type"], i["status"]) for i in events.output]
    assert streamed == [
        ("reasoning", "completed"),
        ("message", "completed"),
        ("function_call", "completed"),
    ]
    assert events.output[0]["content"][0]["text"] == "think more"
    assert events.output[2]["arguments"] == '{"a": 1}' and events.output[2]["call_id"] == "call_1"
    # The same message, whole, gives the same items.
    message = {
        "reasoning": "think more",
        "content": "Let me check.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
        ],
    }
    whole = output_items(message)
    assert [(i["type"], i.get("call_id")) for i in whole] == [
        (i["type"], i.get("call_id")) for i in events.output
    ]
    assert whole[0]["content"] == events.output[0]["content"]
