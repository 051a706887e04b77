"""Abandoned work: a non-streamed request whose client gives up is aborted at every stage
(queued, prefilling, decoding) and for every choice of n > 1; its blocks and the server's
own request objects are gone within a step, and the gauges say so."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from engine import EngineHooks
from engine.request import Request
from tests.server.conftest import tiny_engine
from tests.server.live import LiveServer

GIVE_UP_S = 1.0
LONG = {"prompt": "t10 t11 t12", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
LONG_PROMPT = {"prompt": " ".join(f"t{20 + i % 200}" for i in range(200)), "max_tokens": 4}


def give_up(url: str, body: dict, outcome: list[str]) -> None:
    """POSTs `body` and hangs up after GIVE_UP_S without an answer."""
    try:
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=GIVE_UP_S)
        outcome.append(f"answered {response.status_code} before the client gave up")
    except httpx.TimeoutException:
        outcome.append("gave up")


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    """Polls `condition` until it holds or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def decoding(n: int) -> Callable[[list[Request], list[Request]], bool]:
    return lambda running, waiting: (
        len(running) == n and not waiting and all(r.num_output_tokens > 0 for r in running)
    )


def prefilling(running: list[Request], waiting: list[Request]) -> bool:
    return (
        len(running) == 1
        and running[0].num_output_tokens == 0
        and 0 < running[0].num_computed_tokens < running[0].num_prompt_tokens
    )


def queued(n: int) -> Callable[[list[Request], list[Request]], bool]:
    # The blocker decodes in the only slot; the request's n choices wait behind it.
    return lambda running, waiting: len(running) == 1 and len(waiting) == n


CASES = {
    "decoding-n1": (dict(), None, LONG, decoding(1), 1),
    "decoding-n4": (dict(), None, LONG | {"n": 4}, decoding(4), 4),
    "prefilling": (dict(max_num_batched_tokens=8), None, LONG_PROMPT, prefilling, 1),
    "queued-n1": (dict(max_num_seqs=1), LONG, LONG | {"max_tokens": 3}, queued(1), 2),
    "queued-n4": (dict(max_num_seqs=1), LONG, LONG | {"n": 4}, queued(4), 5),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_non_streamed_request_is_aborted_when_its_client_gives_up(
    tiny_model_dir: Path, case: tuple
) -> None:
    engine_args, blocker, body, in_stage, num_aborted = case
    # Slow steps keep each stage going for seconds.
    engine = tiny_engine(tiny_model_dir, EngineHooks(step_delay=0.1), **engine_args)
    with LiveServer(engine) as server:
        outcomes: list[str] = []
        clients = [
            threading.Thread(target=give_up, args=(server.url, b, outcomes))
            for b in ([blocker] if blocker else []) + [body]
        ]
        scheduler = server.engine.core.scheduler
        for client in clients:
            client.start()
            # The blocker first takes the slot; then the request reaches its stage.
            assert wait_until(lambda: len(scheduler.running) > 0, GIVE_UP_S / 2)
        assert wait_until(
            lambda: in_stage(list(scheduler.running), list(scheduler.waiting)), GIVE_UP_S / 2
        ), "not in the stage"
        for client in clients:
            client.join()
        assert outcomes == ["gave up"] * len(clients)
        given_up = time.monotonic()
        assert server.wait_idle(2.0), "the abandoned request still holds the engine"
        assert time.monotonic() - given_up < 2.0
        scheduler.kv_cache.check_invariants()
        assert server.metric("vllm:num_requests_running") == 0
        assert server.metric("vllm:num_requests_waiting") == 0
        assert server.metric("vllm:kv_cache_usage_perc") == 0
        aborted = server.metric("vllm:request_success_total", finished_reason="abort")
        assert aborted == num_aborted
        assert server.metric("pagedserve:request_errors_total", code="499") == len(clients)
        # ...and the server serves the next request.
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "t10", "max_tokens": 2})
        assert ok.status_code == 200


def test_a_client_that_gives_up_frees_a_core_in_its_own_process(tiny_model_dir: Path) -> None:
    """The abort crosses to the core process: its choices end, their blocks are free."""
    engine = tiny_engine(tiny_model_dir, EngineHooks(step_delay=0.1), engine_in_process=False)
    with LiveServer(engine) as server:
        outcomes: list[str] = []
        client = threading.Thread(target=give_up, args=(server.url, LONG | {"n": 4}, outcomes))
        client.start()
        assert wait_until(lambda: server.core_state().gauges.num_running == 4, GIVE_UP_S / 2)
        client.join()
        assert outcomes == ["gave up"]
        assert server.wait_idle(2.0), "the abandoned request still holds the engine"
        assert server.metric("vllm:num_requests_running") == 0
        assert server.metric("vllm:kv_cache_usage_perc") == 0
        assert server.metric("vllm:request_success_total", finished_reason="abort") == 4
