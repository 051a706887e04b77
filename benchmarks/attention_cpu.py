"""Attention backends on the CPU, one layer call at a time: torch reference vs native kernels.

    python benchmarks/attention_cpu.py --dtype bfloat16 --rounds 10
    python benchmarks/attention_cpu.py --isas      # also each instruction set this CPU runs
    python benchmarks/attention_cpu.py --num-decodes 8 --context 830 --shared-prefix 800

SmolLM2-135M shapes by default (9 query heads, 3 KV heads, head_dim 64, 30 layers). Each
call is the backend's `forward` as the model runs it: write this step's K/V through the
slot mapping, then attend. Calls rotate over all layers of the cache, so K/V come from
memory rather than a warm cache, as in a real step. Prints median times and the ratio;
the backends alternate in short rounds so that background load affects both alike.
Not a test: timings are never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from engine.attention import create_backend
from engine.attention.backend import AttentionBackend, allocate_kv_cache
from engine.attention.metadata import AttentionMetadata, build_attention_metadata
from engine.attention.native_backend import NativeCpuAttentionBackend
from engine.ops.loader import native_kernels

Step = tuple[torch.Tensor, list[tuple[torch.Tensor, ...]], AttentionMetadata]


def make_step(
    args: argparse.Namespace, computed: list[int], new: list[int], shared_prefix: int = 0
) -> Step:
    """A KV cache filled with random history, one step's metadata and its q/k/v per layer.
    The requests' first `shared_prefix` keys are on the same pages."""
    dtype = getattr(torch, args.dtype)
    rng = np.random.default_rng(0)
    pages = [-(-(c + n) // args.block_size) for c, n in zip(computed, new, strict=True)]
    num_blocks = sum(pages)
    kv_cache = allocate_kv_cache(
        args.layers, num_blocks, args.block_size, args.kv_heads, args.head_dim, dtype, "cpu"
    )
    kv_cache.normal_()
    order = rng.permutation(num_blocks).tolist()
    tables = [[order.pop() for _ in range(p)] for p in pages]
    shared_pages = shared_prefix // args.block_size  # the prefix cache's layout of a prompt
    for table in tables[1:]:
        table[:shared_pages] = tables[0][:shared_pages]
    md = build_attention_metadata(computed, new, tables, args.block_size)
    qkv: list[tuple[torch.Tensor, ...]] = [
        (
            torch.randn(md.num_tokens, args.heads, args.head_dim, dtype=dtype),
            torch.randn(md.num_tokens, args.kv_heads, args.head_dim, dtype=dtype),
            torch.randn(md.num_tokens, args.kv_heads, args.head_dim, dtype=dtype),
        )
        for _ in range(4)
    ]
    return kv_cache, qkv, md


def time_calls(backend: AttentionBackend, step: Step, calls: int, first: int) -> list[float]:
    """Seconds for each of `calls` layer calls, cycling through the layers from `first`."""
    kv_cache, qkv, _ = step
    times = []
    for i in range(first, first + calls):
        start = time.perf_counter()
        backend.forward(i % kv_cache.shape[0], *qkv[i % len(qkv)])
        times.append(time.perf_counter() - start)
    return times


def isa_backend(kv_cache: torch.Tensor, args: argparse.Namespace, isa: str) -> AttentionBackend:
    """The cpu-native backend running one instruction set's kernels instead of the best."""
    backend = NativeCpuAttentionBackend(kv_cache, args.heads, args.head_dim**-0.5)
    kernel = torch.ops.pagedserve.paged_attention

    def run(out, q, k_cache, v_cache, *rest):  # rest: the metadata, scale, isa, window, sinks
        *metadata, scale, _, window, sinks = rest
        kernel(out, q, k_cache, v_cache, *metadata, scale, isa, window, sinks)

    backend._kernel = run
    return backend


def bench(
    name: str,
    args: argparse.Namespace,
    computed: list[int],
    new: list[int],
    shared_prefix: int = 0,
) -> None:
    """Alternates short rounds of each backend, so background load hits all alike. K+V is
    what a layer would read without sharing."""
    step = make_step(args, computed, new, shared_prefix)
    kv_cache, _, md = step
    backends = {
        name: create_backend(name, kv_cache, args.heads, args.head_dim**-0.5)
        for name in ("torch", "cpu-native")
    }
    if args.isas:
        for isa in native_kernels().supported:
            backends[isa] = isa_backend(kv_cache, args, isa)
    times: dict[str, list[float]] = {name: [] for name in backends}
    for backend in backends.values():
        backend.plan(md)
        time_calls(backend, step, args.layers, 0)  # warm-up: every layer once
    for r in range(args.rounds):
        for backend_name, backend in backends.items():
            times[backend_name] += time_calls(backend, step, args.calls, r * args.calls)
    median = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    kv_bytes = sum(c + n for c, n in zip(computed, new, strict=True)) * 2 * args.kv_heads
    kv_bytes *= args.head_dim * kv_cache.element_size()
    print(
        f"{name:<26} torch {median['torch']:7.3f} ms   cpu-native {median['cpu-native']:7.3f} ms"
        f"   speedup {median['torch'] / median['cpu-native']:5.2f}x"
        f"   (K+V {kv_bytes / 2**20:.1f} MiB per layer)"
    )
    for isa in native_kernels().supported if args.isas else ():
        speedup = median["torch"] / median[isa]
        print(f"{'':<26} {isa:<12} {median[isa]:7.3f} ms   speedup {speedup:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-decodes", type=int, default=64)
    parser.add_argument("--context", type=int, default=250, help="mean decode context")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=30, help="layer calls per round")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="also time the decodes with their first N keys on the same pages",
    )
    parser.add_argument(
        "--isas", action="store_true", help="also time each instruction set's kernels"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{args.dtype}, heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, "
          f"{torch.get_num_threads()} threads, native kernels {native_kernels().describe()}; "
          "median per layer call")  # fmt: skip
    rng = np.random.default_rng(1)
    n = args.num_decodes
    contexts = rng.integers(args.context - 50, args.context + 50, size=n).tolist()
    bench(f"decode {n} x ~{args.context}", args, contexts, [1] * n)
    bench(f"prefill {args.prefill_len}", args, [0], [args.prefill_len])
    if args.shared_prefix:
        bench(
            f"decode {n} x ~{args.context}, {args.shared_prefix} shared",
            args,
            [max(c, args.shared_prefix) for c in contexts],
            [1] * n,
            args.shared_prefix,
        )
    mixed = contexts[: n // 2]
    bench(
        f"mixed {len(mixed)} decodes + 256",
        args,
        [*mixed, 256],
        [1] * len(mixed) + [256],
    )


if __name__ == "__main__":
    main()
