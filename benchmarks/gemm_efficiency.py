"""Every GEMM the engine runs for a model, as a share of this CPU's arithmetic peak (not a
test; issue 40).

    python benchmarks/gemm_efficiency.py [--model DIR] [--quantization none|gguf] \\
        [--rows 64,128,512] [--json out.json]

Loads the model as the server would on this CPU (its dtype; with --quantization gguf the
quantized layers run on their dense copies for steps of more than 4 rows, as by default)
and times each distinct linear layer's forward (the kernel the native decoder op runs too),
and the LM head's, at each row count, on every CPU this process may use. The peak is
benchmarks/isa_peak.py's, measured in the same run: the float32 FMA rate on an AVX2-only
CPU or for float32 weights, vdpbf16ps's for bfloat16 weights where the CPU has it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import isa_peak
from hardware_limits import best_of

from engine.config import QuantConfig
from engine.models.default_model import prepare_default_model
from engine.models.layers import Linear
from engine.models.loader import load_model
from engine.worker.worker import resolve_dtype


def peak_gflops(dtype: torch.dtype, threads: int) -> tuple[str, float]:
    """(the instruction, its GFLOP/s on `threads` threads) that bounds a GEMM in `dtype`."""
    flags = isa_peak.cpu_flags()
    names = [
        n for n in ("dpbf16_avx512", "fma_avx512", "fma_avx2") if isa_peak.KERNELS[n][0] <= flags
    ]
    if dtype != torch.bfloat16:
        names = [n for n in names if n.startswith("fma")]
    name = names[0]
    with tempfile.TemporaryDirectory() as tmp:
        library = isa_peak.build([name], Path(tmp))
        fn = getattr(library, f"run_{name}")
        return name, isa_peak.measure(fn, isa_peak.KERNELS[name][5], threads, 0.5)


def timed(fn: Callable[[], object], args: argparse.Namespace) -> float:
    """The best of at least args.reps calls that together take at least args.seconds. A few
    calls of a small GEMM last a millisecond, and the first shapes timed after the peak's
    measurement came out at half their rate in one run of ten calls and at 80-90% in the
    next: a window that short catches the VM's own pauses."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    return best_of(fn, max(args.reps, math.ceil(args.seconds / max(first, 1e-6))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the bundled model")
    parser.add_argument("--quantization", default="none", choices=("none", "gguf"))
    parser.add_argument("--rows", default="64,128,512")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument(
        "--seconds", type=float, default=0.3, help="time each GEMM for at least this long"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    model_dir = args.model or prepare_default_model()
    dtype = resolve_dtype("auto", torch.device("cpu"))
    quant = QuantConfig(args.quantization, dense_copy=args.quantization != "none")
    model, _ = load_model(model_dir, dtype, "cpu", quant)
    layers: dict[tuple[int, int], Linear] = {}
    for module in model.modules():
        if isinstance(module, Linear):
            layers.setdefault((module.in_features, module.out_features), module)
    peak_name, peak = peak_gflops(dtype, threads)
    print(f"{model_dir.name}, {dtype}, {args.quantization}, {threads} threads; "
          f"peak {peak_name} {peak:.1f} GFLOP/s")  # fmt: skip
    report: dict[str, object] = {"peak": {peak_name: peak}, "threads": threads, "gemms": []}
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            shapes = {**{f"linear {k}->{n}": (k, n) for k, n in layers}, "lm_head": None}
            for label, shape in shapes.items():
                if shape is None:
                    k, n = model.arch.hidden_size, model.arch.vocab_size
                    x = torch.randn(rows, k).to(dtype)
                    seconds = timed(lambda x=x: model.compute_logits(x), args)
                else:
                    k, n = shape
                    x = torch.randn(rows, k).to(dtype)
                    layer = layers[shape]
                    seconds = timed(lambda x=x, layer=layer: layer(x), args)
                gflops = 2 * rows * k * n / seconds / 1e9
                share = gflops / peak
                print(f"{rows:5d} rows  {label:24s} {gflops:7.1f} GFLOP/s  {share:5.0%} of peak")
                report["gemms"].append(  # type: ignore[union-attr]
                    {"rows": rows, "gemm": label, "gflops": gflops, "share_of_peak": share}
                )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
