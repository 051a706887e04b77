"""The step orders of the engine core served from its own process: speculative decoding
(--speculative-config) and async scheduling (--async-scheduling, CUDA's default) give the
openai SDK the same greedy text as a server without them, streamed or not, and /metrics
counts the drafts under vLLM's names."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.server.conftest import tiny_engine
from tests.server.live import LiveServer

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
PROMPT = [11, 12, 13, 14, 15, 16, 11, 12, 13, 14, 15, 16, 11, 12, 13]


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path) -> Iterator[tuple[LiveServer, LiveServer]]:
    speculative = tiny_engine(
        tiny_model_dir, speculative_config=json.dumps(SPEC), engine_in_process=False
    )
    with (
        LiveServer(tiny_engine(tiny_model_dir), served_model_name="tiny") as plain,
        LiveServer(speculative, served_model_name="tiny") as spec,
    ):
        yield plain, spec


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_same_text_and_counted_drafts(servers) -> None:
    plain, spec = servers
    body = dict(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0.0)
    expected = client(plain).completions.create(**body)  # type: ignore[call-overload]
    got = client(spec).completions.create(**body)  # type: ignore[call-overload]
    assert got.choices[0].text == expected.choices[0].text
    assert got.usage.completion_tokens == expected.usage.completion_tokens == 40
    stream = client(spec).completions.create(stream=True, **body)  # type: ignore[call-overload]
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == (
        expected.choices[0].text
    )
    drafted = spec.metric("vllm:spec_decode_num_draft_tokens_total")
    accepted = spec.metric("vllm:spec_decode_num_accepted_tokens_total")
    assert spec.metric("vllm:spec_decode_num_drafts_total") > 0
    assert 0 < accepted <= drafted
    per_position = [
        spec.metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
        for i in range(SPEC["num_speculative_tokens"])
    ]  # every position is exported, accepted drafts or not
    assert sum(per_position) == accepted and per_position[0] > 0
    assert plain.metric("vllm:spec_decode_num_draft_tokens_total") == 0
    # Logprobs of accepted drafts: one entry a token, as without speculation.
    body = dict(body, logprobs=2)
    expected = client(plain).completions.create(**body)  # type: ignore[call-overload]
    got = client(spec).completions.create(**body)  # type: ignore[call-overload]
    assert got.choices[0].logprobs.tokens == expected.choices[0].logprobs.tokens
    assert len(got.choices[0].logprobs.token_logprobs) == 40
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(
        expected.choices[0].logprobs.token_logprobs, abs=1e-4
    )


def test_async_scheduling_through_the_core_process(tiny_model_dir: Path, servers) -> None:
    """--async-scheduling (CUDA's default) served by the engine core in its own process:
    the same greedy text, streamed and not, as the plain server, for requests that stop on
    a token and by length, with logprobs."""
    plain, _ = servers
    overlapped = tiny_engine(tiny_model_dir, async_scheduling=True, engine_in_process=False)
    with LiveServer(overlapped, served_model_name="tiny") as server:
        prompts = [PROMPT, PROMPT[:7], [40, 41, 42, 43]]
        for prompt in prompts:
            plain_out = client(plain).completions.create(
                model="tiny", prompt=prompt, max_tokens=30, temperature=0.0, logprobs=2
            )
            stop = plain_out.choices[0].logprobs.tokens[5]  # type: ignore[union-attr]
            for body in (
                dict(max_tokens=30, logprobs=2),
                dict(max_tokens=30, stop=[stop]),
                dict(max_tokens=3),
            ):
                expected = client(plain).completions.create(
                    model="tiny", prompt=prompt, temperature=0.0, **body
                )
                got = client(server).completions.create(
                    model="tiny", prompt=prompt, temperature=0.0, **body
                )
                stream = client(server).completions.create(
                    model="tiny", prompt=prompt, temperature=0.0, stream=True, **body
                )
                streamed = "".join(c.choices[0].text for c in stream if c.choices)
                assert got.choices[0].text == expected.choices[0].text == streamed
                assert got.choices[0].finish_reason == expected.choices[0].finish_reason
                if "logprobs" in body:
                    assert got.choices[0].logprobs.token_logprobs == pytest.approx(  # type: ignore[union-attr]
                        expected.choices[0].logprobs.token_logprobs,
                        abs=1e-4,  # type: ignore[union-attr]
                    )
        assert server.wait_idle(10)


def test_draft_model_through_the_core_process(tiny_model_dir: Path, servers) -> None:
    """A draft model (here the target itself, so every draft is accepted) in the engine
    core's process: the plain server's greedy text, streamed and not, and /metrics counts
    its drafts."""
    plain, _ = servers
    spec = {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 3}
    engine = tiny_engine(
        tiny_model_dir, speculative_config=json.dumps(spec), engine_in_process=False
    )
    with LiveServer(engine, served_model_name="tiny") as server:
        for prompt in (PROMPT, [40, 41, 42, 43]):
            body = dict(model="tiny", prompt=prompt, max_tokens=30, temperature=0.0)
            expected = client(plain).completions.create(**body)  # type: ignore[call-overload]
            got = client(server).completions.create(**body)  # type: ignore[call-overload]
            stream = client(server).completions.create(stream=True, **body)  # type: ignore[call-overload]
            streamed = "".join(c.choices[0].text for c in stream if c.choices)
            assert got.choices[0].text == expected.choices[0].text == streamed
        drafted = server.metric("vllm:spec_decode_num_draft_tokens_total")
        assert drafted > 0
        assert server.metric("vllm:spec_decode_num_accepted_tokens_total") == drafted
