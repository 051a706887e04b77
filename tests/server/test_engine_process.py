"""`pagedserve serve` with its engine core in a process of its own (the default), under the
real CLI: it serves the OpenAI SDK, keeps its metrics, sleeps while idle, drains on SIGTERM
through both processes, and leaves no process behind whichever side dies first."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest.mock import patch

import httpx
import openai
import pytest

from engine import EngineArgs
from engine.core_client import start_core
from server.runner import STEP_DELAY_ENV
from tests.server.live import LiveServer, ServerProcess, metric
from tests.server.test_lifecycle import stream_completion
from tests.server.test_tensor_parallel import descendants

TINY_ARGS = ["--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "256"]


def core_pid(server: ServerProcess) -> int:
    assert server.proc is not None
    (pid,) = [
        child
        for child in descendants(server.proc.pid)
        if b"engine.core_proc" in Path(f"/proc/{child}/cmdline").read_bytes()
    ]
    return pid


def alive(pid: int) -> bool:
    """Running, and not a zombie its parent has yet to reap."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def maps_torch(pid: int) -> bool:
    """Whether process `pid` has loaded torch's library."""
    return "/libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_serves_the_sdk_as_the_in_process_engine_does(
    tiny_model_dir: Path, tiny_server: LiveServer
) -> None:
    """Same greedy text as the in-process server on the same model; counters that add up;
    a frontend that never loads torch (its tokenizer came from the core)."""
    with ServerProcess([str(tiny_model_dir), *TINY_ARGS, "--served-model-name", "tiny"]) as server:
        assert alive(core_pid(server))
        served = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        local = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="x", max_retries=0)
        prompts = [f"t{10 + i} t{20 + i} t{30 + i}" for i in range(6)]
        kwargs = dict(
            model="tiny", max_tokens=12, temperature=0, n=2, extra_body={"ignore_eos": True}
        )
        got = [served.completions.create(prompt=p, **kwargs) for p in prompts]  # type: ignore[call-overload]
        want = [local.completions.create(prompt=p, **kwargs) for p in prompts]  # type: ignore[call-overload]
        assert [[c.text for c in r.choices] for r in got] == [
            [c.text for c in r.choices] for r in want
        ]
        stream = served.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "t40 t41"}],
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
        generated = sum(r.usage.completion_tokens for r in got if r.usage) + 10
        assert metric(server.url, "vllm:generation_tokens_total") == generated
        finished = metric(server.url, "vllm:request_success_total", finished_reason="length")
        assert finished == 6 * 2 + 1
        assert metric(server.url, "vllm:num_requests_running") == 0
        assert metric(server.url, "vllm:kv_cache_usage_perc") == 0
        # The CPU series read the core's threads (the kernel's count for the whole core
        # process also holds threads that ended before the first scrape).
        core_cpu = cpu_seconds(core_pid(server))
        engine_cpu = metric(server.url, "pagedserve:engine_cpu_seconds_total")
        assert 0.8 * core_cpu - 0.1 <= engine_cpu <= core_cpu + 0.05, (engine_cpu, core_cpu)
        assert server.proc is not None and maps_torch(core_pid(server))
        assert not maps_torch(server.proc.pid)


def test_an_idle_core_sleeps(tiny_model_dir: Path) -> None:
    """No spinning while idle: on a small CPU machine a busy-polling core would take a whole
    core from the frontend (and from the pod's neighbours)."""
    with ServerProcess([str(tiny_model_dir), *TINY_ARGS]) as server:
        body = {"prompt": "t10 t11", "max_tokens": 8, "ignore_eos": True}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        pid = core_pid(server)
        time.sleep(0.5)
        before = cpu_seconds(pid)
        time.sleep(3)
        assert cpu_seconds(pid) - before < 0.3  # 10%, far above a sleeping process's share
        # Nor at a step's barriers: its OpenMP threads wait passively unless told otherwise.
        assert b"OMP_WAIT_POLICY=PASSIVE" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


@pytest.mark.parametrize(
    ("variable", "value"), [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "1000")]
)
def test_the_openmp_wait_policy_is_the_users_when_set(variable: str, value: str) -> None:
    """A wait policy or a spin count of the user's reaches the core as it is, with no
    PASSIVE beside it (libgomp ignores the spin count under PASSIVE)."""
    environment = {
        k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    }
    with patch.dict(os.environ, {**environment, variable: value}, clear=True):
        start = start_core(EngineArgs(model="/nonexistent"), None, None)
        try:
            environ = Path(f"/proc/{start.proc.pid}/environ").read_bytes().split(b"\0")
            assert f"{variable}={value}".encode() in environ
            assert b"OMP_WAIT_POLICY=PASSIVE" not in environ
        finally:
            start.proc.kill()
            start.proc.wait()
            for channel in start.channels:
                os.close(channel.ready_fd)
            shutil.rmtree(start.directory, ignore_errors=True)


def test_a_dead_core_ends_the_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with ServerProcess([str(tiny_model_dir), *TINY_ARGS], log=log) as server:
        assert server.proc is not None
        pid = core_pid(server)
        os.kill(pid, signal.SIGKILL)
        probes = []
        while server.proc.poll() is None and len(probes) < 600:
            try:
                probes.append(httpx.get(f"{server.url}/health", timeout=2).status_code)
            except httpx.HTTPError:
                probes.append(0)
            time.sleep(0.05)
        assert server.proc.wait(timeout=30) == 1
        assert 200 not in probes[1:]
    assert "the engine core process exited with code -9" in log.read_text()


def test_a_dead_frontend_ends_the_core_and_its_workers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # The core's socket directory goes under TMPDIR: the core removes it as it exits.
    env = {"PAGEDSERVE_TENSOR_PARALLEL_SIZE": "2", "TMPDIR": str(tmp_path)}
    with ServerProcess([str(tiny_model_dir), *TINY_ARGS], env=env) as server:
        assert server.proc is not None
        body = {"prompt": "t10 t11", "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        under = descendants(server.proc.pid)
        assert len(under) >= 2  # the core, its tensor-parallel worker (and spawn's tracker)
        assert len(list(tmp_path.glob("pagedserve-core-*"))) == 1
        server.proc.kill()
        server.proc.wait(timeout=30)
        assert wait_gone(under, timeout=30) == []
    assert list(tmp_path.glob("pagedserve-core-*")) == []


def test_a_frontend_gone_before_the_core_started_leaves_no_core(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A frontend that exits at once (a SIGTERM while the model loads, as a rollout sends)
    may be gone while its core is still importing torch: the core, reparented before its
    first look at its parent, must still see that it has gone, and exit, removing the
    directory of its sockets, which the frontend had no time to remove."""
    script = (
        "import sys\n"
        "from engine import EngineArgs\n"
        "from engine.core_client import start_core\n"
        f"args = EngineArgs(model={str(tiny_model_dir)!r}, dtype='float32', num_kv_blocks=256)\n"
        "start = start_core(args, None, None)\n"
        "print(start.proc.pid, start.directory, flush=True)\n"
    )
    frontend = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    pid, directory = frontend.stdout.split()
    try:
        assert wait_gone([int(pid)], timeout=60) == []
        assert not Path(directory).exists()
    finally:
        if alive(int(pid)):
            os.kill(int(pid), signal.SIGKILL)
        shutil.rmtree(directory, ignore_errors=True)


def test_sigterm_to_both_drains_then_ends_both(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A signal to the whole process group (a terminal's Ctrl-C, a runtime that signals
    every process) reaches the core too: it keeps stepping until the frontend has drained."""
    args = [str(tiny_model_dir), *TINY_ARGS, "--shutdown-timeout", "60"]
    with ServerProcess(args, env={STEP_DELAY_ENV: "0.02"}, log=tmp_path / "server.log") as server:
        assert server.proc is not None
        pid = core_pid(server)
        events: list[dict] = []
        first = threading.Event()
        body = {
            "prompt": "t10 t11",
            "max_tokens": 60,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        streaming = threading.Thread(
            target=stream_completion, args=(server.url, body, events, first)
        )
        streaming.start()
        assert first.wait(timeout=60)
        for target in (pid, server.proc.pid):
            os.kill(target, signal.SIGTERM)
        streaming.join(timeout=60)
        assert server.proc.wait(timeout=60) == 0
        assert wait_gone([pid], timeout=30) == []
    assert events[-1] == {"done": True} and not any("error" in e for e in events)
    assert events[-2]["usage"]["completion_tokens"] == 60


@pytest.mark.parametrize("flag", ["--engine-in-process"])
def test_the_in_process_engine_is_still_a_flag(tiny_model_dir: Path, flag: str) -> None:
    with ServerProcess([str(tiny_model_dir), *TINY_ARGS, flag]) as server:
        assert server.proc is not None
        body = {"prompt": "t10 t11", "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        assert not any(
            b"engine.core_proc" in Path(f"/proc/{child}/cmdline").read_bytes()
            for child in descendants(server.proc.pid)
        )
