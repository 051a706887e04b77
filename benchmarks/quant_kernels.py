"""A quantized linear layer's three ways to run, by step size: the quantized kernel, dequantizing
on every call then a dense GEMM, and a dense copy made once (laid out for the bf16 kernel
where the CPU has AVX512-BF16, else oneDNN-packed: as the model holds it).

    python benchmarks/quant_kernels.py [--threads 2] [--rows 1 2 4 8 16 64 512]

Shapes are the default model's (SmolLM2-135M) linear layers: qkv (960x576), o (576x576),
gate_up (3072x576), down (576x1536), as int4 groups of 32 (the Q4_1 layout). The weights
stay in the CPU's caches here, unlike in a whole model's step, so the dense copy looks better
at one row than it is; this shows where the lines cross for many rows, which is what picks
DENSE_COPY_ROWS. Then the one-row int4 kernel's arithmetic rate on one thread, its weights in
the caches and the cost of a call subtracted (what it can do where memory is no limit), then
the quantized kernel alone over 30 layers in a step's order, streamed from memory as in decode
(rows up to 16), and over the default model's Q8_0 LM head, streamed.
Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.models.layers import (
    bf16_tileable,
    pack_linear_weight,
    packed_linear,
    tile_bf16_weight,
    tiled_linear,
)
from engine.models.quantized import (
    TiledWeight,
    dequantize,
    pack_tiles,
    quantize_int4,
    quantize_int8,
)
from engine.ops import native_ops

sys.path.insert(0, str(Path(__file__).parent))
from hardware_limits import best_of

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def mean_us(fn: Callable[[], object], reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def dense_copy(weight: torch.Tensor) -> Callable[[torch.Tensor], object]:
    """The dense copy's layout and kernel, as layers.Linear.pack picks them."""
    if bf16_tileable(weight):
        tiles, n = tile_bf16_weight(weight), weight.shape[0]
        return lambda x: tiled_linear(x, tiles, n)
    packed = pack_linear_weight(weight)
    return lambda x: packed_linear(x, packed, None)


def ways(
    x: torch.Tensor, tiled: TiledWeight, copy: Callable[[torch.Tensor], object]
) -> list[Callable[[], object]]:
    return [
        lambda: native_ops.quant_linear(x, tiled.kernel_args()),
        lambda: F.linear(x, dequantize(tiled, x.dtype)),
        lambda: copy(x),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 512])
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}; microseconds per call")
    print(f"{'layer':8s} {'rows':>5s} {'quantized':>10s} {'dequant+gemm':>13s} {'dense copy':>11s}")
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
        tiled = pack_tiles(quantize_int4(weight, 32))
        copy = dense_copy(dequantize(tiled, torch.bfloat16))
        for rows in args.rows:
            x = torch.randn(rows, k).to(torch.bfloat16)
            times = [mean_us(fn, args.reps) for fn in ways(x, tiled, copy)]
            print(f"{name:8s} {rows:5d} {times[0]:10.1f} {times[1]:13.1f} {times[2]:11.1f}")
    compute_rate(args.reps * 20)
    stream(args.rows)


def compute_rate(reps: int) -> None:
    """The one-row int4 kernel on one thread, each shape's weights read again and again (so
    from the caches), less a one-tile call's time (the dispatch from Python and the op's
    setup): its arithmetic rate, and the weight stream that rate consumes. Where that stream
    is below what memory gives one thread (hardware_limits.py), a thread's share of a
    decode step's linears is bound by its arithmetic, not by memory."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(2)

    def per_call_us(n: int, k: int) -> tuple[float, int]:
        tiled = pack_tiles(quantize_int4(torch.randn(n, k, generator=g), 32))
        x, kernel_args = torch.randn(1, k, generator=g).bfloat16(), tiled.kernel_args()

        def calls() -> None:
            for _ in range(reps):
                native_ops.quant_linear(x, kernel_args)

        return best_of(calls, 5) / reps * 1e6, tiled.nbytes

    try:
        call_us, _ = per_call_us(16, 64)
        print(f"one row, one thread, weights in the caches, less a one-tile call: {call_us:.1f} us")
        for name, (n, k) in SHAPES.items():
            us, nbytes = per_call_us(n, k)
            kernel_us = us - call_us
            print(
                f"{name:8s} {kernel_us:7.1f} us: {n * k / kernel_us / 1e3:5.1f} GMAC/s, "
                f"{nbytes / kernel_us / 1e3:5.1f} GB/s of int4-g32 weights"
            )
    finally:
        torch.set_num_threads(threads)


def stream(row_counts: list[int], layers: int = 30) -> None:
    """The quantized kernel over a whole model's layers in a step's order, so the weights
    stream from memory as in decode (the figures above stay in the caches)."""
    g = torch.Generator().manual_seed(0)
    model = [
        pack_tiles(quantize_int4(torch.randn(n, k, generator=g), 32))
        for _ in range(layers)
        for n, k in SHAPES.values()
    ]
    nbytes = sum(w.nbytes for w in model)
    print(f"{layers} layers streamed ({nbytes / 1e6:.1f} MB of int4-g32), best of 5 passes")
    for rows in (r for r in row_counts if r <= 16):
        xs = {k: torch.randn(rows, k, generator=g).bfloat16() for _, k in SHAPES.values()}

        def one_pass(xs: dict[int, torch.Tensor] = xs) -> None:
            for w in model:
                native_ops.quant_linear(xs[w.shape[1]], w.kernel_args())

        seconds = best_of(one_pass, 5)
        print(f"rows {rows:3d}: {seconds * 1e3:7.2f} ms, {nbytes / seconds / 1e9:5.1f} GB/s")
    stream_head(row_counts)


def stream_head(row_counts: list[int], copies: int = 3) -> None:
    """The default model's LM head as its GGUF file stores it (Q8_0, 49152 x 576), `copies`
    of it in turn so that each call reads its weights from memory, as a decode step does."""
    g = torch.Generator().manual_seed(1)
    head = pack_tiles(quantize_int8(torch.randn(49152, 576, generator=g), 32))
    heads = [
        TiledWeight(head.qweight.clone(), head.scales.clone(), None, 8, 32, head.n)
        for _ in range(copies)
    ]
    nbytes = head.nbytes
    print(f"Q8_0 LM head streamed ({nbytes / 1e6:.1f} MB, {copies} copies in turn), best of 5")
    for rows in (r for r in row_counts if r <= 16):
        x = torch.randn(rows, 576, generator=g).bfloat16()

        def one_pass(x: torch.Tensor = x) -> None:
            for w in heads:
                native_ops.quant_linear(x, w.kernel_args(), torch.float32)

        seconds = best_of(one_pass, 5) / len(heads)
        print(f"rows {rows:3d}: {seconds * 1e3:7.3f} ms, {nbytes / seconds / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
