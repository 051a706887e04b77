"""A screen for the bfloat16 LM head's greedy tokens on the CPU: the same tokens as
bf16_linear_argmax over the whole head, from about half its reading.

A decode step of a few rows reads the whole head for its argmax: 56.6 MB of the default
model's 269 (21%), a sixth of a single stream's step. The screen is an int8 copy of the head,
one float32 scale per row, and two bounds per row on what the copy leaves out;
pagedserve::bf16_linear_argmax_screened (engine/ops/csrc/bf16_linear_ops.cpp, where the
bounds are derived) reads it, keeps the rows whose logit could still be the largest (on the
default model's greedy steps, 4.7 tiles of 16 rows out of 3,072 on average, 34 at the 99th
percentile) and computes those rows' tiles exactly, with the kernel and rows the whole head
would use: the same token, ties included. Where it cannot decide cheaply (a flat
distribution, a row of x not finite) the whole head runs.

Steps of up to SCREEN_ROWS rows use it; past that the head's tiles, which read each weight
once for every row, cost less than the screen's integer sums per row
(benchmarks/head_screen.py measures both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Steps of at most this many rows screen their greedy tokens (benchmarks/head_screen.py).
SCREEN_ROWS = 4
# Rows of the head quantized at a time (float64 temporaries of this many rows).
_CHUNK = 4096


@dataclass
class HeadScreen:
    """The int8 copy (N, K padded to 32) and, as the rows of `bounds` (3, N) float32, each
    row's scale s, a bound E on |w - s q| plus the float32 sums' slack, and a bound F on
    |s q| (Euclidean norms)."""

    weight: torch.Tensor
    bounds: torch.Tensor


def build_head_screen(head: torch.Tensor) -> HeadScreen:
    """The screen of a head (N, K), as bf16_linear_argmax_screened reads it."""
    n, k = head.shape
    padded = -(-k // 32) * 32
    q = torch.zeros(n, padded, dtype=torch.int8)
    bounds = torch.empty(3, n)
    # The kernel's float32 sums of K exact products stray from the exact logit by at most
    # about K float32 roundings of sum |h w| <= |h| |w|, |w| <= |s q| + |e|: twice that.
    slack = k * 2.0**-23
    inf = torch.tensor(float("inf"))
    for begin in range(0, n, _CHUNK):
        w = head[begin : begin + _CHUNK].double()
        finite = torch.isfinite(w).all(dim=1)
        w = torch.where(finite[:, None], w, 0.0)
        scale = (w.abs().amax(dim=1) / 127).float()  # the kernel's float32 scale
        s = scale.double()[:, None]
        ints = torch.where(s > 0, torch.round(w / torch.where(s > 0, s, 1.0)), 0.0)
        ints = ints.clamp(-127, 127)
        kept = s * ints
        e = (w - kept).norm(dim=1)
        f = kept.norm(dim=1)
        e_bound = torch.where(finite, e + slack * (f + e), inf.double())
        q[begin : begin + len(w), :k] = ints.to(torch.int8)
        rows = bounds[:, begin : begin + len(w)]
        rows[0] = scale
        rows[1] = torch.nextafter(e_bound.float(), inf)  # rounded up, as bounds must be
        rows[2] = torch.nextafter(f.float(), inf)
    return HeadScreen(q, bounds)
