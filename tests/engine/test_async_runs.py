"""AsyncLLM's runs of steps on a tiny model: the worker thread steps back to back while the
event loop has nothing to apply between steps, and a run ends at the first step after which
it has (a new request, a stop string's abort, a view that is due).

Every step first sleeps a few milliseconds (EngineHooks.step_delay), so the loop keeps up
with the steps it hands out, as it does with a real model."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from engine import AsyncLLM, EngineArgs, SamplingParams
from engine.config import EngineHooks
from tests.tiny_models import make_cycle_model

CYCLE = "abcdefgh"  # the model's greedy text after "a": "bcdefghabc..."
STEP_DELAY = 0.004


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_cycle_model(tmp_path_factory.mktemp("tiny-runs"), CYCLE)


class Runs:
    """Counts the runs the engine loop starts on its worker thread."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.count = 0
        submit = engine._executor.submit

        def counted(fn: Any, *args: Any) -> Any:
            self.count += 1
            return submit(fn, *args)

        engine._executor.submit = counted  # type: ignore[method-assign]


def make_engine(path: Path) -> AsyncLLM:
    args = EngineArgs(
        model=str(path),
        dtype="float32",
        num_kv_blocks=64,
        max_model_len=256,
        engine_in_process=True,
    )
    return AsyncLLM.from_engine_args(args, EngineHooks(step_delay=STEP_DELAY))


def prompt(engine: AsyncLLM, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


async def collect(engine: AsyncLLM, request_id: str, params: SamplingParams) -> str:
    text = ""
    async for output in engine.generate(prompt(engine, "a"), params, request_id):
        text = output.outputs[0].text
    return text


def test_a_lone_request_runs_its_steps_back_to_back(model_dir: Path) -> None:
    async def run() -> tuple[str, int, int]:
        engine = make_engine(model_dir)
        runs = Runs(engine)
        engine.start()
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        text = await collect(engine, "lone", params)
        await engine.stop()
        return text, runs.count, engine.core.num_steps

    text, runs, steps = asyncio.run(run())
    assert text == (CYCLE[1:] + CYCLE * 5)[:40]
    # One step per run would be 40 runs; the loop wakes to start a run only when it has
    # fallen behind the worker or has something to apply.
    assert steps == 40 and runs <= 8, (steps, runs)


def test_a_request_added_mid_run_starts_at_the_next_step(model_dir: Path) -> None:
    async def run() -> tuple[int, int]:
        engine = make_engine(model_dir)
        engine.start()
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        first = asyncio.create_task(collect(engine, "long", long))
        while engine.core.num_steps < 10:
            await asyncio.sleep(STEP_DELAY)
        added_at = engine.core.num_steps
        stream = engine.generate(prompt(engine, "a"), SamplingParams(max_tokens=1), "short")
        async for _ in stream:
            break
        started_at = engine.core.num_steps
        first.cancel()
        await engine.stop()
        return added_at, started_at

    added_at, started_at = asyncio.run(run())
    # The step in flight when it came ends the run; the next step prefills it. (Were the
    # run blind to the inbox, the request would wait for the other one's 200 tokens.)
    assert started_at - added_at <= 4, (added_at, started_at)


def test_a_stop_string_ends_the_run_one_step_later(model_dir: Path) -> None:
    async def run() -> tuple[str, int]:
        engine = make_engine(model_dir)
        engine.start()
        params = SamplingParams(temperature=0.0, max_tokens=100, stop=["e"], ignore_eos=True)
        text = await collect(engine, "stops", params)
        while engine.core.has_unfinished_requests():
            await asyncio.sleep(STEP_DELAY)
        await engine.stop()
        return text, engine.core.num_steps

    text, steps = asyncio.run(run())
    assert text == "bcd"
    # Step 4 makes "e"; the loop finds it while step 5 runs, and the run ends there: the
    # engine request is aborted before step 6, not after its 100 tokens.
    assert steps == 5, steps


def test_a_due_view_ends_the_run(model_dir: Path) -> None:
    async def run() -> tuple[int, int]:
        engine = make_engine(model_dir)
        monitor = engine._monitor
        monitor.min_interval, monitor.max_share = 0.0, 1.0  # a view is due after every step
        captures = 0
        capture = monitor.capture

        def counted() -> None:
            nonlocal captures
            captures += 1
            capture()

        monitor.capture = counted  # type: ignore[method-assign]
        engine.start()

        async def watch() -> None:
            async for _ in engine.watch():
                pass

        watching = asyncio.create_task(watch())
        await asyncio.sleep(0)
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        await collect(engine, "watched", params)
        watching.cancel()
        await engine.stop()
        return captures, engine.core.num_steps

    captures, steps = asyncio.run(run())
    # Views are taken between runs only: with one always due, each step ends its run.
    assert steps == 30 and captures >= steps, (captures, steps)
