"""Decode steps by sampling setting: what temperature, top-k, top-p and seeds cost on top
of greedy decoding, offline (not a test).

    python benchmarks/sampling.py [--streams 64] [--quantization none] [--rounds 2]

Greedy steps take their tokens from the bf16 head's fused argmax; every other setting
computes float32 logits and samples from them (engine/worker/sampler.py). Each setting
generates `--steps` + 1 tokens and 1 token for `--streams` random 200-token prompts (in
the prefix cache after the first run), and prints the difference per decode step, for
each round.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from engine import LLM, SamplingParams

SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "top_p": {"temperature": 0.8, "top_p": 0.95},
    "top_k": {"temperature": 0.8, "top_k": 50},
    "seed": {"temperature": 0.8, "seed": 1},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: bundled)")
    p.add_argument("--quantization", default="none")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    llm = LLM(args.model, dtype="bfloat16", quantization=args.quantization, max_model_len=2048)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(200)] for _ in range(args.streams)]

    def seconds(tokens: int, setting: dict[str, Any]) -> float:
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, **setting)
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    seconds(2, SETTINGS["greedy"])
    results = {}
    for name, setting in SETTINGS.items():
        per_step = []
        for _ in range(args.rounds):
            one = seconds(1, setting)
            per_step.append(1e3 * (seconds(args.steps + 1, setting) - one) / args.steps)
        results[name] = per_step
        print(f"{name:12s} " + " ".join(f"{ms:7.2f}" for ms in per_step) + " ms a step")
    print(json.dumps({"streams": args.streams, "ms_per_step": results}))


if __name__ == "__main__":
    main()
