"""/metrics after real traffic: names, HELP, counters against usage, promtool, dashboard."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.test_observability_artifacts import (
    EXPOSED_COUNTERS,
    EXPOSED_GAUGES,
    EXPOSED_HISTOGRAMS,
    referenced_metric_names,
)
from tests.server.conftest import tiny_engine
from tests.server.live import LiveServer

# The two promtool lints vLLM's own names trigger, kept for compatibility.
ALLOWED_LINTS = (
    "metric names should not contain ':'",
    'non-counter metrics should not have "_total" suffix',
)

# Exposed only by a server with --enable-lora (tests/server/test_lora.py checks it).
WITH_LORA = {"vllm:lora_requests_info"}


def scrape(server: LiveServer) -> str:
    return httpx.get(f"{server.url}/metrics").text


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(text: str, name: str, **labels: str) -> float:
    return sum(
        v
        for (n, lab), v in samples(text).items()
        if n == name and all(dict(lab).get(k) == want for k, want in labels.items())
    )


@pytest.fixture(scope="module")
def traffic(tiny_model_dir: Path) -> tuple[str, dict[str, int], str, float]:
    """Runs varied requests on a fresh server; returns the scrape, usage sums, and hits."""
    with LiveServer(tiny_engine(tiny_model_dir), served_model_name="tiny") as server:
        usage = {"prompt": 0, "completion": 0, "requests": 0}

        def add(body: dict) -> None:
            usage["prompt"] += body["usage"]["prompt_tokens"]
            usage["completion"] += body["usage"]["completion_tokens"]

        url = f"{server.url}/v1"
        for i in range(3):
            r = httpx.post(
                f"{url}/completions",
                json={"prompt": f"t{10 + i} t11 t12", "max_tokens": 5, "n": 1 + i % 2},
            )
            add(r.json())
            usage["requests"] += 1 + i % 2
        chat = httpx.post(
            f"{url}/chat/completions",
            json={"messages": [{"role": "user", "content": "t30 t31"}], "max_tokens": 4},
        )
        add(chat.json())
        usage["requests"] += 1
        with httpx.stream(
            "POST",
            f"{url}/completions",
            json={
                "prompt": "t40 t41",
                "max_tokens": 6,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as stream:
            import json

            lines = [
                json.loads(line[5:])
                for line in stream.iter_lines()
                if line.startswith("data:") and "DONE" not in line
            ]
        add(lines[-1])
        usage["requests"] += 1
        assert (
            httpx.post(f"{url}/completions", json={"prompt": "t1", "bogus": 1}).status_code == 400
        )

        prefix = " ".join(f"t{20 + i % 200}" for i in range(64))
        add(
            httpx.post(
                f"{url}/completions", json={"prompt": prefix + " t7", "max_tokens": 2}
            ).json()
        )
        usage["requests"] += 1
        hits_before = total(scrape(server), "vllm:prefix_cache_hits_total")
        add(
            httpx.post(
                f"{url}/completions", json={"prompt": prefix + " t8", "max_tokens": 2}
            ).json()
        )
        usage["requests"] += 1
        text = scrape(server)
        return text, usage, server.state.serving.model_name, hits_before  # type: ignore[return-value]


def test_every_metric_is_exposed_with_help_and_model_name(traffic) -> None:
    text, _, model, _ = traffic
    families = {f.name: f for f in text_string_to_metric_families(text)}
    wanted = (
        {n.removesuffix("_total") for n in EXPOSED_COUNTERS} | EXPOSED_GAUGES | EXPOSED_HISTOGRAMS
    ) - WITH_LORA
    assert wanted <= set(families), wanted - set(families)
    for name in wanted:
        assert families[name].documentation, f"{name} has no HELP"
        assert all(s.labels.get("model_name") == model for s in families[name].samples), name
    assert total(text, "vllm:request_success_total", finished_reason="abort") == 0


def test_the_cap_beside_decodes_is_exported(traffic) -> None:
    """At rest, with no decodes to time a step by, the engine's cap beside decodes is the
    one in tokens (config.DEFAULT_PREFILL_CHUNK_BESIDE_DECODES on CPU)."""
    text, _, model, _ = traffic
    assert total(text, "pagedserve:prefill_tokens_beside_decodes", model_name=model) == 64


def test_token_counters_equal_reported_usage(traffic) -> None:
    text, usage, _, _ = traffic
    assert total(text, "vllm:prompt_tokens_total") == usage["prompt"]
    assert total(text, "vllm:generation_tokens_total") == usage["completion"]


def test_histogram_counts_equal_requests(traffic) -> None:
    text, usage, _, _ = traffic
    for name in (
        "vllm:e2e_request_latency_seconds_count",
        "vllm:time_to_first_token_seconds_count",
        "vllm:request_generation_tokens_count",
        "vllm:request_queue_time_seconds_count",
    ):
        assert total(text, name) == usage["requests"], name
    assert total(text, "vllm:request_success_total") == usage["requests"]
    assert total(text, "pagedserve:request_errors_total", code="400") == 1


def test_prefix_cache_hits_rise_with_shared_prefixes(traffic) -> None:
    text, _, _, hits_before = traffic
    assert total(text, "vllm:prefix_cache_hits_total") >= hits_before + 64
    assert total(text, "vllm:prefix_cache_queries_total") > 0


def test_engine_cpu_series_read_the_engines_process(traffic) -> None:
    """In process, the engine's process is this one: its threads' CPU time is at most what
    the kernel counts for the whole process."""
    import os

    text, _, _, _ = traffic
    cpu = total(text, "pagedserve:engine_cpu_seconds_total")
    own = os.times()
    assert 0 < cpu <= own.user + own.system + 0.05
    assert total(text, "pagedserve:engine_cpu_wait_seconds_total") >= 0


def test_api_requests_are_counted_by_route_and_status(traffic) -> None:
    text, _, _, _ = traffic
    name = "pagedserve:api_requests_total"
    assert total(text, name, endpoint="POST /v1/completions", code="200") == 6
    assert total(text, name, endpoint="POST /v1/completions", code="400") == 1
    assert total(text, name, endpoint="POST /v1/chat/completions", code="200") == 1
    assert {dict(labels)["endpoint"] for n, labels in samples(text) if n == name} == {
        "POST /v1/completions",
        "POST /v1/chat/completions",
    }


def test_promtool_check_metrics_reports_only_vllm_name_lints(traffic) -> None:
    text, _, _, _ = traffic
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make test` installs Debian's prometheus package"
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True
    )
    problems = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if line.strip() and not any(lint in line for lint in ALLOWED_LINTS)
    ]
    assert problems == []


def test_dashboard_and_rules_name_only_scraped_metrics(traffic) -> None:
    text, _, _, _ = traffic
    scraped = {name for name, _ in samples(text)}
    referenced = referenced_metric_names()
    assert "vllm:num_requests_waiting" in referenced
    # `up` is written by Prometheus itself for every target, not by the server; the series
    # of each draft position exist only with --speculative-config (test_speculative.py),
    # and the LoRA series only with --enable-lora (test_lora.py).
    per_position = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert referenced - scraped == {"up", per_position} | WITH_LORA
