"""bfloat16 linear layers two ways, by step size: pagedserve's dot-product kernel on tiled
weights (engine/ops/csrc/bf16_linear_kernels.cpp) and oneDNN's pre-packed GEMM (not a test).

    python benchmarks/bf16_linear.py [--threads 2] [--rows 1 2 4 8 16 64 512]

The weights are a whole model's linear layers (SmolLM2-135M's 30 layers: qkv 960x576,
o 576x576, gate_up 3072x576, down 576x1536; 213 MB in bfloat16), run in order as a step
does, so they stream from memory rather than sit in the caches. Each figure is the best of
several passes (the machine is shared): milliseconds per pass, the weights' read rate and
the arithmetic rate. This is what decides which kernel a bf16 model's layers run on
(layers.bf16_tileable).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.models.layers import (
    onednn_packable,
    pack_linear_weight,
    packed_linear,
    tile_bf16_weight,
)
from engine.ops import native_ops
from engine.ops.loader import native_kernels

sys.path.insert(0, str(Path(__file__).parent))
from hardware_limits import best_of

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 512])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if native_kernels().isa is None:
        raise SystemExit("the native kernels are unavailable")
    g = torch.Generator().manual_seed(0)
    # Where oneDNN cannot pack bfloat16 (AVX2 CPUs), the other column is torch's plain
    # bfloat16 matmul, which is what a bf16 layer ran on there before the AVX2 tile kernel.
    packable = onednn_packable(torch.empty(16, 16, dtype=torch.bfloat16))
    other = "oneDNN" if packable else "torch mm"
    layers = []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            w = torch.randn(n, k, generator=g).bfloat16()
            layers.append((n, k, tile_bf16_weight(w), pack_linear_weight(w) if packable else w))
    weight_bytes = sum(n * k * 2 for n, k, _, _ in layers)
    print(
        f"threads {torch.get_num_threads()}, kernels {native_kernels().isa}, "
        f"weights {weight_bytes / 1e6:.0f} MB"
    )
    print(f"{'rows':>5s} | {'tiled ms':>8s} {'GB/s':>6s} {'GFLOP/s':>8s} | "
          f"{other + ' ms':>9s} {'GB/s':>6s} {'GFLOP/s':>8s} | tiled speed-up")  # fmt: skip
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=g).bfloat16() for k in {k for _, k in SHAPES}}

        def tiled(xs: dict[int, torch.Tensor] = xs) -> None:
            for n, k, t, _ in layers:
                native_ops.bf16_linear(xs[k], t, n)

        def onednn(xs: dict[int, torch.Tensor] = xs) -> None:
            for _, k, _, packed in layers:
                if packable:
                    packed_linear(xs[k], packed, None)
                else:
                    F.linear(xs[k], packed)

        reps = args.reps if rows < 64 else max(2, args.reps // 2)
        times = [best_of(fn, reps) for fn in (tiled, onednn)]
        cells = [
            f"{s * 1e3:8.2f} {weight_bytes / s / 1e9:6.1f} {rows * weight_bytes / s / 1e9:8.1f}"
            for s in times
        ]
        print(f"{rows:5d} | {cells[0]} | {cells[1]:>25s} | {times[1] / times[0]:.2f}x")


if __name__ == "__main__":
    main()
