"""The per-step CPU thread policy."""

from __future__ import annotations

import torch

from engine.cpu_threads import StepThreads


def test_small_steps_run_on_one_thread_and_large_on_all() -> None:
    policy = StepThreads(max_threads=4)
    assert [policy.for_step(n, 200) for n in (1, 15, 16, 512)] == [1, 1, 4, 4]
    # A few decodes over long contexts are attention-heavy: every core.
    assert policy.for_step(8, 8 * 1056) == 4


def test_apply_changes_torch_only_when_needed() -> None:
    before = torch.get_num_threads()
    try:
        policy = StepThreads(max_threads=2)
        policy.apply(1, 100)
        assert torch.get_num_threads() == 1 and policy.current == 1
        policy.apply(64, 6400)
        assert torch.get_num_threads() == 2 and policy.current == 2
    finally:
        torch.set_num_threads(before)
