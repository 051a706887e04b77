"""Gateway behaviour against a live server: parity with the engine, concurrency,
disconnects, bad input, auth, limits and the auxiliary endpoints."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from tests.server.conftest import tiny_engine
from tests.server.live import LiveServer

TEXTS = [
    "The history of the printing press begins in",
    "Photosynthesis is the process by which",
    "Once upon a time, in a land far away,",
    "The three laws of motion are",
]


def post(server: LiveServer, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60, **kwargs)


def test_greedy_completion_equals_offline_engine(
    default_server: LiveServer, default_model_dir: Path
) -> None:
    llm = LLM(str(default_model_dir), dtype="float32", max_model_len=1024, num_kv_blocks=256)
    expected = llm.generate(TEXTS, SamplingParams(temperature=0.0, max_tokens=24))
    for text, want in zip(TEXTS, expected, strict=True):
        body = post(
            default_server, "/v1/completions", {"prompt": text, "max_tokens": 24, "temperature": 0}
        ).json()
        assert body["choices"][0]["text"] == want.outputs[0].text
        assert body["usage"]["completion_tokens"] == len(want.outputs[0].token_ids)


def test_sixteen_concurrent_streams(default_server: LiveServer, default_model_dir: Path) -> None:
    prompts = [f"{TEXTS[i % 4]} (variant {i})" for i in range(16)]
    llm = LLM(str(default_model_dir), dtype="float32", max_model_len=1024, num_kv_blocks=256)
    expected = [
        o.outputs[0].text
        for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20))
    ]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(
            model=client_model, prompt=prompt, max_tokens=20, temperature=0.0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{default_server.url}/v1", api_key="x", max_retries=0)
        return await asyncio.gather(*(one(client, p) for p in prompts))

    client_model = default_server.state.serving.model_name
    assert asyncio.run(run()) == expected


def test_disconnects_free_their_blocks(tiny_model_dir: Path) -> None:
    with LiveServer(
        tiny_engine(tiny_model_dir, max_num_seqs=16), served_model_name="tiny"
    ) as server:
        body = {"prompt": "t10 t11 t12 t13", "max_tokens": 200, "ignore_eos": True, "stream": True}

        async def hang_up_after_first_chunk(client: httpx.AsyncClient) -> None:
            async with client.stream("POST", f"{server.url}/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        return  # leaving the context closes the connection

        async def run() -> None:
            async with httpx.AsyncClient(timeout=30) as client:
                await asyncio.gather(*(hang_up_after_first_chunk(client) for _ in range(10)))

        asyncio.run(run())
        assert server.wait_idle(2.0), "aborted requests still hold the engine"
        server.engine.core.scheduler.kv_cache.check_invariants()
        assert server.metric("vllm:num_requests_running") == 0
        assert server.metric("vllm:kv_cache_usage_perc") == 0


USER = [{"role": "user", "content": "t10"}]
BAD_REQUESTS = [
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", {"prompt": 12.5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "t10", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "t10", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "t10", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "t10", "model": "gpt-17"}, 404, "model"),
    ("/v1/completions", {"prompt": "t10 " * 300, "max_tokens": 1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "t10", "frobnicate": True}, 400, "frobnicate"),
    ("/v1/completions", {"prompt": "t10", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "t10", "suffix": "x"}, 400, "suffix"),
    ("/v1/completions", {"prompt": [999999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "t10", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "t10", "stream_options": {}}, 400, "stream_options"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools"),
    (
        "/v1/chat/completions",
        {"messages": USER, "response_format": {"type": "json_schema"}},
        400,
        "response_format",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "t10"}]}, 400, None),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "metadata": {"k": "v"}}, 400, "metadata"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_input_gets_openai_shaped_4xx(
    tiny_server: LiveServer, path: str, body: Any, status: int, param: str | None
) -> None:
    response = post(tiny_server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        # The top-level field, as in OpenAI's "tools[0].function".
        assert error["param"] is not None and re.split(r"[.\[]", error["param"])[0] == param
    # ...and the server keeps serving.
    ok = post(tiny_server, "/v1/completions", {"prompt": "t10 t11", "max_tokens": 2})
    assert ok.status_code == 200


def test_tools_on_a_template_without_tool_support_name_the_flag(tiny_server: LiveServer) -> None:
    """The default --tool-call-parser auto finds no tool format in this template."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    response = post(tiny_server, "/v1/chat/completions", {"messages": USER, "tools": [tool]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tools" and "--tool-call-parser hermes" in error["message"]


def test_context_length_exceeded_code(tiny_server: LiveServer) -> None:
    response = post(tiny_server, "/v1/completions", {"prompt": "t10 " * 300, "max_tokens": 1})
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_null_fields_count_as_absent(tiny_server: LiveServer) -> None:
    body = {"prompt": "t10 t11", "max_tokens": 2, "temperature": None, "suffix": None, "stop": None}
    assert post(tiny_server, "/v1/completions", body).status_code == 200
    chat = {"messages": [{"role": "user", "content": "t10"}], "tools": None, "max_tokens": 2}
    assert post(tiny_server, "/v1/chat/completions", chat).status_code == 200


def test_unknown_path_and_oversized_body(tiny_model_dir: Path) -> None:
    with LiveServer(tiny_engine(tiny_model_dir), max_request_bytes=1024) as server:
        assert httpx.get(f"{server.url}/v2/nothing").status_code == 404
        big = {"prompt": "t10 " * 2000}
        response = post(server, "/v1/completions", big)
        assert response.status_code == 413 and response.json()["error"]["message"]
        # Chunked upload without Content-Length is cut off the same way.
        chunks = (b"x" * 512 for _ in range(8))
        response = httpx.post(f"{server.url}/v1/completions", content=chunks)
        assert response.status_code == 413


def test_api_key(tiny_model_dir: Path) -> None:
    with LiveServer(
        tiny_engine(tiny_model_dir), api_key=["s3cret"], served_model_name="tiny"
    ) as server:
        body = {"prompt": "t10", "max_tokens": 1}
        assert post(server, "/v1/completions", body).status_code == 401
        wrong = post(server, "/v1/completions", body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        good = post(server, "/v1/completions", body, headers={"Authorization": "Bearer s3cret"})
        assert good.status_code == 200
        for open_path in ("/health", "/ready", "/metrics"):
            assert httpx.get(f"{server.url}{open_path}").status_code == 200
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0)
        assert sdk.completions.create(model="tiny", prompt="t10", max_tokens=1).choices


def test_request_id_is_honoured_and_echoed(tiny_server: LiveServer) -> None:
    response = post(
        tiny_server,
        "/v1/completions",
        {"prompt": "t10", "max_tokens": 1},
        headers={"X-Request-Id": "abc-123"},
    )
    assert response.headers["x-request-id"] == "abc-123"
    assert response.json()["id"] == "cmpl-abc-123"
    generated = post(tiny_server, "/v1/completions", {"prompt": "t10", "max_tokens": 1})
    assert len(generated.headers["x-request-id"]) == 32


def test_tokenize_detokenize_version(tiny_server: LiveServer) -> None:
    tokens = post(tiny_server, "/tokenize", {"prompt": "t10 t11 t12"}).json()
    assert tokens["tokens"] == [10, 11, 12] and tokens["count"] == 3
    chat = post(tiny_server, "/tokenize", {"messages": [{"role": "user", "content": "t10"}]}).json()
    assert chat["tokens"] == [3, 10, 5, 6]
    assert post(tiny_server, "/detokenize", {"tokens": [10, 11]}).json()["prompt"] == "t10 t11"
    assert post(tiny_server, "/detokenize", {"tokens": [100000]}).status_code == 400
    assert httpx.get(f"{tiny_server.url}/version").json()["version"]


def test_stop_string_aborts_and_never_leaks(tiny_server: LiveServer) -> None:
    greedy = {"prompt": "t10 t11 t12", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = post(tiny_server, "/v1/completions", greedy).json()["choices"][0]["text"]
    words = full.split()
    stop = words[3]
    stopped = post(tiny_server, "/v1/completions", greedy | {"stop": [stop]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == stop
    assert stop not in stopped["text"] and full.startswith(stopped["text"])
    with httpx.stream(
        "POST", f"{tiny_server.url}/v1/completions", json=greedy | {"stop": [stop], "stream": True}
    ) as r:
        streamed = "".join(
            json.loads(line[5:])["choices"][0]["text"]
            for line in r.iter_lines()
            if line.startswith("data:") and "[DONE]" not in line
        )
    assert streamed == stopped["text"]


def test_one_log_line_per_request_without_its_text(
    tiny_server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    prompt = "t101 t102 t103 t104"
    with caplog.at_level(logging.INFO, logger="pagedserve.requests"):
        body = {"prompt": prompt, "max_tokens": 3, "n": 2, "user": "alice", "temperature": 0}
        response = post(tiny_server, "/v1/completions", body, headers={"X-Request-Id": "log-me"})
        deadline = time.monotonic() + 5
        while len(caplog.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    records = [r for r in caplog.records if r.name == "pagedserve.requests"]
    assert len(records) == 2  # one per engine request (n=2)
    fields = (
        "request_id",
        "user",
        "prompt_tokens",
        "cached_tokens",
        "output_tokens",
        "ttft_s",
        "total_s",
        "finish_reason",
    )
    completion = response.json()["choices"][0]["text"]
    for record in records:
        values = {name: getattr(record, name) for name in fields}
        assert values["request_id"].startswith("log-me-") and values["user"] == "alice"
        assert (values["prompt_tokens"], values["output_tokens"]) == (4, 3)
        assert values["finish_reason"] == "length" and values["ttft_s"] is not None
        text = record.getMessage() + " ".join(str(v) for v in values.values())
        assert prompt not in text and completion.strip() not in text
