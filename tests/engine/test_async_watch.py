"""AsyncLLM.watch on a tiny model: a snapshot then deltas while requests share a prefix,
views only while someone watches, and the end of the watch with the engine loop."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest

from engine import AsyncLLM, EngineArgs, EngineDelta, EngineSnapshot, EngineView, SamplingParams
from engine.introspection import EngineMonitor
from tests.engine.test_introspection import apply
from tests.tiny_models import make_tiny_model

PREFIX = list(range(10, 58))  # three blocks of 16 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-watch"))


def make_engine(path: Path) -> AsyncLLM:
    args = EngineArgs(model=str(path), dtype="float32", num_kv_blocks=64, max_model_len=256)
    return AsyncLLM.from_engine_args(args)


async def generate(engine: AsyncLLM, request_id: str, tail: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    async for _ in engine.generate([*PREFIX, tail], params, request_id):
        pass


async def collect(engine: AsyncLLM, views: list[EngineView], idle: asyncio.Event) -> None:
    async for view in engine.watch():
        views.append(view)
        if idle.is_set() and view.gauges.num_running == 0:
            return


def test_watch_follows_a_shared_prefix_workload(model_dir: Path) -> None:
    views: list[EngineView] = []

    async def run() -> None:
        engine = make_engine(model_dir)
        engine.start()
        idle = asyncio.Event()
        watching = asyncio.create_task(collect(engine, views, idle))
        await asyncio.sleep(0)
        await asyncio.gather(*(generate(engine, f"req{i}", 100 + i) for i in range(6)))
        idle.set()
        await asyncio.wait_for(watching, timeout=30)
        await engine.stop()

    asyncio.run(run())
    assert isinstance(views[0], EngineSnapshot)
    assert views[0].num_blocks == 64 and views[0].block_size == 16
    assert all(isinstance(v, EngineDelta) for v in views[1:])
    state = views[0]
    for view in views[1:]:
        assert isinstance(view, EngineDelta)
        state = apply(state, view)
    assert any(v.counts.shared > 0 for v in views), "the prefix blocks were never seen shared"
    assert state.counts.in_use == state.counts.shared == 0
    assert state.counts.cached >= 3 and state.states.count("2") == state.counts.cached
    finished = {f.request_id: f for f in state.finished}
    assert sorted(finished) == [f"req{i}-0" for i in range(6)]
    assert all(f.ttft is not None and f.num_output_tokens == 40 for f in finished.values())
    assert sum(f.num_cached_tokens for f in finished.values()) >= 5 * 48
    # A few views a second at most: consecutive views are min_interval apart or more.
    gaps = [b.time - a.time for a, b in itertools.pairwise(views)]
    assert min(gaps) >= 0.5 - 0.01


def test_no_view_is_taken_without_a_watcher(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    captures = []
    monkeypatch.setattr(EngineMonitor, "capture", lambda self: captures.append(self))

    async def run() -> None:
        engine = make_engine(model_dir)
        engine.start()
        await asyncio.gather(*(generate(engine, f"req{i}", 100 + i) for i in range(3)))
        await engine.stop()

    asyncio.run(run())
    assert captures == []


def test_the_watch_ends_with_the_engine_loop(model_dir: Path) -> None:
    async def run() -> list[EngineView]:
        engine = make_engine(model_dir)
        engine.start()
        views: list[EngineView] = []
        watching = asyncio.create_task(collect_all(engine, views))
        while not views:
            await asyncio.sleep(0.05)
        await engine.stop()
        await asyncio.wait_for(watching, timeout=5)
        return views

    async def collect_all(engine: AsyncLLM, views: list[EngineView]) -> None:
        async for view in engine.watch():
            views.append(view)

    views = asyncio.run(run())
    assert isinstance(views[0], EngineSnapshot) and views[0].gauges.num_running == 0
