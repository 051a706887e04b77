"""What a step costs, learnt from the steps' own times (pure Python), for
--prefill-time-beside-decodes.

A step's time is about a fixed part, a part per decoding request and a part per prompt
token: t = a + b * decodes + c * prompt_tokens. The streams decoding beside a prefill wait
for the whole step, so the prompt tokens' part is what they wait beyond a step of decodes
alone. On the CPU a prompt token costs 0.3 ms on one machine and 1.3-2 ms on another with the
same two cores (docs/benchmarks.md), and a step of 16 decodes 15 ms or 50, so a cap in
tokens cannot hold that wait in proportion on both, while one in time can.

`StepCost` fits (a, b, c) by least squares over the recent steps, each step's weight
decaying by DECAY a step, so that it follows a machine whose speed drifts; a small ridge
keeps the fit defined while the steps do not vary enough to tell the parts apart (every step
16 decodes, say), where it still predicts the steps seen.
"""

from __future__ import annotations

# Each step's weight in the fit, relative to the next one's: about 1 / (1 - DECAY) steps
# count.
DECAY = 0.98
# Steps with decodes, and steps with prompt tokens, the fit needs before it answers.
MIN_STEPS = 3
# The fewest prompt tokens beside decodes that tokens_within returns. A step of one or two
# decodes is short, and a cap of a few tokens beside it keeps a burst of new prompts waiting
# behind those streams; so would a large model, whose prompt token can cost more than its
# whole allowance. In benchmarks/closed_loop.py (16 streams of 200-token prompts, a 2-core
# Zen 3; docs/benchmarks.md), 8 took the TTFT p50 to 1.6-4.9 s against 1.4-1.6 at 32, and
# 64 the decodes' p99 wait to 198-208 ms against 135-178.
MIN_TOKENS = 32
_RIDGE = 1e-3


class StepCost:
    def __init__(self) -> None:
        # Decayed sums of x x^T and x * t over the steps, x = (1, decodes, prompt tokens).
        self._xx = [[0.0] * 3 for _ in range(3)]
        self._xt = [0.0] * 3
        self.decode_steps = 0  # steps seen with decodes
        self.prompt_steps = 0  # steps seen with prompt tokens
        self._fit: tuple[float, float, float] | None = None

    def observe(self, num_decodes: int, num_prompt_tokens: int, seconds: float) -> None:
        """One step's time, with its decoding requests and prompt tokens."""
        if not num_decodes and not num_prompt_tokens:
            return
        x = (1.0, float(num_decodes), float(num_prompt_tokens))
        ms = 1e3 * seconds
        for i in range(3):
            row = self._xx[i]
            for j in range(3):
                row[j] = DECAY * row[j] + x[i] * x[j]
            self._xt[i] = DECAY * self._xt[i] + x[i] * ms
        self.decode_steps += num_decodes > 0
        self.prompt_steps += num_prompt_tokens > 0
        self._fit = None

    def fit(self) -> tuple[float, float, float] | None:
        """(a, b, c) in milliseconds, or None until enough steps of each kind were seen."""
        if self.decode_steps < MIN_STEPS or self.prompt_steps < MIN_STEPS:
            return None
        if self._fit is None:
            ridge = [
                [self._xx[i][j] + (_RIDGE if i == j else 0.0) for j in range(3)] for i in range(3)
            ]
            self._fit = _solve3(ridge, self._xt)
        return self._fit

    def decode_ms(self, num_decodes: int) -> float | None:
        """The time of a step of `num_decodes` decodes alone; None while not known."""
        fit = self.fit()
        if fit is None:
            return None
        ms = fit[0] + fit[1] * num_decodes
        return ms if ms > 0 else None

    def ms_per_token(self) -> float | None:
        """The time one prompt token adds to a step; None while not known, or while the
        steps with prompt tokens have not been slower for them (by a microsecond a token)."""
        fit = self.fit()
        if fit is None or fit[2] < 1e-3:
            return None
        return fit[2]

    def tokens_within(self, ms: float) -> int | None:
        """The most prompt tokens whose time is about `ms` (at least MIN_TOKENS); None while
        a prompt token's time is not known."""
        per_token = self.ms_per_token()
        if per_token is None:
            return None
        if per_token * MIN_TOKENS >= ms:
            return MIN_TOKENS
        return int(ms / per_token)


def _solve3(a: list[list[float]], b: list[float]) -> tuple[float, float, float] | None:
    """x with a x = b for a symmetric positive definite 3x3 `a` (Gaussian elimination with
    partial pivoting); None where `a` is singular."""
    m = [[*row, v] for row, v in zip(a, b, strict=True)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, 3):
            f = m[r][col] / m[col][col]
            for k in range(col, 4):
                m[r][k] -= f * m[col][k]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (m[r][3] - sum(m[r][k] * x[k] for k in range(r + 1, 3))) / m[r][r]
    return x[0], x[1], x[2]
