"""/dashboard and /dashboard/events on a live server: the page, the feed against /metrics,
the API key (Bearer or Basic), --disable-dashboard, and a viewer leaving."""

from __future__ import annotations

import base64
import json
import re
import time
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomllib

from engine.introspection import EngineMonitor
from server.cli import build_parser, configs_from_args
from tests.server.conftest import tiny_engine
from tests.server.live import LiveServer, ServerProcess
from tests.server.test_metrics import samples, total

PREFIX = " ".join(f"t{10 + i}" for i in range(40))
ROOT = Path(__file__).resolve().parents[2]


def first_events(url: str, count: int, **kwargs: Any) -> list[tuple[str, dict[str, Any]]]:
    """The first `count` events of the feed, then the viewer leaves."""
    events: list[tuple[str, dict[str, Any]]] = []
    kind = ""
    with httpx.stream("GET", f"{url}/dashboard/events", timeout=30, **kwargs) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((kind, json.loads(line.removeprefix("data: "))))
                if len(events) == count:
                    break
    return events


def run_workload(url: str) -> None:
    for i in range(4):
        body = {"prompt": f"{PREFIX} t{100 + i}", "max_tokens": 8, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    with LiveServer(tiny_engine(tiny_model_dir), served_model_name="tiny") as live:
        yield live


def test_the_page_is_self_contained(server: LiveServer) -> None:
    response = httpx.get(f"{server.url}/dashboard")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    csp = response.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    page = response.text
    assert "<script>" in page and "EventSource" in page
    # Nothing is fetched from elsewhere: no src/href attributes, no absolute URLs.
    assert not re.search(r"\s(src|href)\s*=", page)
    assert not re.search(r"https?://", page)


def test_the_page_ships_in_the_wheel() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["server"]
    static = [p.relative_to(ROOT / "server").as_posix() for p in (ROOT / "server/static").iterdir()]
    assert "static/dashboard.html" in static
    assert all(any(fnmatch(path, pattern) for pattern in patterns) for path in static)


def test_the_snapshot_agrees_with_metrics_at_idle(server: LiveServer) -> None:
    run_workload(server.url)
    [(kind, snap)] = first_events(server.url, 1)
    metrics = httpx.get(f"{server.url}/metrics").text
    assert kind == "snapshot" and snap["model"] == "tiny"
    gauges, totals = snap["gauges"], snap["totals"]
    assert gauges["kv_cache_usage"] == total(metrics, "vllm:kv_cache_usage_perc") == 0
    assert gauges["num_running"] == total(metrics, "vllm:num_requests_running") == 0
    assert gauges["num_waiting"] == total(metrics, "vllm:num_requests_waiting") == 0
    hits = total(metrics, "vllm:prefix_cache_hits_total")
    assert totals["prefix_cache_hits"] == hits > 0
    assert totals["prefix_cache_queries"] == total(metrics, "vllm:prefix_cache_queries_total")
    assert totals["num_preemptions"] == total(metrics, "vllm:num_preemptions_total")
    [info] = [dict(labels) for name, labels in samples(metrics) if name == "vllm:cache_config_info"]
    assert (snap["block_size"], snap["num_blocks"]) == (
        int(info["block_size"]),
        int(info["num_gpu_blocks"]),
    )
    # Idle after traffic: the prompts' full blocks stay cached, free; nothing is held.
    counts = snap["counts"]
    assert counts["in_use"] == counts["shared"] == 0 and counts["cached"] >= 3
    assert sum(counts.values()) == snap["num_blocks"] == len(snap["states"])
    assert snap["requests"] == []
    assert len(snap["finished"]) == 0, "a new viewer's history starts when it connects"


def test_deltas_follow_the_snapshot_and_carry_no_text(server: LiveServer) -> None:
    events = first_events(server.url, 3)
    assert [kind for kind, _ in events] == ["snapshot", "delta", "delta"]
    assert [data["seq"] for _, data in events] == [
        events[0][1]["seq"],
        events[0][1]["seq"] + 1,
        events[0][1]["seq"] + 2,
    ]
    assert events[1][1]["rates"]["steps_per_s"] == 0  # idle
    text = json.dumps(events)
    assert PREFIX.split()[5] not in text and "t100" not in text


def test_a_viewer_that_leaves_stops_the_views(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    first_events(server.url, 1)
    captures: list[float] = []
    monkeypatch.setattr(EngineMonitor, "capture", lambda self: captures.append(time.monotonic()))
    # The server notices the closed connection within moments; idle views stop with it.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and captures and captures[-1] > time.monotonic() - 1.5:
        time.sleep(0.1)
    captures.clear()
    run_workload(server.url)
    assert captures == []


def basic(key: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"admin:{key}".encode()).decode()}


def test_the_api_key_guards_the_dashboard(tiny_model_dir: Path) -> None:
    with LiveServer(tiny_engine(tiny_model_dir), api_key=["s3cret"]) as live:
        for path in ("/dashboard", "/dashboard/events"):
            refused = httpx.get(f"{live.url}{path}")
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "invalid_api_key"
            assert refused.headers["www-authenticate"].startswith("Basic ")
            assert httpx.get(f"{live.url}{path}", headers=basic("wrong")).status_code == 401
        bearer = {"Authorization": "Bearer s3cret"}
        assert httpx.get(f"{live.url}/dashboard", headers=bearer).status_code == 200
        assert httpx.get(f"{live.url}/dashboard", headers=basic("s3cret")).status_code == 200
        [(kind, _)] = first_events(live.url, 1, headers=basic("s3cret"))
        assert kind == "snapshot"
        # Basic authentication is for the browser's dashboard only, not the API.
        assert httpx.get(f"{live.url}/v1/models", headers=basic("s3cret")).status_code == 401
        refused = httpx.get(f"{live.url}/v1/models")
        assert "www-authenticate" not in refused.headers


def test_disable_dashboard_removes_both_routes(tiny_model_dir: Path) -> None:
    with LiveServer(tiny_engine(tiny_model_dir), disable_dashboard=True) as live:
        for path in ("/dashboard", "/dashboard/events"):
            response = httpx.get(f"{live.url}{path}")
            assert response.status_code == 404
            assert response.json()["error"]["type"] == "not_found_error"


def test_disable_dashboard_is_a_flag() -> None:
    for argv, disabled in ((["serve"], False), (["serve", "--disable-dashboard"], True)):
        settings, _ = configs_from_args(build_parser().parse_args(argv))
        assert settings.disable_dashboard is disabled


def test_disable_dashboard_comes_from_the_environment(tiny_model_dir: Path) -> None:
    args = [str(tiny_model_dir), "--dtype", "float32", "--num-kv-blocks", "64"]
    env = {"PAGEDSERVE_DISABLE_DASHBOARD": "true"}
    with ServerProcess(args, env=env) as process:
        assert httpx.get(f"{process.url}/dashboard").status_code == 404
        assert httpx.get(f"{process.url}/v1/models").status_code == 200
