"""The per-step CPU thread policy."""

from __future__ import annotations

import pytest
import torch

from engine.worker.cpu_threads import EXPLORE_EVERY, SLOWER, WARMUP_STEPS, StepThreads


def test_a_step_sets_its_threads_and_restores_the_callers() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        policy = StepThreads(max_threads=2)
        with policy.step() as threads:
            assert threads == 2 and torch.get_num_threads() == 2
        assert torch.get_num_threads() == 3
        with StepThreads(max_threads=1).step() as threads:
            assert threads == 1 and torch.get_num_threads() == 1
        assert torch.get_num_threads() == 3
        with pytest.raises(RuntimeError), policy.step():
            raise RuntimeError("a failing step")
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


class FakeSteps:
    """Steps through a StepThreads on a fake clock: a step's forward and sampling take
    `cost[threads]` seconds together (nine tenths and one)."""

    def __init__(self, policy: StepThreads, clock: list[float]) -> None:
        self.policy, self.clock = policy, clock

    def run(self, num_tokens: int, cost: dict[int, float]) -> int:
        with self.policy.step(num_tokens) as threads:
            assert torch.get_num_threads() == threads
            self.clock[0] += 0.9 * cost[threads]
        with self.policy.step() as again:  # sampling: the step's count
            assert again == threads
            self.clock[0] += 0.1 * cost[threads]
        return threads


def fake_policy(max_threads: int = 2) -> FakeSteps:
    clock = [0.0]
    return FakeSteps(StepThreads(max_threads, clock=lambda: clock[0]), clock)


def test_small_steps_run_on_the_count_measured_faster() -> None:
    steps = fake_policy()
    one_faster = {1: 0.004, 2: 0.010}  # a decode whose barriers cost more than a thread gives
    counts = [steps.run(1, one_faster) for _ in range(2 * WARMUP_STEPS + 10)]
    # Every thread first, then one, then the faster: one.
    assert counts == [2] * WARMUP_STEPS + [1] * WARMUP_STEPS + [1] * 10
    assert steps.policy.chosen(1) == 1
    # Another size class measures for itself: 16 tokens are faster on two threads.
    two_faster = {1: 0.029, 2: 0.023}
    counts = [steps.run(16, two_faster) for _ in range(2 * WARMUP_STEPS + 10)]
    assert counts[2 * WARMUP_STEPS :] == [2] * 10 and steps.policy.chosen(17) == 2
    assert steps.policy.chosen(1) == 1  # (16-31 tokens are one class, 1 another)


def test_a_count_much_slower_at_once_warms_up_for_one_step() -> None:
    # A prefill chunk beside decodes: one thread takes twice as long. Its first step shows
    # it, and the rest of its warm-up (steps in the inter-token latency's tail) is skipped.
    steps = fake_policy()
    half_speed = {1: 0.080, 2: 0.040}
    counts = [steps.run(79, half_speed) for _ in range(WARMUP_STEPS + 10)]
    assert counts == [2] * WARMUP_STEPS + [1] + [2] * 9
    assert steps.policy.chosen(79) == 2
    # Within SLOWER of the other, a count warms up in full: one step is too few to tell.
    close = {1: 0.040 * SLOWER * 0.95, 2: 0.040}
    counts = [steps.run(40, close) for _ in range(2 * WARMUP_STEPS + 1)]
    assert counts == [2] * WARMUP_STEPS + [1] * WARMUP_STEPS + [2]
    # The faster count is never cut short: one thread, 2.5x faster, warms up in full, then wins.
    one_faster = {1: 0.004, 2: 0.010}
    counts = [steps.run(1, one_faster) for _ in range(2 * WARMUP_STEPS + 1)]
    assert counts == [2] * WARMUP_STEPS + [1] * WARMUP_STEPS + [1]


def test_the_choice_follows_the_load() -> None:
    steps = fake_policy()
    for _ in range(2 * WARMUP_STEPS):
        steps.run(3, {1: 0.005, 2: 0.010})
    # A neighbour slows one thread's steps down: its own measurements show it at once.
    slowed = {1: 0.030, 2: 0.010}
    counts = [steps.run(3, slowed) for _ in range(5)]
    assert counts[0] == 1 and counts[-1] == 2
    # It leaves: one step in EXPLORE_EVERY tries one thread again, and finds it faster.
    quiet = {1: 0.005, 2: 0.010}
    counts = [steps.run(3, quiet) for _ in range(2 * EXPLORE_EVERY)]
    assert counts.count(1) >= EXPLORE_EVERY - 2 and counts[-1] == 1


def test_large_steps_and_one_thread_are_never_measured() -> None:
    steps = fake_policy()
    assert [steps.run(128, {1: 0.001, 2: 0.1}) for _ in range(10)] == [2] * 10
    assert steps.policy.chosen(500) == 2 and steps.policy._estimates == {}
    single = fake_policy(max_threads=1)
    assert [single.run(1, {1: 0.01}) for _ in range(10)] == [1] * 10
    assert single.policy._estimates == {}


def test_engine_steps_leave_the_callers_thread_count_alone(tmp_path) -> None:
    from engine import LLM, SamplingParams
    from tests.tiny_models import make_tiny_model

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        llm = LLM(str(make_tiny_model("llama", tmp_path)), dtype="float32", num_threads=2,
                  num_kv_blocks=32, max_model_len=128)  # fmt: skip
        assert torch.get_num_threads() == 3
        llm.generate(["t5 t6 t7"] * 20, SamplingParams(max_tokens=3))
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_the_async_engine_loads_and_steps_on_one_thread(tmp_path, monkeypatch) -> None:
    """Loading on another thread than the steps' leaves the process two OpenMP pools, and
    libgomp then parks its threads after every parallel region (engine_thread)."""
    import asyncio
    import threading

    from engine import AsyncLLM, EngineArgs, SamplingParams
    from engine.core import EngineCore
    from tests.tiny_models import make_tiny_model

    threads: dict[str, set[int]] = {"load": set(), "step": set()}
    load, step = EngineCore.from_args.__func__, EngineCore.step

    def recording_load(cls, *args, **kwargs):
        threads["load"].add(threading.get_ident())
        return load(cls, *args, **kwargs)

    def recording_step(self):
        threads["step"].add(threading.get_ident())
        return step(self)

    monkeypatch.setattr(EngineCore, "from_args", classmethod(recording_load))
    monkeypatch.setattr(EngineCore, "step", recording_step)
    args = EngineArgs(model=str(make_tiny_model("llama", tmp_path)), dtype="float32",
                      num_kv_blocks=32, max_model_len=128, engine_in_process=True)  # fmt: skip
    engine = AsyncLLM.from_engine_args(args)

    async def run() -> None:
        engine.start()
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        async for _ in engine.generate([5, 6, 7], params, "r"):
            pass
        await engine.stop()

    asyncio.run(run())
    assert len(threads["step"]) == 1 and threads["load"] == threads["step"]
    assert threading.get_ident() not in threads["step"]


@pytest.mark.parametrize(
    ("files", "cap"),
    [({"cpu.max": "max 100000\n"}, None), ({"cpu.max": "400000 100000\n"}, 4),
     ({"cpu.max": "150000 100000\n"}, 2), ({"cpu.max": "140000 100000\n"}, 1),
     ({"cpu.max": "20000 100000\n"}, 1), ({}, None), ({"cpu.max": "garbage\n"}, None),
     ({"cpu.max": "abc 100000\n"}, None),
     ({"cpu.cfs_quota_us": "250000\n", "cpu.cfs_period_us": "100000\n"}, 3),
     ({"cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"}, None)],
)  # fmt: skip
def test_available_cpus_follows_the_cgroup_quota_rounded(tmp_path, files, cap) -> None:
    import os

    from engine.worker.worker import available_cpus

    for name, text in files.items():
        (tmp_path / name).write_text(text)
    version = "v1" if any(name.startswith("cpu.cfs") for name in files) else "v2"
    affinity = len(os.sched_getaffinity(0))
    got = available_cpus((tmp_path, version))
    assert got == (affinity if cap is None else min(affinity, cap))
