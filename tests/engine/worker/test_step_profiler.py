"""StepProfiler: per-section totals, and on CUDA a device synchronization around each
section so that a section's GPU time is counted in it rather than where it is next awaited."""

from __future__ import annotations

import time

import pytest
import torch

from engine.worker.step_profiler import StepProfiler


def test_sections_accumulate_their_wall_time() -> None:
    profiler = StepProfiler(True)
    for _ in range(3):
        with profiler.section("forward"):
            time.sleep(0.01)
    with profiler.section("sampling"):
        pass
    totals = profiler.report()
    assert set(totals) == {"forward", "sampling"}
    assert totals["forward"] >= 0.03 > totals["sampling"]


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
