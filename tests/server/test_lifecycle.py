"""Process lifecycle under the real CLI: SIGTERM draining and engine failure handling."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.live import ServerProcess

TINY_ARGS = ["--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "256"]


def stream_completion(url: str, body: dict, events: list[dict], first: threading.Event) -> None:
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=120
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            events.append({"done": True} if payload == "[DONE]" else json.loads(payload))
            first.set()


@pytest.mark.slow
def test_sigterm_drains_in_flight_streams(default_model_dir: Path, tmp_path: Path) -> None:
    args = [
        str(default_model_dir),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--shutdown-timeout",
        "60",
        "--log-format",
        "json",
    ]
    with ServerProcess(args, log=tmp_path / "server.log") as server:
        assert server.proc is not None
        body = {
            "prompt": "Write a long story about a lighthouse keeper.",
            "max_tokens": 48,
            "ignore_eos": True,
            "temperature": 0,
        }
        streams = [([], threading.Event()) for _ in range(4)]
        threads = [
            threading.Thread(target=stream_completion, args=(server.url, body, events, first))
            for events, first in streams
        ]
        for t in threads:
            t.start()
        for _, first in streams:
            assert first.wait(60), "a stream never started"
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while httpx.get(f"{server.url}/ready").status_code != 503:
            assert time.monotonic() < deadline, "/ready never turned 503"
            time.sleep(0.05)
        rejected = httpx.post(
            f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}
        )
        assert rejected.status_code == 503
        assert "shutting down" in rejected.json()["error"]["message"]
        for t in threads:
            t.join(timeout=120)
        for events, _ in streams:
            assert events[-1] == {"done": True}
            finals = [e for e in events[:-1] if e["choices"][0]["finish_reason"]]
            assert [f["choices"][0]["finish_reason"] for f in finals] == ["length"]
        assert server.proc.wait(timeout=60) == 0
    log = (tmp_path / "server.log").read_text()
    assert '"message": "drained: all in-flight requests finished"' in log


def test_engine_failure_fails_requests_and_probes(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {"PAGEDSERVE_TEST_FAIL_AFTER_STEPS": "3"}
    with ServerProcess(
        [str(tiny_model_dir), *TINY_ARGS], env=env, log=tmp_path / "server.log"
    ) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        events: list[dict] = []
        started = time.monotonic()
        stream_completion(
            server.url,
            {"prompt": "t10 t11", "max_tokens": 100, "ignore_eos": True},
            events,
            threading.Event(),
        )
        assert time.monotonic() - started < 2.0
        errors = [e for e in events if "error" in e]
        assert errors and errors[0]["error"]["type"] == "server_error"
        assert events[-1] == {"done": True}
        for path in ("/health", "/ready"):
            response = httpx.get(f"{server.url}{path}")
            assert response.status_code == 503 and "engine" in response.json()["reason"]
        after = httpx.post(f"{server.url}/v1/completions", json={"prompt": "t10", "max_tokens": 2})
        assert after.status_code == 500 and after.json()["error"]["message"]


def test_flags_come_from_environment(tiny_model_dir: Path) -> None:
    env = {
        "PAGEDSERVE_SERVED_MODEL_NAME": "from-env",
        "PAGEDSERVE_API_KEY": "k",
        "PAGEDSERVE_ENABLE_PREFIX_CACHING": "false",
    }
    with ServerProcess([str(tiny_model_dir), *TINY_ARGS], env=env) as server:
        models = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer k"}).json()
        assert models["data"][0]["id"] == "from-env"
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'enable_prefix_caching="false"' in metrics


def test_a_model_that_fails_to_load_ends_the_process(tmp_path: Path) -> None:
    """Exit 1 rather than a live process that can never become ready."""
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "server.cli",
        "serve",
        str(tmp_path / "missing"),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "not a local Hugging Face model directory" in result.stderr
