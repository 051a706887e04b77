"""Schemathesis against the server's own /openapi.json: generated requests, valid and
invalid, for every operation; no 5xx, and every response matches the documented schema.

A bounded run (a fixed number of cases per operation and mode, derandomized so CI sees
the same cases every time) on the tiny model, with small n and max_tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck
from schemathesis.checks import not_a_server_error, response_schema_conformance
from schemathesis.generation import GenerationMode

from tests.server.conftest import tiny_engine
from tests.server.live import LiveServer

CASES_PER_OPERATION = 40
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
SETTINGS = hypothesis.settings(
    max_examples=CASES_PER_OPERATION,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def api(tiny_model_dir: Path) -> Iterator[LiveServer]:
    engine = tiny_engine(tiny_model_dir, max_model_len=64, num_kv_blocks=64)
    with LiveServer(engine, served_model_name="tiny", max_num_queued_reqs=32) as server:
        yield server


def test_the_document_describes_the_request_bodies(api: LiveServer) -> None:
    schema = schemathesis.openapi.from_url(f"{api.url}/openapi.json")
    document = schema.raw_schema
    bodies = {
        path: op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        for path, item in document["paths"].items()
        for op in item.values()
        if "requestBody" in op
    }
    assert bodies == {
        "/v1/completions": "#/components/schemas/CompletionRequest",
        "/v1/chat/completions": "#/components/schemas/ChatCompletionRequest",
        "/v1/completions/render": "#/components/schemas/CompletionRequest",
        "/v1/chat/completions/render": "#/components/schemas/ChatCompletionRequest",
        "/tokenize": "#/components/schemas/TokenizeRequest",
        "/detokenize": "#/components/schemas/DetokenizeRequest",
        "/v1/embeddings": "#/components/schemas/EmbeddingRequest",
        "/v1/responses": "#/components/schemas/ResponsesRequest",
        "/v1/load_lora_adapter": "#/components/schemas/LoadLoRAAdapterRequest",
        "/v1/unload_lora_adapter": "#/components/schemas/UnloadLoRAAdapterRequest",
    }
    completion = document["components"]["schemas"]["CompletionRequest"]
    assert completion["additionalProperties"] is False and completion["required"] == ["prompt"]
    assert completion["properties"]["n"]["anyOf"][0] == {
        "type": "integer",
        "minimum": 1,
        "maximum": 128,
    }


def small(body: Any) -> Any:
    """Keeps generated requests cheap: at most 2 choices of at most 4 tokens."""
    if isinstance(body, dict):
        limits = (("n", 2), ("max_tokens", 4), ("max_completion_tokens", 4),
                  ("max_output_tokens", 4))  # fmt: skip
        for name, limit in limits:
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > limit:
                body[name] = limit
    return body


def operations(api: LiveServer) -> list[Any]:
    schema = schemathesis.openapi.from_url(f"{api.url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def run_operation(api: LiveServer, operation: Any, mode: GenerationMode) -> int:
    """Runs the operation's generated cases; returns how many reached the server."""
    calls = 0

    @SETTINGS
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        nonlocal calls
        case.body = small(case.body)
        response = case.call(base_url=api.url, timeout=60)
        case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
        calls += 1

    run()
    return calls


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_no_server_error_and_every_response_as_documented(
    api: LiveServer, mode: GenerationMode
) -> None:
    ops = operations(api)
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /metrics"} <= {
        op.label for op in ops
    }
    if mode is GenerationMode.NEGATIVE:  # only bodies can be invalid here
        ops = [op for op in ops if op.method.upper() == "POST" and "{" not in op.path]
    calls = {op.label: run_operation(api, op, mode) for op in ops}
    assert sum(calls.values()) >= len(ops) * 5, calls
    # Which generated cases pass validation varies with the order tests run in (hypothesis
    # shares state across a session), and a sampled request may end on a stop string or
    # EOS before max_tokens: any finished generation shows the engine ran.
    finished = sum(
        api.metric("vllm:request_success_total", finished_reason=reason)
        for reason in ("length", "stop")
    )
    assert finished > 0, "no generated request ever ran the engine"
