"""The endpoint picker's view of a pod: /metrics scraped under load, each value the EPP
reads (llm-d router's docs/plugin-metric-protocol.md, its `vllm` engine-type mapping)
checked for its type and range, and the queue and running gauges against the engine's own
counts."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine import EngineHooks
from tests.server.conftest import tiny_engine
from tests.server.live import LiveServer

MAX_NUM_SEQS = 3
# What the EPP maps for engine type "vllm", with the type the protocol requires.
EPP_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


@dataclass(frozen=True)
class Scrape:
    waiting: float
    running: float
    kv_usage: float
    # The engine's own counts, read around the scrape; None when a step may have moved them.
    engine: tuple[int, int, float] | None


class ScheduleCount:
    """Counts the scheduler's schedule() calls: a step's first act after the test hook's
    delay, and where it changes the running and waiting counts."""

    def __init__(self, core: Any) -> None:
        self.count = core.num_steps  # idle: every step so far has scheduled once
        schedule = core.scheduler.schedule

        def counted() -> Any:
            self.count += 1
            return schedule()

        core.scheduler.schedule = counted


def scrape(server: LiveServer, client: httpx.Client, scheduled: ScheduleCount) -> Scrape:
    """One /metrics scrape. `client` keeps its connection: a fresh httpx.get builds an SSL
    context first (50-80 ms here), longer than a step, so few scrapes would fall between
    two steps."""
    core, engine = server.engine.core, server.engine
    before = (
        len(core.scheduler.running),
        len(core.scheduler.waiting),
        core.scheduler.kv_cache.usage(),
    )
    steps, stepping, schedules = core.num_steps, engine._stepping, scheduled.count
    handled = engine._handled  # step results the event loop has published (one a step)
    text = client.get(f"{server.url}/metrics").text
    after = (
        len(core.scheduler.running),
        len(core.scheduler.waiting),
        core.scheduler.kv_cache.usage(),
    )
    # The gauges are published after each step, when the event loop takes its result (the
    # scrape, on the same loop, sees all of a publish or none). While the next step is in
    # flight but has not scheduled yet (it sleeps the hook's delay first), the scheduler
    # holds what the last step's were published from; its schedule() changes that before
    # the step ends. The loop may take a result after the scrape asked, so the last step's
    # must have been taken before it.
    steady = (
        stepping
        and engine._stepping
        and core.num_steps == steps
        and handled == steps
        and scheduled.count == schedules == steps
        and before == after
    )
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in EPP_GAUGES:
        assert families[name].type == "gauge", name
        assert len(families[name].samples) == 1 and families[name].samples[0].labels == {
            "model_name": "tiny"
        }
    info = families["vllm:cache_config_info"]
    assert info.type == "gauge"
    (sample,) = info.samples
    config = server.engine.config.cache
    assert int(sample.labels["block_size"]) == config.block_size
    assert int(sample.labels["num_gpu_blocks"]) == config.num_blocks
    assert sample.value == 1

    def value(name: str) -> float:
        return families[name].samples[0].value

    return Scrape(
        value("vllm:num_requests_waiting"),
        value("vllm:num_requests_running"),
        value("vllm:kv_cache_usage_perc"),
        before if steady else None,
    )


def wait_for(condition: Callable[[], bool], timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.002)
    return condition()


def test_metrics_the_epp_reads_under_load(tiny_model_dir: Path) -> None:
    engine = tiny_engine(tiny_model_dir, EngineHooks(step_delay=0.05), max_num_seqs=MAX_NUM_SEQS)
    with LiveServer(engine, served_model_name="tiny") as server, httpx.Client() as client:
        scheduled = ScheduleCount(server.engine.core)

        def complete(i: int) -> int:
            body = {"prompt": f"t{10 + i} t11 t12 t13", "max_tokens": 24, "ignore_eos": True}
            return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).status_code

        with ThreadPoolExecutor(10) as pool:
            answers = pool.map(complete, range(10))
            # Compare from when every request is in the scheduler and a step has published
            # since: from then on only steps change what the gauges show.
            core = server.engine.core
            assert wait_for(lambda: len(core.scheduler.requests) == 10)
            published = core.num_steps + 2
            assert wait_for(lambda: core.num_steps >= published)
            scrapes: list[Scrape] = []
            while len(scrapes) < 400:
                scrapes.append(scrape(server, client, scheduled))
                if scrapes[-1].running == 0 and len(scrapes) > 20 and server.wait_idle(0):
                    break
                time.sleep(0.01)
            assert list(answers) == [200] * 10
        scrapes.append(scrape(server, client, scheduled))
    for s in scrapes:
        assert s.waiting >= 0 and s.waiting == int(s.waiting)
        assert 0 <= s.running <= MAX_NUM_SEQS and s.running == int(s.running)
        assert 0.0 <= s.kv_usage <= 1.0
    steady = [s for s in scrapes if s.engine is not None]
    assert len(steady) >= 5, "too few scrapes between steps to compare"
    for s in steady:
        assert s.engine is not None
        assert (s.running, s.waiting) == s.engine[:2]
        assert abs(s.kv_usage - s.engine[2]) < 1e-9
    # Under load: a full batch with a queue behind it; idle at the end.
    assert any(s.running == MAX_NUM_SEQS and s.waiting > 0 for s in scrapes)
    assert (scrapes[-1].running, scrapes[-1].waiting, scrapes[-1].kv_usage) == (0, 0, 0.0)
