"""Where a step's time goes, per workload: matmul, attention, the rest of the forward,
sampling, output processing and host work, measured offline with torch.profiler.

    python benchmarks/step_profile.py --workload single-stream throughput shared-prefix decode
    python benchmarks/step_profile.py --layers python          # the layers as Python modules
    python benchmarks/step_profile.py --quantization auto      # the default model's Q4_1 file

Each workload runs twice through pagedserve's LLM: once plain, for the wall time per step,
and once under the profiler, whose per-op self times give each category's share (the
profiler adds its own cost per op, so the shares are approximate, the wall time is not).
That cost falls mostly between the kernels, so the last column, the part of the unprofiled
wall time that the kernels' profiled time does not cover, bounds the rest from below where
the shares bound it from above. Native ops are filed by their own name (`paged_attention`
under attention; the decoder layer op, its norms and SiLU under the rest of the forward).
`--layers python` drops the native decoder-layer op (engine/models/fused_layers.py), which
is how the layers ran before it. The native layers also count their kernels' wall time in
the unprofiled run (pagedserve::kernel_time_ns): `attention_ms_per_step` is attention's,
without the profiler's cost. Output processing here is the LLM's; the
HTTP server's share is the difference between a served ITL and the step time printed here.
OpenMP's threads sleep at barriers, as in the served engine core (engine/core_client.py's
OMP_WAIT_POLICY): the script restarts itself with OMP_WAIT_POLICY=PASSIVE unless the
environment sets a policy (spinning OpenMP threads took the cores from the kernels' own
pool: one Q4_1 stream's step took 4.1-4.7 ms so, 3.4-3.7 ms as served).
Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from engine import LLM, SamplingParams

WORDS = "river mountain city engine music history garden winter ocean market library".split()
# (prompts, prompt tokens, shared prefix tokens, output tokens, requests run together)
WORKLOADS = {
    "single-stream": (4, 200, 0, 64, 1),
    "throughput": (64, 200, 0, 64, 64),
    "shared-prefix": (48, 12, 800, 32, 8),
    # Decode steps: the prompt's full blocks are in the prefix cache before the timed runs,
    # so the first step computes the last partial block (8 tokens) and the 63 others one.
    "decode": (1, 200, 0, 64, 1),
    # The same at 16 streams (the quantized suite's "16 at once").
    "decode-16": (16, 200, 0, 64, 16),
}
CACHED_PROMPTS = {"decode", "decode-16"}
MATMUL = ("linear", "mm", "matmul", "quant")
ATTENTION = ("attention", "paged", "cache")
SECTIONS = ("forward", "lm_head", "sampler", "output", "step")


def prompts(n: int, length: int, prefix: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)

    def ids(count: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(count)]

    shared = ids(prefix)
    return [shared + ids(length) for _ in range(n)]


def annotate(owner: Any, attr: str, label: str) -> None:
    inner: Callable[..., Any] = getattr(owner, attr)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return inner(*args, **kwargs)

    setattr(owner, attr, wrapped)


def run(llm: LLM, batch: list[list[int]], output_len: int, together: int) -> int:
    """Generates for `batch`, `together` requests at a time; returns the steps taken."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    before = llm.core.num_steps
    for i in range(0, len(batch), together):
        llm.generate(batch[i : i + together], params)
    return llm.core.num_steps - before


def category(name: str, section: str | None) -> str:
    # The op's own name, without its namespace: every native op is pagedserve::*, and
    # "paged" would file the decoder layer, its norms and its SiLU under attention.
    lowered = name.lower().rsplit("::", 1)[-1]
    if section in ("forward", "lm_head"):
        if section == "lm_head" or any(k in lowered for k in MATMUL):
            return "matmul"
        if any(k in lowered for k in ATTENTION):
            return "attention"
        return "other forward"
    return {"sampler": "sampling", "output": "output processing"}.get(section or "", "host")


def category_totals(prof: Any) -> dict[str, float]:
    """Each category's profiled self time, in seconds."""
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        section, parent = None, event
        while parent is not None:
            if parent.name in SECTIONS:
                section = parent.name
                break
            parent = parent.cpu_parent
        totals[category(event.name, section)] += event.self_cpu_time_total * 1e-6
    return totals


def shares(totals: dict[str, float]) -> dict[str, float]:
    whole = sum(totals.values())
    return {k: v / whole for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def profile_workload(llm: LLM, name: str) -> dict[str, Any]:
    n, length, prefix, output_len, together = WORKLOADS[name]
    batch = prompts(n, length, prefix)
    cached = name in CACHED_PROMPTS
    llm.reset_prefix_cache()
    run(llm, batch[:together], 4, together)  # warm-up
    if not cached:
        llm.reset_prefix_cache()
    torch.ops.pagedserve.kernel_time_ns(True)
    start = time.perf_counter()
    steps = run(llm, batch, output_len, together)
    elapsed = time.perf_counter() - start
    kernels_ns, attention_ns = torch.ops.pagedserve.kernel_time_ns(False)
    if not cached:
        llm.reset_prefix_cache()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(llm, batch, output_len, together)
    totals = category_totals(prof)
    kernels = totals.get("matmul", 0.0) + totals.get("attention", 0.0)
    return {
        "steps": steps,
        "ms_per_step": 1e3 * elapsed / steps,
        "output_tok_per_s": n * output_len / elapsed,
        "shares": shares(totals),
        # The profiler's own cost lands mostly outside the kernels, in the many small ops
        # around them, so the shares above overstate the rest. The kernels' profiled time
        # against the unprofiled wall time bounds it from the other side (noisy: the two
        # runs are separate).
        "outside_kernels_vs_wall": max(0.0, 1 - kernels / elapsed),
        # The native decoder layers' own count in the unprofiled run (0 with --layers
        # python): their linears and attention, and attention alone, per step.
        "layer_kernels_ms_per_step": 1e-6 * kernels_ns / steps,
        "attention_ms_per_step": 1e-6 * attention_ns / steps,
    }


def main() -> None:
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        # OpenMP reads the policy when torch loads it: too late to set it in this process.
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: bundled)")
    p.add_argument("--workload", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default="none")
    p.add_argument("--layers", choices=["native", "python"], default="native")
    args = p.parse_args()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_seqs=64,
        max_model_len=2048,
    )
    runner = llm.core.runner
    if args.layers == "python":
        runner.model.fused_layers = None
    annotate(runner.model, "forward", "forward")
    annotate(runner.model, "compute_logits", "lm_head")
    annotate(runner.sampler, "sample_on_device", "sampler")
    annotate(llm._processor, "process_outputs", "output")
    annotate(llm.core, "step", "step")
    print(f"threads {torch.get_num_threads()}, layers {args.layers}, {args.quantization}")
    for name in args.workload:
        result = profile_workload(llm, name)
        cells = "  ".join(f"{k} {100 * v:.0f}%" for k, v in result["shares"].items())
        cells += f"  | outside kernels vs wall {100 * result['outside_kernels_vs_wall']:.0f}%"
        cells += f"  | in-step attention {result['attention_ms_per_step']:.2f} ms"
        print(
            f"{name:14s} {result['ms_per_step']:7.2f} ms/step  "
            f"{result['output_tok_per_s']:7.1f} tok/s  {cells}",
            flush=True,
        )
        print(json.dumps({"workload": name, **result}))


if __name__ == "__main__":
    main()
