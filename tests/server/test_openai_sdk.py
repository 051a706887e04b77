"""The official openai SDK, sync and async, against a real uvicorn server."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from tests.server import shapes
from tests.server.live import LiveServer


@pytest.fixture(params=["tiny", "default"])
def server(request: pytest.FixtureRequest) -> LiveServer:
    name = "tiny_server" if request.param == "tiny" else "default_server"
    return request.getfixturevalue(name)


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def aclient(server: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def model_of(server: LiveServer) -> str:
    return client(server).models.list().data[0].id


PROMPT = "t10 t11 t12 t13 t14 t15 t16 t17 The history of the printing press begins"


def test_models_endpoint(server: LiveServer) -> None:
    models = client(server).models.list()
    assert len(models.data) == 1 and models.data[0].object == "model"


def a_word_of(text: str) -> str:
    """A word from the second half of `text`: a stop string the model really emits."""
    words = text[len(text) // 2 :].split()
    assert words, f"no word to stop at in {text!r}"
    return words[len(words) // 2]


def test_completion_n2_stop_logprobs_seed(server: LiveServer) -> None:
    c = client(server)
    kwargs: dict[str, Any] = dict(
        model=model_of(server),
        prompt=PROMPT,
        max_tokens=12,
        n=2,
        temperature=0.9,
        seed=11,
        logprobs=3,
    )
    free = c.completions.create(**kwargs)
    shapes.check_completion(free.model_dump(exclude_unset=True), n_choices=2, logprobs=True)
    for choice in free.choices:
        assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs)
    stop = a_word_of(free.choices[0].text)
    stopped = c.completions.create(**kwargs, stop=[stop])
    shapes.check_completion(stopped.model_dump(exclude_unset=True), n_choices=2, logprobs=True)
    # Seeded: each choice samples what it sampled before, and ends where the stop begins.
    for before, after in zip(free.choices, stopped.choices, strict=True):
        if stop in before.text:
            assert after.text == before.text[: before.text.index(stop)]
            assert (after.finish_reason, after.stop_reason) == ("stop", stop)
        else:
            assert (after.text, after.finish_reason) == (before.text, before.finish_reason)
    assert stopped.choices[0].finish_reason == "stop"


def test_completion_stream_with_usage(server: LiveServer) -> None:
    stream = client(server).completions.create(
        model=model_of(server),
        prompt=PROMPT,
        max_tokens=10,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0.0,
    )
    chunks = [chunk.model_dump(exclude_unset=True) for chunk in stream]
    texts = shapes.check_stream(chunks, "completion", n_choices=2)
    assert texts[0] == texts[1]  # greedy: both samples agree
    assert chunks[-1]["usage"]["completion_tokens"] > 0


def test_chat_sync_and_stream(server: LiveServer) -> None:
    c = client(server)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    full = c.chat.completions.create(
        model=model_of(server),
        messages=messages,
        max_tokens=16,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
    )
    shapes.check_chat(full.model_dump(exclude_unset=True), n_choices=1, logprobs=True)
    stream = c.chat.completions.create(
        model=model_of(server), messages=messages, max_tokens=16, temperature=0.0, stream=True
    )
    texts = shapes.check_stream(
        [ch.model_dump(exclude_unset=True) for ch in stream], "chat", n_choices=1
    )
    assert texts[0] == full.choices[0].message.content


def test_async_chat_n2_seeded(server: LiveServer) -> None:
    async def run() -> tuple[list[str], list[str]]:
        c = aclient(server)
        kwargs: dict[str, Any] = dict(
            model=model_of(server),
            messages=[{"role": "user", "content": "Tell me a story about a dragon."}],
            max_tokens=12,
            n=2,
            seed=5,
            temperature=1.0,
        )
        a, b = await asyncio.gather(
            c.chat.completions.create(**kwargs), c.chat.completions.create(**kwargs)
        )
        shapes.check_chat(a.model_dump(exclude_unset=True), n_choices=2)
        stream = await c.chat.completions.create(**kwargs, stream=True)
        chunks = [chunk.model_dump(exclude_unset=True) async for chunk in stream]
        streamed = shapes.check_stream(chunks, "chat", n_choices=2)
        assert [streamed[0], streamed[1]] == [ch.message.content for ch in a.choices]
        return [ch.message.content for ch in a.choices], [ch.message.content for ch in b.choices]

    first, second = asyncio.run(run())
    assert first == second


def test_async_completion_stream(server: LiveServer) -> None:
    async def run() -> list[dict[str, Any]]:
        c = aclient(server)
        stream = await c.completions.create(
            model=model_of(server), prompt=PROMPT, max_tokens=8, stream=True, temperature=0.0
        )
        return [chunk.model_dump(exclude_unset=True) async for chunk in stream]

    shapes.check_stream(asyncio.run(run()), "completion", n_choices=1)


def test_cached_tokens_reported(tiny_server: LiveServer) -> None:
    c = client(tiny_server)
    prompt = " ".join(f"t{i % 200 + 20}" for i in range(80))
    c.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    second = c.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert second.usage.prompt_tokens_details.cached_tokens >= 64
    # n > 1: usage counts the prompt once, and so its cached tokens.
    fresh = " ".join(f"t{i % 200 + 30}" for i in range(80))
    first_n = c.completions.create(model="tiny", prompt=fresh, max_tokens=2, n=3)
    assert first_n.usage.prompt_tokens == 80
    assert first_n.usage.prompt_tokens_details.cached_tokens == 0
    again_n = c.completions.create(model="tiny", prompt=fresh, max_tokens=2, n=3)
    assert again_n.usage.prompt_tokens_details.cached_tokens == 64


def test_echo_with_logprobs(tiny_server: LiveServer) -> None:
    out = client(tiny_server).completions.create(
        model="tiny", prompt="t20 t21 t22 t23", max_tokens=3, echo=True, logprobs=1, temperature=0
    )
    choice = out.choices[0]
    assert choice.text.startswith("t20 t21 t22 t23")
    assert choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.tokens) == 4 + 3
