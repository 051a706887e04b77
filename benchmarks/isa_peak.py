"""The arithmetic peak of this CPU's vector instructions, measured on the instructions
themselves (not a test).

    python benchmarks/isa_peak.py [--seconds 0.5] [--json out.json]

For each instruction this CPU has, a C loop compiled here (the C compiler the native
kernels build with) issues it on 12 independent accumulators, so that neither the
instruction's latency nor a load bounds it, for a fixed time, on 1 thread and on every
CPU this process may use (threads through ctypes, which releases the GIL):

    fma_avx2         vfmadd231ps ymm     8 lanes x 2 flops         float32 FMA (AVX2)
    fma_avx512       vfmadd231ps zmm     16 lanes x 2 flops        float32 FMA (AVX-512)
    dpbf16_avx512    vdpbf16ps zmm       16 lanes x 2 pairs x 2    bfloat16 dot (AVX512_BF16)
    vnni_avx512      vpdpbusd zmm        16 lanes x 4 pairs x 2    int8 dot (AVX512_VNNI)
    vnni_avx         vpdpbusd ymm        8 lanes x 4 pairs x 2     int8 dot (AVX-VNNI)
    madd_avx2        vpmaddwd + vpaddd   8 lanes x 2 pairs x 2     int16 dot (AVX2)
    maddubs_avx2     vpmaddubsw + vpaddw 16 lanes x 2 pairs x 2    uint8 x int8 dot (AVX2)

and prints GFLOP/s (GOP/s for the integer dots). The two AVX2 integer dots are what an
AVX2 CPU has instead of VNNI, each with the add that accumulates its sums: madd_avx2 is
the quantized kernels' integer path on bfloat16 rows (x as int16, quant_avx2.h) and the LM
head's screen; maddubs_avx2 is llama.cpp's for 4- and 8-bit weights against activations
rounded to 8 bits, which pagedserve does not do. Their multiply reads the accumulator (a
product of two loop constants would be hoisted out of the loop), so each accumulator's
chain is a multiply and an add long: 12 of them still keep the multiplier busy.

Issue 40 takes the engine's GEMM peak on an AVX2-only CPU as fma_avx2, on AVX-512 as
fma_avx512 for float32 and dpbf16_avx512 for bfloat16 weights. On a 2-core Zen 3 VM
(2026-11-29): fma_avx2 98.7 GFLOP/s on 1 thread, 194.6 on 2; madd_avx2 78.0 and 151.8;
maddubs_avx2 157.3 and 296.1. So there an int16 path cannot beat float32 FMAs, and only 8-bit
activations could. Run it beside benchmarks/hardware_limits.py on a quiet machine.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

ACCUMULATORS = 12
# name: (cpuinfo flags needed, compiler flags, C vector type, init, the instruction on
# acc[i] with operands a and b, flops per instruction)
KERNELS = {
    "fma_avx2": (
        {"avx2", "fma"},
        ["-mavx2", "-mfma"],
        "__m256",
        "_mm256_set1_ps(1e-7f)",
        "_mm256_fmadd_ps(a, b, acc[{i}])",
        8 * 2,
    ),
    "fma_avx512": (
        {"avx512f"},
        ["-mavx512f"],
        "__m512",
        "_mm512_set1_ps(1e-7f)",
        "_mm512_fmadd_ps(a, b, acc[{i}])",
        16 * 2,
    ),
    "dpbf16_avx512": (
        {"avx512f", "avx512_bf16"},
        ["-mavx512f", "-mavx512bf16"],
        "__m512",
        "_mm512_set1_ps(1e-7f)",
        "_mm512_dpbf16_ps(acc[{i}], (__m512bh)_mm512_castps_si512(a), "
        "(__m512bh)_mm512_castps_si512(b))",
        16 * 2 * 2,
    ),
    "vnni_avx512": (
        {"avx512f", "avx512_vnni"},
        ["-mavx512f", "-mavx512vnni"],
        "__m512i",
        "_mm512_set1_epi32(1)",
        "_mm512_dpbusd_epi32(acc[{i}], a, b)",
        16 * 4 * 2,
    ),
    "vnni_avx": (
        {"avx_vnni"},
        ["-mavx2", "-mavxvnni"],
        "__m256i",
        "_mm256_set1_epi32(1)",
        "_mm256_dpbusd_avx_epi32(acc[{i}], a, b)",
        8 * 4 * 2,
    ),
    "madd_avx2": (
        {"avx2"},
        ["-mavx2"],
        "__m256i",
        "_mm256_set1_epi16(1)",
        "_mm256_add_epi32(acc[{i}], _mm256_madd_epi16(acc[{i}], a))",
        8 * 2 * 2,
    ),
    "maddubs_avx2": (
        {"avx2"},
        ["-mavx2"],
        "__m256i",
        "_mm256_set1_epi8(1)",
        "_mm256_add_epi16(acc[{i}], _mm256_maddubs_epi16(acc[{i}], a))",
        16 * 2 * 2,
    ),
}


def kernel_source(name: str) -> str:
    _, _, vector, init, op, _ = KERNELS[name]
    body = "\n".join(f"        acc[{i}] = {op.format(i=i)};" for i in range(ACCUMULATORS))
    return f"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
/* Issues the instruction {ACCUMULATORS} times per iteration on independent accumulators;
   returns a value that depends on every one, so that none is optimised away. */
double run_{name}(int64_t iterations, double seed) {{
    {vector} acc[{ACCUMULATORS}];
    {vector} a = {init}, b = {init};
    for (int i = 0; i < {ACCUMULATORS}; ++i) acc[i] = {init};
    for (int64_t it = 0; it < iterations; ++it) {{
{body}
        __asm__ volatile("" : "+x"(a));  /* a is opaque: the loop cannot be folded */
    }}
    double sink = seed;
    for (int i = 0; i < {ACCUMULATORS}; ++i) {{
        float first;  /* memcpy: read through a float pointer, an integer vector's
                         stores would not alias it, and the loop would be dropped */
        memcpy(&first, &acc[i], sizeof first);
        sink += first;
    }}
    return sink;
}}
"""


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def build(names: list[str], workdir: Path) -> ctypes.CDLL:
    """One shared library with a run_<name> per kernel, each file with its own -m flags."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("no C compiler (cc or gcc) on PATH")
    objects = []
    for name in names:
        source = workdir / f"{name}.c"
        source.write_text(kernel_source(name))
        obj = workdir / f"{name}.o"
        flags = KERNELS[name][1]
        subprocess.run([compiler, "-O2", "-fPIC", *flags, "-c", str(source), "-o", str(obj)],
                       check=True)  # fmt: skip
        objects.append(str(obj))
    library = workdir / "isa_peak.so"
    subprocess.run([compiler, "-shared", "-o", str(library), *objects], check=True)
    return ctypes.CDLL(str(library))


def measure(fn: ctypes._CFuncPtr, flops: int, threads: int, seconds: float) -> float:
    """GFLOP/s of `threads` threads each running the loop for about `seconds`."""
    fn.argtypes, fn.restype = [ctypes.c_int64, ctypes.c_double], ctypes.c_double
    start = time.perf_counter()
    fn(100_000, 0.0)
    per_iteration = (time.perf_counter() - start) / 100_000
    iterations = max(1, int(seconds / per_iteration))
    best = 0.0
    for _ in range(3):
        workers = [threading.Thread(target=fn, args=(iterations, 0.0)) for _ in range(threads)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        elapsed = time.perf_counter() - start
        best = max(best, threads * iterations * ACCUMULATORS * flops / elapsed / 1e9)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.5, help="per measurement")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    flags = cpu_flags()
    names = [name for name, spec in KERNELS.items() if spec[0] <= flags]
    if not names:
        raise SystemExit("this CPU has none of the instructions measured here")
    cpus = len(os.sched_getaffinity(0))
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        library = build(names, Path(tmp))
        for name in names:
            fn = getattr(library, f"run_{name}")
            flops = KERNELS[name][5]
            results[name] = {
                f"{t} threads": measure(fn, flops, t, args.seconds) for t in sorted({1, cpus})
            }
    missing = [name for name in KERNELS if name not in names]
    for name, figures in results.items():
        shown = ", ".join(f"{v:7.1f} on {k}" for k, v in figures.items())
        print(f"{name:14s} GFLOP/s: {shown}")
    if missing:
        print(f"not on this CPU: {', '.join(missing)}")
    if args.json:
        args.json.write_text(json.dumps({"cpus": cpus, "peaks": results}, indent=2))


if __name__ == "__main__":
    main()
