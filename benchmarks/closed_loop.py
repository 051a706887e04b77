"""The "16 at once" workload on the engine core itself, without HTTP: each step's decodes,
prompt tokens, time and cap beside decodes, and what they add up to.

    python benchmarks/closed_loop.py [--prefill-time-beside-decodes R] [--min-tokens N] \\
        [--concurrency 16] [--num-requests 32] [--prompt-len 200] [--output-len 128] \\
        [--steps-out steps.json]

A closed loop of --concurrency requests of random prompt tokens on the bundled model (Q4_1
GGUF, at the engine's defaults but for the flags given), each replaced by the next when it
ends, as mixed_load.py's "16 at once" does over HTTP. Prints output tok/s, the time to
first token (p50, p99) and the inter-token latency as the decoding requests see it: each
step's time, once per request it decoded (p50, p99). --min-tokens overrides
engine/scheduler/step_cost.MIN_TOKENS, the least cap in time. Not a test: nothing is
asserted; the figures move with the machine (give hardware_limits.py beside them).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from engine.config import EngineArgs
from engine.core import EngineCore
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import step_cost


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefill-time-beside-decodes", type=float, default=None)
    p.add_argument("--min-tokens", type=int, default=None)
    p.add_argument("--quantization", default="gguf")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps-out", type=Path, default=None, help="each step's figures, as JSON")
    args = p.parse_args()
    if args.min_tokens is not None:
        step_cost.MIN_TOKENS = args.min_tokens
    engine_args = EngineArgs(
        quantization=args.quantization, prefill_time_beside_decodes=args.prefill_time_beside_decodes
    )
    core = EngineCore.from_args(engine_args)
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    added: dict[str, float] = {}
    first: dict[str, float] = {}

    def add() -> None:
        request_id = f"r{len(added)}"
        prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_len)]
        core.add_request(Request(request_id, prompt, params, eos_token_ids=()))
        added[request_id] = time.perf_counter()

    for _ in range(args.concurrency):
        add()
    steps = []
    start = time.perf_counter()
    while core.has_unfinished_requests():
        cap = core.scheduler.prefill_tokens_beside_decodes()
        began = time.perf_counter()
        result = core.step()
        now = time.perf_counter()
        decodes, prompt_tokens = core.scheduler.last_step_mix
        steps.append(
            {
                "decodes": decodes,
                "prompt_tokens": prompt_tokens,
                "cap": cap,
                "ms": 1e3 * (now - began),
            }
        )
        for output in result.outputs:
            first.setdefault(output.request_id, now)
            if output.finished and len(added) < args.num_requests:
                add()
    wall = time.perf_counter() - start
    gaps = [s["ms"] for s in steps for _ in range(s["decodes"])]
    ttfts = [first[r] - added[r] for r in added]
    print(
        f"prefill_time_beside_decodes {core.config.scheduler.prefill_time_beside_decodes:g}, "
        f"min tokens {step_cost.MIN_TOKENS}: {args.num_requests * args.output_len / wall:.1f} "
        f"tok/s in {len(steps)} steps; step time per decoding request p50 "
        f"{percentile(gaps, 50):.1f} p99 {percentile(gaps, 99):.1f} ms; TTFT p50 "
        f"{percentile(ttfts, 50):.2f} p99 {percentile(ttfts, 99):.2f} s"
    )
    if args.steps_out is not None:
        args.steps_out.write_text(json.dumps(steps))
    core.close()


if __name__ == "__main__":
    main()
