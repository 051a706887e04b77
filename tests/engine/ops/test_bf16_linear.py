"""The bfloat16 linear kernel (engine/ops/csrc/bf16_linear_kernels.cpp: the dot product with
AVX512_BF16, float32 FMAs with AVX2) against a dense float64 reference, in every instruction
set built (those this CPU lacks are skipped, and say so), and the layers that use it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.layers import (
    TILED_BF16_ISAS,
    Linear,
    bf16_tileable,
    tile_bf16_weight,
    tiled_linear,
)
from engine.ops.loader import native_kernels
from tests.isas import isa_params
from tests.threads import torch_threads

pytestmark = pytest.mark.skipif(not native_kernels().available, reason="no native kernels")

ISAS = isa_params()


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.double() @ weight.double().T


def assert_rounded_reference(y: torch.Tensor, ref: torch.Tensor) -> None:
    """y is the float64 result rounded to bfloat16, up to float32 summation order: within a
    bfloat16 step of |y| plus a float32-sized error of the products' magnitudes."""
    assert y.dtype == torch.bfloat16
    step = ref.abs() * 2**-8
    assert ((y.double() - ref).abs() <= step + 1e-4).all(), (y.double() - ref).abs().max()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    ("n", "k", "m"),
    [
        (16, 2, 1),
        (37, 64, 1),
        (960, 576, 1),
        (50, 30, 3),
        (40, 96, 4),
        (33, 128, 9),
        (576, 1536, 17),
    ],
)
def test_kernel_matches_the_float64_reference(isa: str, n: int, k: int, m: int) -> None:
    g = torch.Generator().manual_seed(n * k + m)
    weight = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    y = torch.ops.pagedserve.bf16_linear(x, tile_bf16_weight(weight), n, isa)
    assert y.shape == (m, n)
    assert_rounded_reference(y, reference(x, weight))


@pytest.mark.parametrize("m", [1, 64, 300])
def test_any_thread_count_gives_the_same_bits(m: int) -> None:
    """The threads claim runs of tiles as they go (parallel.h): every tile is computed once,
    by whichever thread claims it, with the same arithmetic, so the result is bitwise the
    same on 1 thread as on 2 or 3, and a tile left unclaimed would show as garbage."""
    g = torch.Generator().manual_seed(m)
    weight = torch.randn(3072, 576, generator=g).bfloat16()
    x = torch.randn(m, 576, generator=g).bfloat16()
    tiled = tile_bf16_weight(weight)
    outputs = []
    for n in (1, 2, 3):
        with torch_threads(n):
            outputs.append(torch.ops.pagedserve.bf16_linear(x, tiled, 3072))
    assert_rounded_reference(outputs[0], reference(x, weight))
    for y in outputs[1:]:
        assert torch.equal(y, outputs[0])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 2, 4, 7, 8, *range(9, 21), 24, 25, 64, 513])
def test_every_row_count_takes_the_same_values_as_the_portable_loop(isa: str, m: int) -> None:
    """Each set's path (AVX512_BF16: one tile in one pass of 1-16 rows, then pairs of tiles
    in passes of 1-12 rows; AVX2: 1-4 rows, or from 16 rows on, float32 panels in passes of
    1-6 rows) against the portable loop, which rounds the same float32 sums: they may
    differ only by summation order."""
    g = torch.Generator().manual_seed(m)
    weight, x = (
        torch.randn(200, 96, generator=g).bfloat16(),
        torch.randn(m, 96, generator=g).bfloat16(),
    )
    tiled = tile_bf16_weight(weight)
    fast = torch.ops.pagedserve.bf16_linear(x, tiled, 200, isa)
    slow = torch.ops.pagedserve.bf16_linear(x, tiled, 200, "portable")
    torch.testing.assert_close(fast, slow, rtol=2**-7, atol=1e-3)
    assert_rounded_reference(fast, reference(x, weight))


AVX2 = [p for p in ISAS if p.values[0] == "avx2"]


@pytest.mark.parametrize("isa", AVX2)
@pytest.mark.parametrize("k", [2, 96, 1536])
def test_avx2_panels_give_the_bits_of_four_row_passes(isa: str, k: int) -> None:
    """From 16 rows on, the AVX2 path widens each tile to float32 once, in the first of its
    passes of at most 6 rows (17 rows: 6, 6, 5), and the later passes read it; below, 4-row
    passes decode the weights in registers. Both add the same exact
    products in the same order, so 16 of 17 rows at once equal the same rows 4 at a time,
    bit for bit, and a wrong panel offset or row remainder shows at once."""
    g = torch.Generator().manual_seed(k)
    weight = torch.randn(200, k, generator=g).bfloat16()
    x = torch.randn(17, k, generator=g).bfloat16()
    tiled = tile_bf16_weight(weight)
    together = torch.ops.pagedserve.bf16_linear(x, tiled, 200, isa)
    in_fours = [
        torch.ops.pagedserve.bf16_linear(x[i : i + 4], tiled, 200, isa) for i in (0, 4, 8, 12)
    ]
    assert torch.equal(together[:16], torch.cat(in_fours))
    # The last row is a 1-row pass of its own below 16 rows, which alternates two sums.
    assert_rounded_reference(together[16:], reference(x[16:], weight))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [3, 16])
def test_infinities_and_nans_round_as_the_portable_loop(isa: str, m: int) -> None:
    """A row of x with an infinity gives +-inf where the portable loop does, a row of NaN
    gives bfloat16's NaN (0x7fc0, c10's), bit for bit, in whole tiles and the partial last
    one (N = 40), through the few-row and the panel paths."""
    g = torch.Generator().manual_seed(m)
    weight = torch.randn(40, 64, generator=g).bfloat16()
    x = torch.randn(m, 64, generator=g).bfloat16()
    x[0, 5] = float("inf")
    x[1] = float("nan")
    tiled = tile_bf16_weight(weight)
    fast = torch.ops.pagedserve.bf16_linear(x, tiled, 40, isa)
    slow = torch.ops.pagedserve.bf16_linear(x, tiled, 40, "portable")
    assert fast[0].isinf().all() and (fast[1].view(torch.int16) == 0x7FC0).all()
    assert torch.equal(fast[:2].view(torch.int16), slow[:2].view(torch.int16))
    assert_rounded_reference(fast[2:], reference(x[2:], weight))


def test_tiles_pad_rows_and_keep_every_weight() -> None:
    weight = torch.arange(20 * 6, dtype=torch.float32).view(20, 6).bfloat16()
    tiled = tile_bf16_weight(weight)
    assert tiled.shape == (2, 3, 16, 2)
    assert torch.equal(tiled[1, :, 4:].float(), torch.zeros(3, 12, 2))  # rows 20..31
    for n, k in [(0, 0), (5, 3), (17, 4), (19, 5)]:
        assert tiled[n // 16, k // 2, n % 16, k % 2] == weight[n, k]


def test_bad_shapes_are_refused() -> None:
    tiled = tile_bf16_weight(torch.randn(32, 8).bfloat16())
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.pagedserve.bf16_linear(torch.randn(1, 6).bfloat16(), tiled, 32)
    with pytest.raises(RuntimeError, match="does not fit"):
        torch.ops.pagedserve.bf16_linear(torch.randn(1, 8).bfloat16(), tiled, 33)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.pagedserve.bf16_linear(torch.randn(1, 8), tiled, 32)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    ("n", "k", "m"),
    [(37, 64, 1), (50, 30, 3), (33, 128, 9), (200, 64, 20),
     (32768, 32, 64), (32784, 64, 70), (32775, 32, 70)],
)  # fmt: skip
def test_float32_output_is_the_bfloat16_output_widened(isa: str, n: int, k: int, m: int) -> None:
    """out_dtype=float32 (the LM head's logits) gives exactly .float() of the bfloat16 result,
    in every instruction set, including a tile cut short by N and a last pass of rows; and
    where the output is large enough (8 MiB) to go straight to memory, with N in whole
    tiles or not (the last tile then stored as before)."""
    g = torch.Generator().manual_seed(n + k + m)
    tiled = tile_bf16_weight(torch.randn(n, k, generator=g).bfloat16())
    x = torch.randn(m, k, generator=g).bfloat16()
    wide = torch.ops.pagedserve.bf16_linear(x, tiled, n, isa, out_dtype=torch.float32)
    assert wide.dtype == torch.float32 and wide.shape == (m, n)
    assert torch.equal(wide, torch.ops.pagedserve.bf16_linear(x, tiled, n, isa).float())


def test_large_outputs_and_other_dtypes() -> None:
    """An output large enough to ask for huge pages (32 MB and up) holds the right numbers in
    either dtype; an output dtype other than bfloat16 or float32 is refused."""
    g = torch.Generator().manual_seed(3)
    n, k = 33000, 32
    weight = torch.randn(n, k, generator=g).bfloat16()
    tiled = tile_bf16_weight(weight)
    x = torch.randn(520, k, generator=g).bfloat16()
    narrow = torch.ops.pagedserve.bf16_linear(x, tiled, n)
    wide = torch.ops.pagedserve.bf16_linear(x, tiled, n, out_dtype=torch.float32)
    assert wide.numel() * wide.element_size() >= narrow.numel() * narrow.element_size() >= 32 << 20
    assert torch.equal(wide, narrow.float())
    rows = [0, 255, 256, 519]
    assert_rounded_reference(narrow[rows], reference(x[rows], weight))
    with pytest.raises(RuntimeError, match="out_dtype must be"):
        torch.ops.pagedserve.bf16_linear(x, tiled, n, out_dtype=torch.float16)


def test_special_values_round_like_torch() -> None:
    """Rounding to bfloat16 is nearest-even as torch's; infinities and NaN pass through."""
    weight = torch.zeros(16, 2).bfloat16()
    weight[0, 0], weight[1, 0], weight[2, 0], weight[3, 0] = 1, -1, 1, 1
    x = torch.tensor([[float("inf"), 0.0]]).bfloat16()
    y = torch.ops.pagedserve.bf16_linear(x, tile_bf16_weight(weight), 16)
    assert y[0, 0] == float("inf") and y[0, 1] == float("-inf")
    x = torch.tensor([[float("nan"), 0.0]]).bfloat16()
    assert torch.ops.pagedserve.bf16_linear(x, tile_bf16_weight(weight), 16)[0, :4].isnan().all()
    # 1 + 2^-8 is a tie between bfloat16 neighbours 1 and 1 + 2^-7: even wins (1).
    weight = torch.zeros(16, 2).bfloat16()
    weight[0] = torch.tensor([1.0, 2**-8])
    y = torch.ops.pagedserve.bf16_linear(torch.ones(1, 2).bfloat16(), tile_bf16_weight(weight), 16)
    assert y[0, 0].item() == torch.tensor(1 + 2**-8).bfloat16().item() == 1.0


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_a_bf16_layer_runs_on_tiles_where_the_cpu_has_a_tile_kernel(rows: int) -> None:
    torch.manual_seed(rows)
    layer = Linear(96, 160, bias=True)
    layer.weight.data.normal_()  # type: ignore[union-attr]
    layer.bias.data.normal_()  # type: ignore[union-attr]
    layer = layer.to(torch.bfloat16)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()  # type: ignore[union-attr]
    tiles = native_kernels().isa in TILED_BF16_ISAS
    assert bf16_tileable(weight) == tiles
    layer.pack()
    x = torch.randn(2, rows, 96, dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == (2, rows, 160)
    torch.testing.assert_close(y, F.linear(x, weight, bias), rtol=2**-7, atol=2e-2)
    if tiles:
        assert layer.tiled is not None and layer.packed is None and layer.weight is None
        assert torch.equal(y, tiled_linear(x, layer.tiled, 160) + bias)
    else:  # oneDNN's packed copy, or the plain weight where oneDNN cannot pack it
        assert layer.tiled is None


def test_other_weights_are_not_tiled() -> None:
    assert not bf16_tileable(torch.empty(4, 8))  # float32: MKL keeps Hugging Face's numerics
    assert not bf16_tileable(torch.empty(4, 7, dtype=torch.bfloat16))  # odd K
    assert not bf16_tileable(torch.empty(4, 8, dtype=torch.float16))
