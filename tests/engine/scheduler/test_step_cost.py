"""What a step's decodes and prompt tokens cost, fitted to the steps' times
(--prefill-time-beside-decodes)."""

from __future__ import annotations

import random

import pytest

from engine.scheduler.step_cost import MIN_STEPS, MIN_TOKENS, StepCost


def taught(a: float, b: float, c: float, steps: int = 60, seed: int = 0) -> StepCost:
    """Steps of 0-16 decodes and 0-64 prompt tokens taking a + b decodes + c tokens ms,
    give or take 5%."""
    rng = random.Random(seed)
    cost = StepCost()
    for _ in range(steps):
        decodes, tokens = rng.randrange(0, 17), rng.choice([0, 0, 8, 16, 40, 64])
        cost.observe(
            decodes, tokens, (a + b * decodes + c * tokens) * rng.uniform(0.95, 1.05) / 1e3
        )
    return cost


def test_unknown_until_both_kinds_of_step_were_seen() -> None:
    cost = StepCost()
    cost.observe(0, 0, 0.5)  # an empty step (a grammar still compiling) says nothing
    for _ in range(10):
        cost.observe(4, 0, 0.010)
    assert cost.fit() is None and cost.decode_ms(4) is None
    for count in range(MIN_STEPS):
        assert cost.ms_per_token() is None, count
        cost.observe(0, 50, 0.1 + count * 0.01)
    assert cost.ms_per_token() is not None
    assert cost.decode_ms(4) == pytest.approx(10.0, rel=1e-3)


def test_the_fit_finds_each_part_in_noisy_steps() -> None:
    a, b, c = taught(3.0, 2.2, 1.34).fit()  # type: ignore[misc]
    assert (a, b, c) == pytest.approx((3.0, 2.2, 1.34), abs=0.6)
    assert c == pytest.approx(1.34, rel=0.05)
    cost = taught(3.0, 2.2, 1.34)
    assert cost.decode_ms(16) == pytest.approx(3.0 + 16 * 2.2, rel=0.05)
    assert cost.tokens_within(80.0) == pytest.approx(80 / 1.34, rel=0.06)


def test_steps_all_alike_in_decodes_still_predict_them() -> None:
    """Every step 16 decodes: the fixed part and the decodes' cannot be told apart, but
    their sum at 16, which is all that is asked, is right."""
    cost = StepCost()
    for tokens in [0, 15, 30] * 20:
        cost.observe(16, tokens, (40 + 1.34 * tokens) / 1e3)
    assert cost.decode_ms(16) == pytest.approx(40.0, rel=1e-3)
    assert cost.ms_per_token() == pytest.approx(1.34, rel=1e-3)


def test_it_follows_a_machine_that_slows_down() -> None:
    cost = taught(3.0, 0.8, 0.3)
    assert cost.ms_per_token() == pytest.approx(0.3, rel=0.1)
    rng = random.Random(1)
    for _ in range(300):  # the same steps, now at Zen 3 speed rather than Zen 5's
        decodes, tokens = rng.randrange(0, 17), rng.choice([0, 16, 40])
        cost.observe(decodes, tokens, (3.0 + 2.2 * decodes + 1.34 * tokens) / 1e3)
    assert cost.ms_per_token() == pytest.approx(1.34, rel=0.02)
    assert cost.decode_ms(16) == pytest.approx(3.0 + 16 * 2.2, rel=0.02)


def test_a_costly_token_still_moves_the_prompt() -> None:
    assert taught(500.0, 30.0, 70.0).tokens_within(600.0) == MIN_TOKENS


def test_no_time_for_prompt_tokens_is_no_answer() -> None:
    """Steps with prompt tokens no slower than those without (noise, tiny prompts): no cost
    to divide by, so no cap in time yet."""
    cost = StepCost()
    for tokens in [0, 20] * 10:
        cost.observe(4, tokens, 0.010)
    assert cost.ms_per_token() is None
    assert cost.tokens_within(20.0) is None
