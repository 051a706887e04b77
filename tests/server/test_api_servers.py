"""`--api-server-count 2`: two frontend processes on one port over one engine core, under
the real CLI. /metrics sums what each frontend served and counts the engine's own series
once; SIGTERM drains both; any process that dies ends them all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.mmap_dict import MmapedDict

from tests.server.live import ServerProcess, free_port, metric
from tests.server.test_engine_process import alive, core_pid, maps_torch, wait_gone
from tests.server.test_lifecycle import start_streams
from tests.server.test_tensor_parallel import descendants

pytestmark = pytest.mark.slow  # four server starts, a minute in all

ARGS = ["--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "256"]
TWO = ["--api-server-count", "2", "--served-model-name", "tiny"]


def frontend_pids(server: ServerProcess) -> list[int]:
    assert server.proc is not None
    return [
        child
        for child in descendants(server.proc.pid)
        if b"server.api_servers" in Path(f"/proc/{child}/cmdline").read_bytes()
    ]


def own_values(pid: int, sample: str) -> float:
    """What one frontend process itself recorded for a sample, summed over its labels: read
    from its own files in prometheus-client's multiprocess directory."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    key = b"PROMETHEUS_MULTIPROC_DIR="
    (directory,) = [e.removeprefix(key) for e in environ if e.startswith(key)]
    total = 0.0
    for path in Path(directory.decode()).glob(f"*_{pid}.db"):
        for key, value, *_ in MmapedDict.read_all_values_from_file(str(path)):
            if json.loads(key)[1] == sample:
                total += value
    return total


def test_two_frontends_serve_one_port_and_metrics_sum_them(tiny_model_dir: Path) -> None:
    with ServerProcess([str(tiny_model_dir), *ARGS, *TWO]) as server:
        frontends = frontend_pids(server)
        assert len(frontends) == 2 and alive(core_pid(server))

        def one(i: int) -> int:
            # A client (a connection) each: the kernel spreads connections over the two.
            with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as c:
                answer = c.completions.create(
                    model="tiny",
                    prompt=f"t{10 + i} t{20 + i} t{30 + i}",
                    max_tokens=4 + i % 5,
                    extra_body={"ignore_eos": True},
                )
            assert answer.usage is not None
            return answer.usage.completion_tokens

        with ThreadPoolExecutor(8) as pool:
            served = sum(pool.map(one, range(48)))
        total = metric(server.url, "vllm:generation_tokens_total")
        per_frontend = [own_values(pid, "vllm:generation_tokens_total") for pid in frontends]
        assert total == served == sum(per_frontend)
        assert all(tokens > 0 for tokens in per_frontend), per_frontend  # both served
        successes = [own_values(pid, "vllm:request_success_total") for pid in frontends]
        assert (
            sum(successes)
            == 48
            == metric(server.url, "vllm:request_success_total", finished_reason="length")
        )
        # The engine's own counters come from frontend 0 alone: counted once.
        queries = [own_values(pid, "vllm:prefix_cache_queries_total") for pid in frontends]
        assert queries[0] > 0 and 0 in queries
        assert metric(server.url, "vllm:prefix_cache_queries_total") == max(queries)
        assert metric(server.url, "vllm:num_requests_running") == 0
        assert metric(server.url, "vllm:kv_cache_usage_perc") == 0
        assert not any(maps_torch(pid) for pid in frontends)  # tokenizers from the core


def test_sigterm_drains_every_frontend_then_ends_all(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = [str(tiny_model_dir), *ARGS, *TWO, "--shutdown-timeout", "60"]
    env = {"PAGEDSERVE_TEST_STEP_DELAY": "0.02"}
    with ServerProcess(args, env=env, log=tmp_path / "server.log") as server:
        assert server.proc is not None
        everyone = descendants(server.proc.pid)
        body = {
            "prompt": "t10 t11",
            "max_tokens": 50,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        streams, threads = start_streams(server.url, body, 4)
        server.proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=60)
        assert server.proc.wait(timeout=60) == 0
        assert wait_gone(everyone, timeout=30) == []
    for events, _ in streams:
        assert events[-1] == {"done": True} and not any("error" in e for e in events)
        assert events[-2]["usage"]["completion_tokens"] == 50


def test_any_dead_process_ends_them_all(tiny_model_dir: Path) -> None:
    for victim in ("frontend", "core"):
        with ServerProcess([str(tiny_model_dir), *ARGS, *TWO]) as server:
            assert server.proc is not None
            everyone = descendants(server.proc.pid)
            pid = frontend_pids(server)[1] if victim == "frontend" else core_pid(server)
            os.kill(pid, signal.SIGKILL)
            assert server.proc.wait(timeout=60) == 1, victim
            assert wait_gone(everyone, timeout=30) == [], victim
            with pytest.raises(httpx.ConnectError):  # nothing answers on the port any more
                httpx.get(f"{server.url}/health", timeout=2)


def test_several_frontends_need_the_core_process(tiny_model_dir: Path) -> None:
    cmd = [sys.executable, "-m", "server.cli", "serve", str(tiny_model_dir), *ARGS, *TWO]
    cmd += ["--engine-in-process", "--port", str(free_port())]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "drop --engine-in-process" in result.stderr
