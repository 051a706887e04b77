"""Structured outputs and tool calling with the default model (SmolLM2-135M-Instruct), the
way applications use them through the openai SDK. One server for the module; requests run
concurrently so the engine batches them, and answers stay short."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from engine import AsyncLLM, EngineArgs
from tests.server.live import LiveServer

pytestmark = pytest.mark.slow
T = TypeVar("T")
MODEL = "SmolLM2-135M-Instruct"


class Address(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


class Person(BaseModel):  # nested objects
    name: str = Field(max_length=24)
    address: Address


class Recipe(BaseModel):  # arrays
    title: str = Field(max_length=30)
    ingredients: list[Annotated[str, Field(max_length=20)]] = Field(min_length=1, max_length=4)


class Sentiment(str, Enum):
    positive = "positive"
    negative = "negative"
    neutral = "neutral"


class Review(BaseModel):  # enums, bounded integers
    sentiment: Sentiment
    stars: int = Field(ge=1, le=5)


class Event(BaseModel):  # optional fields
    name: str = Field(max_length=30)
    year: int | None = Field(ge=0, le=2100)
    location: str | None = Field(max_length=20)


class Product(BaseModel):  # string patterns, numbers with bounds
    sku: str = Field(pattern=r"^[A-Z]{3}-[0-9]{3}$")
    price: float = Field(ge=0, le=1000)
    quantity: int = Field(ge=1, le=99)


CASES: list[tuple[type[BaseModel], str]] = [
    (Person, "Invent a person and where they live."),
    (Recipe, "Give a simple pancake recipe."),
    (Review, "Review this: 'The food was great and the staff were kind.'"),
    (Event, "Describe a famous historical event."),
    (Product, "Describe a product in a hardware store with its SKU, price and quantity."),
]
SAMPLINGS = [dict(temperature=0.0), dict(temperature=1.0, seed=1), dict(temperature=1.0, seed=2)]


@pytest.fixture(scope="module")
def default_server(default_model_dir: Path) -> Iterator[LiveServer]:
    """The default model with a small KV cache (the suite runs several servers)."""
    args = EngineArgs(
        model=str(default_model_dir),
        dtype="float32",
        max_model_len=1024,
        kv_cache_memory=512 << 20,
        engine_in_process=True,
    )
    # SmolLM2's template has no tool support: the built-in Hermes prompt describes tools.
    with LiveServer(AsyncLLM.from_engine_args(args), tool_call_parser="hermes") as server:
        yield server


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def in_parallel(jobs: list[Callable[[], T]]) -> list[T]:
    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(lambda job: job(), jobs))


def parse(server: LiveServer, model: type[BaseModel], prompt: str, stream: bool, **kw: Any):
    """(content, parsed) through the SDK's parse() or its streaming helper."""
    request: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        response_format=model,
        max_tokens=200,
        **kw,
    )
    c = client(server)
    if stream:
        with c.chat.completions.stream(**request) as events:
            completion = events.get_final_completion()
    else:
        completion = c.chat.completions.parse(**request)
    message = completion.choices[0].message
    return message.content, message.parsed


def test_sdk_parse_returns_valid_objects_streamed_and_not(default_server: LiveServer) -> None:
    jobs = [
        (lambda m=m, p=p, s=s, kw=kw: parse(default_server, m, p, s, **kw))
        for m, p in CASES
        for s in (False, True)
        for kw in SAMPLINGS
    ]
    results = in_parallel(jobs)
    models = [m for m, _ in CASES for _ in (False, True) for _ in SAMPLINGS]
    for model, (content, parsed) in zip(models, results, strict=True):
        assert isinstance(parsed, model)
        jsonschema.validate(json.loads(content), model.model_json_schema())


TOPICS = [
    "a book", "a city", "a planet", "a recipe", "a car", "a song", "a programming language",
    "a mountain", "a river", "a painter", "a fruit", "a sport", "a country", "a musical "
    "instrument", "a bird", "a board game", "a flower", "a scientist", "a lake", "a desert",
]  # fmt: skip


def ask_for_json(topic: str) -> list[dict[str, str]]:
    request = f'Name {topic}. Answer with a JSON object with two keys: "name" and "reason".'
    return [{"role": "user", "content": request}]


def test_json_object_mode_always_parses(default_server: LiveServer) -> None:
    """The 20 prompts go in one request, so they always share the same steps: a greedy
    answer can depend on the batch's shape (a near-tie may flip), and this test must not
    depend on timing."""
    url = default_server.url
    prompts = [
        httpx.post(f"{url}/tokenize", json={"messages": ask_for_json(t)}).json()["tokens"]
        for t in TOPICS
    ]
    body = {
        "prompt": prompts,
        "structured_outputs": {"json_object": True},
        "max_tokens": 300,
        "temperature": 0.0,
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()
    assert len(response["choices"]) == len(TOPICS)
    for choice in response["choices"]:
        assert choice["finish_reason"] == "stop", choice["text"]
        assert isinstance(json.loads(choice["text"]), dict)
        assert "\n" not in choice["text"]  # no runaway whitespace
    # The chat API's spelling of the same mode.
    chat = client(default_server).chat.completions.create(
        model=MODEL,
        messages=ask_for_json(TOPICS[0]),  # type: ignore[arg-type]
        response_format={"type": "json_object"},
        max_tokens=300,
        temperature=0.0,
    )
    assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
ARGS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def test_tool_calls_with_the_default_model_and_a_round_trip(default_server: LiveServer) -> None:
    c = client(default_server)
    messages: list[Any] = [{"role": "user", "content": "What's the weather in Paris right now?"}]
    base: dict[str, Any] = dict(model=MODEL, tools=[WEATHER, TIME], max_tokens=80)
    named = {"type": "function", "function": {"name": "get_time"}}
    # With parallel calls allowed the grammar lets a model add calls until max_tokens, and
    # this small one sometimes does (the tiny-model tests cover parallel calls); here every
    # answer is one call, so every call must be complete and valid.
    jobs = [
        dict(tool_choice="required", parallel_tool_calls=False),
        dict(tool_choice=named),
        dict(tool_choice=named, temperature=1.0, seed=3),
        dict(tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=3),
    ]
    responses = [c.chat.completions.create(messages=messages, **job, **base) for job in jobs]
    for response in responses:
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        (call,) = choice.message.tool_calls or []
        jsonschema.validate(json.loads(call.function.arguments), ARGS[call.function.name])
    assert [r.choices[0].message.tool_calls[0].function.name for r in responses[1:3]] == [
        "get_time",
        "get_time",
    ]
    required = responses[0]

    call = required.choices[0].message.tool_calls[0]
    messages += [
        required.choices[0].message,
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    final = c.chat.completions.create(messages=messages, **base)
    choice = final.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert choice.message.content or choice.message.tool_calls
