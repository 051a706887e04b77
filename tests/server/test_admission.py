"""Admission control: a bounded queue, 503 + Retry-After past it, 400 for requests that could
never fit, and rejections that cost no tokenization."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine import EngineHooks
from server.admission import QueueLimits
from tests.server.conftest import tiny_engine
from tests.server.live import LiveServer

BLOCKER = {"prompt": "t10 t11", "max_tokens": 150, "ignore_eos": True}
SHORT = {"prompt": "t20 t21 t22", "max_tokens": 3, "ignore_eos": True, "temperature": 0}


class CountingTokenizer:
    """The engine's tokenizer, counting the calls that tokenize or render a chat."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner.encode(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def admission_server(tiny_model_dir: Path, in_process: bool) -> LiveServer:
    """Two running slots and room for 8 queued choices and 64 queued tokens; slow steps
    keep the blockers running (and the queue still) for seconds."""
    engine = tiny_engine(
        tiny_model_dir,
        EngineHooks(step_delay=0.03),
        max_num_seqs=2,
        engine_in_process=in_process,
    )
    return LiveServer(engine, max_num_queued_reqs=8, max_num_queued_tokens=64)


@pytest.fixture
def server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    with admission_server(tiny_model_dir, in_process=True) as live:
        live.engine.tokenizer = CountingTokenizer(live.engine.tokenizer)
        yield live


def num_running(server: LiveServer) -> int:
    if server.engine.core is None:  # the core runs in a process of its own
        return server.core_state().gauges.num_running
    return len(server.engine.core.scheduler.running)


def start_blockers(server: LiveServer, count: int) -> list[threading.Thread]:
    threads = [
        threading.Thread(
            target=httpx.post,
            args=(f"{server.url}/v1/completions",),
            kwargs={"json": BLOCKER, "timeout": 60},
        )
        for _ in range(count)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    # Running in the scheduler, and no longer queued as the frontend counts them (its
    # count catches up with the step that started them once that step's result is in).
    while num_running(server) < count or server.engine.num_queued_requests:
        assert time.monotonic() < deadline, "the blockers never started"
        time.sleep(0.01)
    return threads


async def burst(url: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(client.post(f"{url}/v1/completions", json=b) for b in bodies))


def test_a_burst_past_the_queue_gets_503_and_the_admitted_are_served(server: LiveServer) -> None:
    check_burst(server)


def test_admission_counts_the_queue_of_a_core_in_its_own_process(tiny_model_dir: Path) -> None:
    """The queue as the core's step results report it, plus what is on its way there."""
    with admission_server(tiny_model_dir, in_process=False) as server:
        check_burst(server)
        assert server.wait_idle(timeout=30)  # nothing left running or holding blocks


def check_burst(server: LiveServer) -> None:
    blockers = start_blockers(server, 2)
    responses = asyncio.run(burst(server.url, [SHORT] * 40))
    served = [r for r in responses if r.status_code == 200]
    rejected = [r for r in responses if r.status_code == 503]
    assert len(served) == 8 and len(rejected) == 32
    for response in served:
        assert response.json()["usage"]["completion_tokens"] == 3
    for response in rejected:
        assert response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert error["code"] == "queue_full" and error["type"] == "service_unavailable_error"
    assert server.metric("pagedserve:requests_rejected_total", reason="max_num_queued_reqs") == 32
    for thread in blockers:
        thread.join()
    after = httpx.post(f"{server.url}/v1/completions", json=SHORT, timeout=60)
    assert after.status_code == 200


def test_each_choice_counts_and_rejections_skip_tokenization(server: LiveServer) -> None:
    blockers = start_blockers(server, 2)
    url = f"{server.url}/v1/completions"
    tokenizer = server.engine.tokenizer
    queue_full = [
        ("/v1/completions", {"prompt": "t30", "n": 3}),
        ("/v1/completions", {"prompt": ["t30", "t31", "t32"]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t30"}], "n": 3}),
    ]
    # Six choices are queued behind the blockers: two more fit, three do not.
    pending = threading.Thread(
        target=httpx.post, args=(url,), kwargs={"json": SHORT | {"n": 6}, "timeout": 60}
    )
    pending.start()
    while server.engine.num_queued_requests < 6:
        time.sleep(0.01)
    calls = tokenizer.calls
    for path, body in queue_full:
        response = httpx.post(f"{server.url}{path}", json=body | {"max_tokens": 2})
        assert response.status_code == 503, response.text
    assert tokenizer.calls == calls, "a rejected request was tokenized"
    assert httpx.post(url, json=SHORT | {"n": 2}, timeout=60).status_code == 200
    for thread in [*blockers, pending]:
        thread.join()


NEVER_ADMISSIBLE = {
    "n": ({"prompt": "t30", "n": 9}, "n"),
    "prompt-list": ({"prompt": ["t30"] * 5, "n": 2}, "n"),
    "tokens": ({"prompt": " ".join(["t30"] * 33), "n": 2}, "prompt"),
}


@pytest.mark.parametrize(("body", "param"), NEVER_ADMISSIBLE.values(), ids=NEVER_ADMISSIBLE.keys())
def test_a_request_that_could_never_fit_gets_400(
    server: LiveServer, body: dict[str, Any], param: str
) -> None:
    response = httpx.post(f"{server.url}/v1/completions", json=body | {"max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "--max-num-queued" in error["message"]


def test_queued_tokens_limit(server: LiveServer) -> None:
    blockers = start_blockers(server, 2)
    url = f"{server.url}/v1/completions"
    big = {"prompt": " ".join(["t40"] * 40), "max_tokens": 2}
    pending = threading.Thread(target=httpx.post, args=(url,), kwargs={"json": big, "timeout": 60})
    pending.start()
    while server.engine.num_queued_tokens < 40:
        time.sleep(0.01)
    response = httpx.post(url, json=big | {"prompt": " ".join(["t41"] * 30)})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert server.metric("pagedserve:requests_rejected_total", reason="max_num_queued_tokens") == 1
    assert httpx.post(url, json=big | {"prompt": "t42 t43"}, timeout=60).status_code == 200
    for thread in [*blockers, pending]:
        thread.join()


@pytest.mark.parametrize(
    ("budget", "max_model_len", "expected_tokens"),
    [(512, 4096, 64 * 512), (128, 4096, 8 * 4096), (8192, 2048, 64 * 8192)],
)
def test_default_token_limit_outlasts_a_small_step_budget(
    budget: int, max_model_len: int, expected_tokens: int
) -> None:
    """The queue's token default is 64 full prefill steps, but never fewer tokens than 8
    longest prompts: a budget lowered for latency must not turn a burst into 503s."""
    limits = QueueLimits.resolve(None, None, 64, budget, max_model_len)
    assert limits == QueueLimits(8 * 64, expected_tokens)
    assert QueueLimits.resolve(3, 7, 64, budget, max_model_len) == QueueLimits(3, 7)
