"""The screened greedy argmax of a bfloat16 LM head (bf16_linear_argmax_screened in
engine/ops/csrc/bf16_linear_ops.cpp, its screen from engine/models/head_screen.py): the same
token as bf16_linear_argmax over the whole head, in every instruction set built; on ties,
past the valid columns, on rows alike (untrained tokens) and on inputs the screen cannot
decide, where the whole head runs. And the screen does narrow: a peaked row keeps a tile or
two of the head."""

from __future__ import annotations

import pytest
import torch

from engine.models.head_screen import build_head_screen
from engine.models.layers import tile_bf16_weight
from engine.ops.loader import native_kernels
from tests.isas import isa_params
from tests.threads import torch_threads

pytestmark = pytest.mark.skipif(not native_kernels().available, reason="no native kernels")

ISAS = isa_params()


def both(weight: torch.Tensor, x: torch.Tensor, n_valid: int, isa: str) -> tuple[list, list]:
    """(the whole head's tokens, the screened tokens)."""
    n = weight.shape[0]
    tiled = tile_bf16_weight(weight)
    screen = build_head_screen(weight)
    whole = torch.ops.pagedserve.bf16_linear_argmax(x, tiled, n, n_valid, isa)
    screened = torch.ops.pagedserve.bf16_linear_argmax_screened(
        x, tiled, n, n_valid, screen.weight, screen.bounds, isa
    )
    assert screened.dtype == torch.int64 and screened.shape == (len(x),)
    return whole.tolist(), screened.tolist()


def tiles(weight: torch.Tensor, x: torch.Tensor, n_valid: int, isa: str) -> list[int]:
    screen = build_head_screen(weight)
    return torch.ops.pagedserve.bf16_linear_screen_tiles(
        x, n_valid, screen.weight, screen.bounds, isa
    ).tolist()


def lm_like(n: int, k: int, m: int, seed: int, peak: float = 3.0) -> tuple[torch.Tensor, ...]:
    """A head and rows of x whose logits spread like an LM's: each row of x near one of the
    head's rows (its 'next token') and the logits a few units apart."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    targets = torch.randint(0, n, (m,), generator=g)
    x = torch.randn(m, k, generator=g) + peak * weight[targets].float() / 0.05
    return weight, x.bfloat16()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    ("n", "k", "m"), [(3000, 64, 1), (5000, 96, 2), (4096, 40, 3), (2050, 576, 4)]
)
def test_the_screened_token_is_the_whole_heads(isa: str, n: int, k: int, m: int) -> None:
    for seed in range(4):
        weight, x = lm_like(n, k, m, seed)
        whole, screened = both(weight, x, n, isa)
        assert screened == whole


@pytest.mark.parametrize("isa", ISAS)
def test_a_peaked_row_keeps_a_tile_or_two(isa: str) -> None:
    """If the screen kept everything (or gave up), the tests above would pass all the same."""
    weight, x = lm_like(8000, 128, 1, seed=1, peak=6.0)
    kept = tiles(weight, x, 8000, isa)
    assert 1 <= len(kept) <= 2
    whole, _ = both(weight, x, 8000, isa)
    assert whole[0] // 16 in kept


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 3])
def test_ties_go_to_the_first_index_and_padding_is_not_a_token(isa: str, m: int) -> None:
    """Copies of the best row far apart (exact ties, in different tiles and tasks); a larger
    row still, past n_valid."""
    n, k, n_valid = 6000, 64, 5990
    weight, x = lm_like(n, k, m, seed=m)
    best = (x[0].float() / x[0].float().norm()).bfloat16()
    for i in (4001, 700, 2222):
        weight[i] = best
    weight[5995] = best * 4
    whole, screened = both(weight, x, n_valid, isa)
    assert screened[0] == 700 and screened == whole
    assert set(tiles(weight, x, n_valid, isa)) >= {700 // 16, 2222 // 16, 4001 // 16}
    whole, screened = both(weight, x, n, isa)
    assert screened[0] == 5995 and screened == whole


@pytest.mark.parametrize("isa", ISAS)
def test_near_ties_within_a_bfloat16_step(isa: str) -> None:
    """Rows whose logits differ by less than a bfloat16 spacing round to the same number:
    the first of them wins, wherever it lies."""
    n, k = 4000, 64
    g = torch.Generator().manual_seed(7)
    weight = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = torch.randn(1, k, generator=g).bfloat16()
    base = (x[0].float() / x[0].float().norm() * 2).bfloat16()
    for i, j in zip((3900, 1200, 2500, 30), range(4), strict=True):
        row = base.clone()
        row[j] = row[j] + (row[j].float() * 0.004).bfloat16()  # nudges below the rounding
        weight[i] = row
    whole, screened = both(weight, x, n, isa)
    assert screened == whole


@pytest.mark.parametrize("isa", ISAS)
def test_a_row_its_int8_copy_misjudges(isa: str) -> None:
    """The best row has one huge weight, where x is zero: its int8 copy rounds the rest of
    the row to zero, so the screen's own estimate of its logit is 0, below other rows'. Only
    the bounds keep it (a screen without them picks another row)."""
    n, k = 4000, 64
    weight, x = lm_like(n, k, 1, seed=8)
    x[0, 0] = 0
    logits = torch.ops.pagedserve.bf16_linear(x, tile_bf16_weight(weight), n).float()[0]
    assert logits.max() > 1
    row = x[0].float() * (float(logits.max()) + 2) / x[0].float().pow(2).sum()
    assert row.abs().max() < 0.3  # rounds to 0 at the copy's scale, 100 / 127
    row[0] = 100
    weight[2500] = row.bfloat16()
    whole, screened = both(weight, x, n, isa)
    assert whole == [2500] and screened == whole


@pytest.mark.parametrize("isa", ISAS)
def test_thousands_of_rows_alike(isa: str) -> None:
    """Untrained tokens: thousands of near-identical rows in the head's second half, their
    logits close together and below the best one, which lies in the first half."""
    n, k = 12000, 64
    weight, x = lm_like(n, k, 1, seed=3, peak=5.0)
    g = torch.Generator().manual_seed(4)
    alike = torch.randn(k, generator=g) * 0.02
    weight[6000:] = (alike + torch.randn(n - 6000, k, generator=g) * 1e-4).bfloat16()
    whole, screened = both(weight, x, n, isa)
    assert screened == whole
    assert 1 <= len(tiles(weight, x, n, isa)) <= 4


@pytest.mark.parametrize("isa", ISAS)
def test_what_the_screen_cannot_decide_runs_the_whole_head(isa: str) -> None:
    """A flat head (every logit equal), rows of x that are zero, infinite or NaN, and a row
    of the head that is not finite: the same tokens as the whole head's."""
    n, k = 3000, 64
    flat = torch.full((n, k), 0.01).bfloat16()
    x = torch.randn(2, k).bfloat16()
    assert tiles(flat, x, n, isa) == []
    whole, screened = both(flat, x, n, isa)
    assert screened == whole == [0, 0]
    weight, x = lm_like(n, k, 4, seed=5)
    x[0] = 0
    x[1, 3] = float("inf")
    x[2, 5] = float("nan")
    whole, screened = both(weight, x, n, isa)
    assert screened == whole
    weight[1234, 7] = float("inf")
    weight[2345, 1] = float("nan")
    x = lm_like(n, k, 2, seed=6)[1]
    whole, screened = both(weight, x, n, isa)
    assert screened == whole


def test_any_thread_count_gives_the_same_tokens() -> None:
    weight, x = lm_like(49152, 64, 3, seed=9)
    isa = native_kernels().isa
    want, _ = both(weight, x, 49152, isa)
    for threads in (1, 2, 3):
        with torch_threads(threads):
            assert both(weight, x, 49152, isa)[1] == want


def test_the_screen_holds_its_bounds() -> None:
    """The float64 quantities the kernel's bounds stand on: each row's int8 copy times its
    scale is within E of the row, and its norm is within F."""
    weight, _ = lm_like(500, 40, 1, seed=2)
    screen = build_head_screen(weight)
    assert screen.weight.shape == (500, 64) and not screen.weight[:, 40:].any()
    scale, e_bound, f_bound = screen.bounds.double()
    kept = scale[:, None] * screen.weight[:, :40].double()
    assert ((weight.double() - kept).norm(dim=1) <= e_bound).all()
    assert (kept.norm(dim=1) <= f_bound).all()
    assert (screen.weight.abs() <= 127).all()


def test_bad_arguments_are_refused() -> None:
    weight, x = lm_like(40, 64, 2, seed=0)
    tiled = tile_bf16_weight(weight)
    screen = build_head_screen(weight)
    op = torch.ops.pagedserve.bf16_linear_argmax_screened
    with pytest.raises(RuntimeError, match="n_valid"):
        op(x, tiled, 40, 41, screen.weight, screen.bounds)
    with pytest.raises(RuntimeError, match="bounds"):
        op(x, tiled, 40, 40, screen.weight, screen.bounds.t().contiguous())
    with pytest.raises(RuntimeError, match="screen"):
        op(x, tiled, 40, 40, screen.weight[:, :32].contiguous(), screen.bounds)
    other = build_head_screen(lm_like(48, 64, 1, seed=0)[0])
    with pytest.raises(RuntimeError, match="rows"):
        op(x, tiled, 40, 40, other.weight, other.bounds)
    assert op(x[:0], tiled, 40, 40, screen.weight, screen.bounds).shape == (0,)
