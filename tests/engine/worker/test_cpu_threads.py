"""The per-step CPU thread policy."""

from __future__ import annotations

import pytest
import torch

from engine.worker.cpu_threads import StepThreads


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
