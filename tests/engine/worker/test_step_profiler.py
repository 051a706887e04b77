"""StepProfiler: per-section totals, and on CUDA a device synchronization around each
section so that a section's GPU time is counted in it rather than where it is next awaited."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from engine.worker.step_profiler import StepProfiler


def test_sections_accumulate_their_wall_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each section adds the clock's advance across it to its name's total (a fake clock:
    no timing in the test)."""
    import engine.worker.step_profiler as step_profiler

    clock = [0.0]
    monkeypatch.setattr(step_profiler.time, "perf_counter", lambda: clock[0])
    profiler = StepProfiler(True)
    for _ in range(3):
        with profiler.section("forward"):
            clock[0] += 0.5
    with profiler.section("sampling"):
        clock[0] += 0.25
    clock[0] += 10.0  # outside any section
    assert profiler.report() == {"forward": 1.5, "sampling": 0.25}


def test_disabled_profiler_records_nothing() -> None:
    profiler = StepProfiler(False, "cuda")
    with profiler.section("forward"):
        pass
    assert profiler.report() == {}


@pytest.mark.parametrize(("device", "syncs"), [("cpu", 0), ("cuda", 2), ("cuda:0", 2)])
def test_a_cuda_section_waits_for_the_device_at_both_ends(
    monkeypatch: pytest.MonkeyPatch, device: str, syncs: int
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    profiler = StepProfiler(True, torch.device(device))
    with profiler.section("forward"):
        calls.append("body")
    assert calls == ["sync"] * (syncs // 2) + ["body"] + ["sync"] * (syncs // 2)


class _Backend:
    name = "stub"

    def plan(self, metadata: object) -> None:
        pass


class _NativeBackend(_Backend):
    def stack_args(self) -> tuple[int, ...]:
        return (3, 7)


def test_the_timed_backend_keeps_the_native_layers_arguments() -> None:
    """Without stack_args the model falls back to its Python layers: a profile would time
    another path than the one served."""
    profiler = StepProfiler(True)
    assert profiler.wrap_backend(_NativeBackend()).stack_args() == (3, 7)  # type: ignore[arg-type]
    assert not hasattr(profiler.wrap_backend(_Backend()), "stack_args")  # type: ignore[arg-type]


def test_a_profiled_engine_runs_the_native_layers_and_times_each_section(tmp_path: Path) -> None:
    from engine import LLM, EngineHooks, SamplingParams
    from engine.ops.loader import native_kernels
    from tests.tiny_models import make_tiny_model

    assert native_kernels().available, native_kernels().reason
    llm = LLM(
        str(make_tiny_model("llama", tmp_path)), dtype="float32", hooks=EngineHooks(profile=True)
    )
    assert llm.core.runner.model.fused_layers is not None
    start = time.perf_counter()
    llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    wall = time.perf_counter() - start
    totals = llm.core.runner.profiler.report()
    assert {"metadata", "forward", "logits", "sampling"} <= set(totals)
    assert "attention" not in totals  # attention ran inside the native layers
    assert sum(totals.values()) <= wall  # the sections do not overlap
