"""Quantized linear layers against their dequantized dense reference (float64), for every
format and the step shapes the engine runs: M = 1 (decode), 7, 64 and 513 (prefill)."""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch

from engine.models.quantized import (
    MAX_KERNEL_ROWS,
    QuantizedWeight,
    TiledWeight,
    dequantize,
    dequantize_reference,
    from_gguf,
    pack_nibbles,
    pack_tiles,
    quantize_int4,
    quantize_int8,
    quantized_linear,
    unpack_nibbles,
)
from engine.ops.loader import native_kernels
from tests.isas import isa_params
from tests.threads import torch_threads

N, K = 200, 576  # N is not a multiple of the 16-row tile: the padding is exercised too
FORMATS = ("int8", "int4-g32", "int4-g64", "Q4_0", "Q4_1", "Q8_0")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 4e-3}  # of the output's max magnitude


# Every instruction set of the native kernels built (those this CPU lacks are skipped, and
# say so): each has its own quantized path (bfloat16 dot products, float32 AVX-512, portable
# loops).
ISAS = isa_params()


@pytest.fixture(scope="module", autouse=True)
def _native() -> None:
    assert native_kernels().available, "the native CPU kernels must load for these tests"


@functools.cache
def make_weight(fmt: str, n: int = N, k: int = K, seed: int = 0) -> QuantizedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    if fmt == "int8":
        return quantize_int8(w)
    if fmt.startswith("int4"):
        return quantize_int4(w, int(fmt.split("-g")[1]))
    qtype = getattr(gguf.GGMLQuantizationType, fmt)
    return from_gguf(fmt, gguf.quants.quantize(w.numpy(), qtype), (n, k))


def kernel(isa: str, x: torch.Tensor, w: TiledWeight) -> torch.Tensor:
    return torch.ops.pagedserve.quant_linear(x, *w.kernel_args(), isa=isa)


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return float((y.double() - reference).abs().max() / reference.abs().max())


# The vector kernels at every step shape; the portable loops (also what the AVX2 set runs)
# on decode-sized ones, where they are fast enough to test.
KERNEL_CASES = [
    pytest.param(isa.values[0], m, id=f"{isa.id}-{m}", marks=isa.marks)
    for isa in ISAS
    for m in ((1, 7, 64, 513) if str(isa.id).startswith("avx512") else (1, 7, 64))
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("isa", "m"), KERNEL_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_matches_the_dequantized_reference(
    fmt: str, isa: str, m: int, dtype: torch.dtype
) -> None:
    weight = make_weight(fmt)
    dense = dequantize_reference(weight).double()
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(dtype)
    y = kernel(isa, x, pack_tiles(weight))
    reference = x.double() @ dense.T
    error = relative_error(y, reference)
    print(f"{fmt} M={m} {dtype} {isa}: max error {error:.2e} of max |y|")
    assert y.shape == (m, N) and y.dtype == dtype
    assert error < TOLERANCE[dtype]


@pytest.mark.parametrize("fmt", ["int8", "Q4_1", "int4-g64"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 3, 9])
def test_float32_output_is_the_bfloat16_output_widened(fmt: str, isa: str, m: int) -> None:
    """out_dtype=float32 for bfloat16 rows (an LM head's logits) gives exactly .float() of
    the bfloat16 result, in every instruction set; float32 rows keep float32, and any other
    output dtype is refused."""
    tiled = pack_tiles(make_weight(fmt))
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).bfloat16()
    op = torch.ops.pagedserve.quant_linear
    wide = op(x, *tiled.kernel_args(), isa=isa, out_dtype=torch.float32)
    assert wide.dtype == torch.float32
    assert torch.equal(wide, kernel(isa, x, tiled).float())
    x32 = x.float()
    assert torch.equal(
        op(x32, *tiled.kernel_args(), isa=isa, out_dtype=torch.float32), kernel(isa, x32, tiled)
    )
    with pytest.raises(RuntimeError, match="out_dtype must be"):
        op(x32, *tiled.kernel_args(), isa=isa, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("fmt", ["int8", "Q4_1"])
@pytest.mark.parametrize("m", [1, 64])
def test_any_thread_count_gives_the_same_bits(fmt: str, m: int) -> None:
    """As for the bfloat16 kernel: the threads claim runs of tiles (parallel.h), each tile
    is computed once with the same arithmetic, so 1, 2 or 3 threads give the same bits."""
    weight = make_weight(fmt, n=1536)
    tiled = pack_tiles(weight)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).bfloat16()
    outputs = []
    for n in (1, 2, 3):
        with torch_threads(n):
            outputs.append(torch.ops.pagedserve.quant_linear(x, *tiled.kernel_args()))
    reference = x.double() @ dequantize_reference(weight).double().T
    assert relative_error(outputs[0], reference) < TOLERANCE[torch.bfloat16]
    for y in outputs[1:]:
        assert torch.equal(y, outputs[0])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("isa", ISAS)
def test_bf16_rows_of_any_scale_keep_their_own_precision(fmt: str, isa: str) -> None:
    """bfloat16 input goes through int16 with a scale per block of 32 on some paths (AVX2's
    integer path): rows 2^40 apart, and blocks within a row alternating 2^20 apart, must each
    come out as accurate as a row of ordinary numbers, relative to their own magnitude."""
    weight = make_weight(fmt)
    dense = dequantize_reference(weight).double()
    g = torch.Generator().manual_seed(5)
    block_scale = 2.0 ** (20 * (torch.arange(K) // 32 % 2))  # 1, 2^20, 1, 2^20, ...
    row_scale = torch.tensor([[2.0**-20], [1.0], [2.0**20]])
    x = (torch.randn(3, K, generator=g) * block_scale * row_scale).bfloat16()
    y = kernel(isa, x, pack_tiles(weight)).double()
    reference = x.double() @ dense.T
    for r in range(3):
        error = float((y[r] - reference[r]).abs().max() / reference[r].abs().max())
        assert error < TOLERANCE[torch.bfloat16], (r, error)


def extreme_int4(n: int = 48, k: int = K) -> QuantizedWeight:
    """4-bit weights whose integers are all 15, the largest, but for a random few: with rows
    of x at int16's limits, each block's sums reach their largest."""
    g = torch.Generator().manual_seed(11)
    q = torch.full((n, k), 15, dtype=torch.uint8)
    few = torch.rand(n, k, generator=g) < 0.1
    q[few] = torch.randint(0, 16, (int(few.sum()),), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // 32, generator=g) + 0.5).half()
    mins = -(torch.rand(n, k // 32, generator=g) * 8).half()
    return QuantizedWeight(pack_nibbles(q), scales, mins, 4, 32)


# The sets whose arithmetic for a row does not depend on the rows beside it (the AVX-512
# sets keep more partial sums for fewer rows, kPartials in quant_kernels.cpp).
ROW_EXACT_ISAS = [p for p in ISAS if p.id in ("avx2", "portable")]


@pytest.mark.parametrize("fmt", ["int4-g32", "int4-g64", "Q4_0", "Q4_1", "extreme"])
@pytest.mark.parametrize("isa", ROW_EXACT_ISAS)
def test_bf16_rows_give_the_same_bits_alone_in_pairs_and_in_a_batch(fmt: str, isa: str) -> None:
    """The AVX2 set's 4-bit integer path for one row (quant_avx2.h, tile_int4_one_row_avx2:
    three sums of scaled pairs) gets the same integer per block as its path for more rows,
    so a row's output has the same bits whatever its batch (as the portable loops' do); and
    the sums stay within int32 at the extremes (every integer 15, every x at int16's
    limit)."""
    weight = extreme_int4() if fmt == "extreme" else make_weight(fmt)
    tiled = pack_tiles(weight)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(8, K, generator=g)
    # Every element of these two rows becomes +-32640 (int16's largest a bfloat16 reaches:
    # a block's scale is a power of two, and 255/256 is bfloat16's largest below one).
    x[6] = 255 / 256
    x[7] = torch.where(torch.rand(K, generator=g) < 0.5, -1.0, 1.0) * 255 / 256 * 2.0**-30
    x = x.bfloat16()
    batch = kernel(isa, x, tiled)  # eight rows at once
    for r in range(8):
        assert torch.equal(kernel(isa, x[r : r + 1], tiled), batch[r : r + 1]), r
    for r in range(0, 8, 2):
        assert torch.equal(kernel(isa, x[r : r + 2], tiled), batch[r : r + 2]), r
    reference = x.double() @ dequantize_reference(weight).double().T
    for r in range(8):
        error = float((batch[r] - reference[r]).abs().max() / reference[r].abs().max())
        assert error < TOLERANCE[torch.bfloat16], (r, error)


@pytest.mark.parametrize("fmt", ["int8", "Q4_1"])
@pytest.mark.parametrize("isa", ISAS)
def test_bf16_rows_keep_zeros_infinities_and_nan_to_themselves(fmt: str, isa: str) -> None:
    """A row of zeros gives zeros, a row holding an infinity or NaN gives non-finite outputs,
    and neither touches the other rows."""
    weight = make_weight(fmt)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(6)).bfloat16()
    x[0] = 0
    x[1, 40] = float("inf")
    x[2, 300] = float("nan")
    y = kernel(isa, x, pack_tiles(weight))
    assert torch.equal(y[0], torch.zeros(N, dtype=torch.bfloat16))
    assert not y[1].isfinite().all() and not y[2].isfinite().all()
    reference = x[3:].double() @ dequantize_reference(weight).double().T
    assert relative_error(y[3:], reference) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("fmt", FORMATS)
def test_layer_picks_kernel_or_dense_path_with_the_same_result(fmt: str) -> None:
    weight = pack_tiles(make_weight(fmt))
    bias = torch.randn(N)
    for m in (1, MAX_KERNEL_ROWS, MAX_KERNEL_ROWS + 1, 100):
        x = torch.randn(3, m, K)  # leading dimensions are kept
        y = quantized_linear(x, weight, bias)
        reference = x.double() @ dequantize(weight, torch.float64).T + bias.double()
        assert y.shape == (3, m, N)
        assert relative_error(y, reference) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_repack_exactly(fmt: str) -> None:
    """Our dequantization of a GGUF tensor, before and after tiling, is gguf's own, bit for
    bit: the repack moves integers and float16 scales, nothing is rounded."""
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(1)).numpy()
    qtype = getattr(gguf.GGMLQuantizationType, fmt)
    raw = gguf.quants.quantize(w, qtype)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    weight = from_gguf(fmt, raw, (64, 96))
    assert torch.equal(dequantize_reference(weight), expected)
    assert torch.equal(dequantize(pack_tiles(weight), torch.float32), expected)


def test_int4_tiles_hold_each_rows_octet_in_one_word() -> None:
    """The 4-bit tile layout the kernels read (quant_kernels.cpp): row i's 8 integers of an
    octet in one little-endian 32-bit word, k = 8 octet + 2 s + parity at bits 4 s + 16
    parity, so that (word >> 4 s) & 0x000F000F is the pair (q[k], q[k + 1])."""
    weight = make_weight("Q4_1")
    q = unpack_nibbles(weight.qweight).long()
    tiled = pack_tiles(weight)
    words = tiled.qweight.view(-1, K // 32, 4, 16, 4).long()
    words = words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24
    for n, k in [(0, 0), (0, 7), (5, 9), (15, 31), (16, 34), (199, 575), (123, 300)]:
        j = k % 8
        word = words[n // 16, k // 32, k % 32 // 8, n % 16]
        assert (word >> (4 * (j // 2) + 16 * (j % 2))) & 0x0F == q[n, k]


@pytest.mark.parametrize("fmt", FORMATS)
def test_row_lookup_dequantizes_exactly(fmt: str) -> None:
    weight = make_weight(fmt)
    rows = torch.tensor([0, 199, 17, 17, 128])
    looked_up = dequantize(pack_tiles(weight), torch.float32, rows)
    assert torch.equal(looked_up, dequantize_reference(weight)[rows])
    with pytest.raises(RuntimeError, match="out of range"):
        dequantize(pack_tiles(weight), torch.float32, torch.tensor([N]))


def test_quantizers_stay_within_half_a_step() -> None:
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(2))
    for group in (32, 64):
        q = quantize_int4(w, group)
        step = q.scales.float().repeat_interleave(group, dim=1)
        assert ((dequantize_reference(q) - w).abs() <= step / 2 + 1e-6).all()
    q8 = quantize_int8(w)
    assert ((dequantize_reference(q8) - w).abs() <= q8.scales.float() / 2 + 1e-6).all()
    q8 = quantize_int8(w, 32)
    step = q8.scales.float().repeat_interleave(32, dim=1)
    assert ((dequantize_reference(q8) - w).abs() <= step / 2 + 1e-6).all()


def test_int8_in_groups_of_32_is_gguf_q8_0() -> None:
    """int8 in groups of 32 (the LM head's) is Q8_0's format, whose kernels the tests above
    check: gguf's own quantizer gives the same scales, and the same values but where it
    rounds x / d with d before its float16 rounding and we with the d that is stored."""
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(3))
    ours = quantize_int8(w, 32)
    raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
    theirs = from_gguf("Q8_0", raw, (48, 128))
    assert ours.group_size == theirs.group_size == 32 and ours.bits == theirs.bits == 8
    assert torch.equal(ours.scales, theirs.scales)
    differ = ours.qweight != theirs.qweight
    assert differ.float().mean() < 0.01
    assert (ours.qweight.int() - theirs.qweight.int()).abs().max() <= 1
    with pytest.raises(ValueError, match="does not split into int8 groups of 48"):
        quantize_int8(w, 48)


def test_nibbles_round_trip_in_gguf_order() -> None:
    q = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = pack_nibbles(q)
    assert torch.equal(unpack_nibbles(packed), q)
    # Byte j of a block: weight j low, weight j + 16 high.
    assert int(packed[0, 1]) == int(q[0, 1]) | int(q[0, 17]) << 4


def test_fused_layers_concatenate_rows_and_rows_reorder() -> None:
    a, b = make_weight("Q4_1", 32, 64, 1), make_weight("Q4_1", 48, 64, 2)
    fused = QuantizedWeight.cat([a, b])
    expected = torch.cat([dequantize_reference(a), dequantize_reference(b)])
    assert torch.equal(dequantize_reference(fused), expected)
    order = np.arange(80)[::-1].copy()
    assert torch.equal(dequantize_reference(fused.rows(order)), expected[order.tolist()])
    with pytest.raises(ValueError, match="share K"):
        QuantizedWeight.cat([a, make_weight("Q8_0", 32, 64)])
