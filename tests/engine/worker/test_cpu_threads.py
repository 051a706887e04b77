"""The per-step CPU thread policy."""

from __future__ import annotations

import pytest
import torch

from engine.worker.cpu_threads import StepThreads


def test_small_steps_run_on_one_thread_and_large_on_all() -> None:
    policy = StepThreads(max_threads=4)
    assert [policy.for_step(n, 200) for n in (1, 15, 16, 512)] == [1, 1, 4, 4]
    # A few decodes over long contexts are attention-heavy: every core.
    assert policy.for_step(8, 8 * 1056) == 4


def test_a_step_sets_its_threads_and_restores_the_callers() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        policy = StepThreads(max_threads=2)
        with policy.step(1, 100) as threads:
            assert threads == 1 and torch.get_num_threads() == 1
        assert torch.get_num_threads() == 3
        with policy.step(64, 6400) as threads:
            assert threads == 2 and torch.get_num_threads() == 2
        assert torch.get_num_threads() == 3
        with pytest.raises(RuntimeError), policy.step(1, 1):
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
