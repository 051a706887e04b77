"""Process lifecycle under the real CLI: SIGTERM draining, the drain deadline, the second
signal, stall detection and engine failure handling."""

from __future__ import annotations

import gc
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from server.runner import LOAD_DELAY_ENV, STEP_DELAY_ENV
from tests.server.conftest import tiny_engine
from tests.server.live import LiveServer, ServerProcess

TINY_ARGS = ["--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "256"]


def start_streams(
    url: str, body: dict, count: int
) -> tuple[list[tuple[list[dict], threading.Event]], list[threading.Thread]]:
    """`count` streams of `body`, each on a thread, once each has its first event: their
    (events, first-event flag) pairs and threads."""
    streams: list[tuple[list[dict], threading.Event]] = [
        ([], threading.Event()) for _ in range(count)
    ]
    threads = [
        threading.Thread(target=stream_completion, args=(url, body, events, first))
        for events, first in streams
    ]
    for thread in threads:
        thread.start()
    for _, first in streams:
        assert first.wait(60), "a stream never started"
    return streams, threads


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
        "--num-kv-blocks",
        "64",
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
        streams, threads = start_streams(server.url, body, 4)
        at_signal = [len(events) for events, _ in streams]
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
        for (events, _), seen in zip(streams, at_signal, strict=True):
            assert events[-1] == {"done": True}
            finals = [e for e in events[:-1] if e["choices"][0]["finish_reason"]]
            assert [f["choices"][0]["finish_reason"] for f in finals] == ["length"]
            # The stream was still running when the signal came: tokens followed it.
            assert finals[0] not in events[:seen] and len(events) - 1 > seen
        assert server.proc.wait(timeout=60) == 0
    log = (tmp_path / "server.log").read_text()
    assert '"message": "drained: all in-flight requests finished"' in log


LONG = {"prompt": "t10 t11", "max_tokens": 200, "ignore_eos": True}


def start_stream(url: str, events: list[dict]) -> threading.Thread:
    first = threading.Event()
    thread = threading.Thread(target=stream_completion, args=(url, LONG, events, first))
    thread.start()
    assert first.wait(60), "the stream never started"
    return thread


def post_in_thread(
    url: str, results: list, timeout: float = 60, body: dict = LONG
) -> threading.Thread:
    def post() -> None:
        try:
            results.append(httpx.post(f"{url}/v1/completions", json=body, timeout=timeout))
        except httpx.TimeoutException as exc:
            results.append(exc)

    thread = threading.Thread(target=post)
    thread.start()
    return thread


def slow_server(tiny_model_dir: Path, log: Path, *args: str) -> ServerProcess:
    """The tiny model with 50 ms steps: a 200-token request runs for 10 s."""
    return ServerProcess(
        [str(tiny_model_dir), *TINY_ARGS, *args], env={STEP_DELAY_ENV: "0.05"}, log=log
    )


def test_shutdown_timeout_cuts_off_long_and_abandoned_work(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "server.log"
    with slow_server(tiny_model_dir, log, "--shutdown-timeout", "1") as server:
        assert server.proc is not None
        streams: list[list[dict]] = [[], []]
        threads = [start_stream(server.url, events) for events in streams]
        waiting: list = []
        abandoned: list = []
        threads.append(post_in_thread(server.url, waiting))
        threads.append(post_in_thread(server.url, abandoned, timeout=0.5))
        time.sleep(1.0)  # the abandoned client has given up
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0
        assert time.monotonic() - signalled < 1 + 1, "exit took longer than the timeout + 1 s"
        for thread in threads:
            thread.join(timeout=10)
    for events in streams:
        assert events[-1] == {"done": True}
        error = events[-2]["error"]
        assert (error["type"], error["code"]) == ("service_unavailable_error", "shutting_down")
        assert not any(e.get("choices", [{}])[0].get("finish_reason") for e in events[:-2])
    (response,) = waiting
    assert response.status_code == 503 and response.json()["error"]["code"] == "shutting_down"
    assert isinstance(abandoned[0], httpx.TimeoutException)
    text = log.read_text()
    assert "cutting off 3 requests" in text
    assert "Traceback" not in text and "CancelledError" not in text


def test_a_second_signal_exits_at_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with slow_server(tiny_model_dir, log, "--shutdown-timeout", "60") as server:
        assert server.proc is not None
        events: list[dict] = []
        thread = start_stream(server.url, events)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert server.proc.poll() is None, "the first signal must drain, not exit"
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0
        assert time.monotonic() - signalled < 2
        thread.join(timeout=10)
    assert events[-1] == {"done": True} and events[-2]["error"]["code"] == "shutting_down"
    assert "Traceback" not in log.read_text()


def test_stall_timeout_fails_readiness_while_a_step_hangs(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    args = [str(tiny_model_dir), *TINY_ARGS, "--stall-timeout", "0.5"]
    env = {STEP_DELAY_ENV: "1.5"}  # each step takes three stall timeouts
    with ServerProcess(args, env=env, log=tmp_path / "server.log") as server:
        assert httpx.get(f"{server.url}/ready").status_code == 200  # idle is not stalled
        results: list = []
        thread = post_in_thread(server.url, results, body={"prompt": "t10", "max_tokens": 2})
        deadline = time.monotonic() + 10
        while (ready := httpx.get(f"{server.url}/ready")).status_code == 200:
            assert time.monotonic() < deadline, "/ready never noticed the stall"
            time.sleep(0.1)
        assert ready.status_code == 503 and "stalled" in ready.json()["reason"]
        assert httpx.get(f"{server.url}/health").status_code == 200  # stalled is not dead
        thread.join(timeout=60)
        assert results[0].status_code == 200
        assert httpx.get(f"{server.url}/ready").status_code == 200


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "core-process"])
def test_engine_failure_fails_requests_and_probes(
    tiny_model_dir: Path, tmp_path: Path, in_process: bool
) -> None:
    """A step that raises ends the streams with an error event. In-process, the server then
    fails its probes and answers 500; with the core in its own process, the core exits
    after reporting the failure, and so does the server (exit 1), as for any dead core."""
    env = {"PAGEDSERVE_TEST_FAIL_AFTER_STEPS": "3"}
    args = [str(tiny_model_dir), *TINY_ARGS] + (["--engine-in-process"] if in_process else [])
    log = tmp_path / "server.log"
    with ServerProcess(args, env=env, log=log) as server:
        assert server.proc is not None
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
        assert "injected engine step failure" in errors[0]["error"]["message"]
        assert events[-1] == {"done": True}
        if not in_process:
            assert server.proc.wait(timeout=30) == 1
            assert "the engine core process exited with code 1" in log.read_text()
            return
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


def test_partial_prefill_limits_are_checked_before_the_model_loads(tmp_path: Path) -> None:
    """A flag, or its environment variable, that chunked prefill cannot honour exits 2
    naming the flag, before the (here missing) model is looked for."""
    import subprocess
    import sys

    serve = [sys.executable, "-m", "server.cli", "serve", str(tmp_path / "missing")]
    flag = subprocess.run(
        [*serve, "--max-long-partial-prefills", "3"], capture_output=True, text=True, timeout=120
    )
    assert flag.returncode == 2
    assert (
        "error: --max-long-partial-prefills must be between 1 and --max-num-partial-prefills "
        "(1), got 3" in flag.stderr
    )
    env = {**os.environ, "PAGEDSERVE_LONG_PREFILL_TOKEN_THRESHOLD": "-1"}
    from_env = subprocess.run(serve, capture_output=True, text=True, timeout=120, env=env)
    assert from_env.returncode == 2
    assert "--long-prefill-token-threshold must be 0 (off) or positive" in from_env.stderr


def test_a_signal_while_the_model_loads_exits_at_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A pod stopped while it loads (a rollout, a scale-down) exits on SIGTERM without
    waiting for the load to finish: the loading thread must not hold the process."""
    log = tmp_path / "server.log"
    args = [str(tiny_model_dir), *TINY_ARGS]
    with ServerProcess(args, env={LOAD_DELAY_ENV: "120"}, log=log, probe="/health") as server:
        assert server.proc is not None
        assert httpx.get(f"{server.url}/ready", timeout=2).status_code == 503  # loading
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
        assert time.monotonic() - signalled < 5
    text = log.read_text()
    assert "shutdown signal while not serving: exiting now" in text
    assert "Traceback" not in text


def test_what_the_load_leaves_is_frozen_for_the_garbage_collector(tiny_model_dir: Path) -> None:
    """A full collection walked every object the load left (250 ms on the default model,
    with no token streamed meanwhile); the server freezes them once it is ready, and thaws
    them when it stops."""
    gc.unfreeze()
    with LiveServer(tiny_engine(tiny_model_dir)):
        frozen = gc.get_freeze_count()
        assert frozen > 10_000, frozen  # the model, the tokenizer, the imports
    assert gc.get_freeze_count() == 0
