"""This machine's limits, measured the way the engine meets them (not a test).

    python benchmarks/hardware_limits.py [--json out.json]

- read bandwidth: torch's multi-threaded sum over a buffer far larger than the caches, the
  memory-bound floor of a decode step (bytes of weights read per token / bandwidth);
- matmul throughput: bf16 as the engine runs it (its own tile kernel where that runs, else
  oneDNN pre-packed) and float32 GEMMs at the shapes of a decode step, a prefill step and a
  large square, on 1 thread and on all. A compute floor takes the fastest of them.
Each figure is the best of several repetitions: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

SHAPES = {  # (M, K, N): rows of activations, input and output features
    "decode 64x576x1536": (64, 576, 1536),
    "prefill 512x576x1536": (512, 576, 1536),
    "square 2048": (2048, 2048, 2048),
}


def best_of(fn: Callable[[], object], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth(gib: float, reps: int) -> float:
    """GB/s of a sum over `gib` GiB of float32 (every byte read once)."""
    buffer = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    seconds = best_of(lambda: buffer.sum(), reps)
    return buffer.numel() * 4 / seconds / 1e9


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, reps: int) -> float:
    from engine.models.layers import (
        bf16_tileable,
        onednn_packable,
        pack_linear_weight,
        packed_linear,
        tile_bf16_weight,
        tiled_linear,
    )

    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    if bf16_tileable(w):
        tiled = tile_bf16_weight(w)
        seconds = best_of(lambda: tiled_linear(x, tiled, n), reps)
    elif onednn_packable(w):
        packed = pack_linear_weight(w)
        seconds = best_of(lambda: packed_linear(x, packed, None), reps)
    else:
        seconds = best_of(lambda: torch.nn.functional.linear(x, w), reps)
    return 2 * m * k * n / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0, help="bandwidth buffer size")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    cpus = len(os.sched_getaffinity(0))
    report: dict[str, object] = {"cpus": cpus, "torch": torch.__version__}
    for threads in sorted({1, cpus}):
        torch.set_num_threads(threads)
        entry: dict[str, float] = {"read_GB_per_s": read_bandwidth(args.gib, args.reps)}
        for name, (m, k, n) in SHAPES.items():
            for dtype in (torch.bfloat16, torch.float32):
                label = f"{name} {str(dtype).removeprefix('torch.')} GFLOP/s"
                entry[label] = matmul_gflops(m, k, n, dtype, args.reps)
        report[f"{threads} threads"] = entry
        for key, value in entry.items():
            print(f"{threads} thread(s)  {key:45s} {value:8.1f}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
