"""The small ops a single-stream decode step runs from Python, warm and after a stream of
weights has gone through the caches, as one does in every step. Not a test.

    python benchmarks/cold_host_ops.py [--quantization auto] [--sweep-mb 8 96] [--json out.json]

A decode step of the default model reads about 96 MB of weights (Q4_1 layers and the Q8_0
head), more than the last-level cache holds, so each step's host work (the embedding, the
rotary tables, the final norm, the step's metadata, sampling) meets caches that hold the
weights instead of the interpreter's and torch's own code and data. Each op is timed
back to back (warm), and each call just after one thread has read `--sweep-mb` MB (one
column each: a sweep that fits the last-level cache, and one that does not); medians of
`--calls` calls. The in-step figures lie in between: decode_breakdown.py's "rest".
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from engine import LLM
from engine.attention.metadata import build_step_metadata
from engine.models.default_model import prepare_default_model


def median_us(fn: Callable[[], object], calls: int, before: Callable[[], object] | None) -> float:
    fn()
    times = []
    for _ in range(calls):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the bundled model")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--sweep-mb", type=float, nargs="+", default=[8.0, 96.0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    llm = LLM(model=args.model or str(prepare_default_model()), quantization=args.quantization)
    model = llm.core.runner.model
    block_size = llm.config.cache.block_size
    dtype = model.norm.weight.dtype
    hidden = model.norm.weight.shape[0]
    ids, positions = torch.tensor([123]), torch.tensor([300])
    x, residual = torch.randn(1, hidden).to(dtype), torch.randn(1, hidden).to(dtype)
    computed, new, tables = np.array([300]), np.array([1]), [list(range(300 // block_size + 1))]
    ops: dict[str, Callable[[], object]] = {
        "embed (1 token)": lambda: model.embed(ids),
        "rotary (1 position)": lambda: model.rotary(positions, dtype),
        "final add + RMSNorm": lambda: model.norm.add_forward(x, residual),
        "step metadata": lambda: build_step_metadata(computed, new, tables, block_size),
    }
    sweeps = {mb: np.ones(int(mb * 1e6) // 4, dtype=np.float32) for mb in args.sweep_mb}
    print(f"{torch.get_num_threads()} threads; medians of {args.calls} calls, microseconds")
    print(f"{'op':24s} {'warm':>8s}" + "".join(f" {f'after {mb:g} MB':>14s}" for mb in sweeps))
    results = {}
    for name, fn in ops.items():
        warm = median_us(fn, args.calls, None)
        cold = {mb: median_us(fn, args.calls, sweep.sum) for mb, sweep in sweeps.items()}
        results[name] = {"warm_us": warm, "after_sweep_us": cold}
        cells = "".join(f" {us:8.1f} ({us / warm:3.1f}x)" for us in cold.values())
        print(f"{name:24s} {warm:8.1f}{cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sweep_mb": args.sweep_mb, "ops": results}, f, indent=2)


if __name__ == "__main__":
    main()
