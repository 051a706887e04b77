"""The engine's native host paths against the Python ones they replaced, step by step in one
run: decode steps alternate between them, so that the machine's swings (a third within
minutes on a shared VM) fall on both alike. Not a test.

    python benchmarks/host_levers.py --lever ends     # the model's ends inside the layers' op
    python benchmarks/host_levers.py --lever argmax   # a quantized head's greedy argmax
    python benchmarks/host_levers.py --lever both

- ends: the token embedding, the rotary rows and the final norm inside the native layers'
  op (pagedserve::decoder_model), against the Python calls around pagedserve::decoder_layers;
- argmax: greedy tokens from a quantized LM head without its logits
  (pagedserve::quant_linear_argmax), against the float32 logits and the sampler's argmax.

Each of `--streams` requests (one by default) decodes `--tokens` greedy tokens after a
cached prompt of `--prompt-len` random tokens, `--rounds` times; even decode steps take the
native path, odd ones the Python path, and each step's wall time (the engine's whole step:
scheduling, forward, sampling, output) is kept under its path. A step runs after the weights
of the one before have gone through the caches, as in serving, which per-op timings in a
loop (cold_host_ops.py) only imitate. Prints each path's median, 10th and 90th percentile
and mean, and the native path's share of the Python one.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

from engine import LLM, SamplingParams
from engine.models.default_model import prepare_default_model


class Alternation:
    """Wraps the engine's step: sets the lever for even (native) and odd (Python) steps,
    and keeps each step's wall time under its path while recording."""

    def __init__(self, llm: LLM, lever: str) -> None:
        self.model = llm.core.runner.model
        self.stacks = [s for s in (self.model.fused_layers, self.model.fused_dense_layers) if s]
        if lever in ("ends", "both") and not all(s.has_ends for s in self.stacks):
            raise SystemExit("this model's layers' op has no ends (no native layers?)")
        if lever in ("argmax", "both") and self.model.quantized_head is None:
            raise SystemExit("the argmax lever needs a quantized head (--quantization auto)")
        self.lever, self.native_argmax, self.recording = lever, True, False
        self.steps = 0
        self.times: dict[str, list[float]] = {"native": [], "python": []}
        greedy = self.model.greedy_tokens

        def greedy_tokens(hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
            if not self.native_argmax:
                return None  # compute_logits, then the sampler
            return greedy(hidden, vocab_size)

        self.model.greedy_tokens = greedy_tokens
        step = llm.core.step

        def timed_step() -> Any:
            native = self.steps % 2 == 0
            self.steps += 1
            self.set(native)
            start = time.perf_counter()
            out = step()
            if self.recording:
                self.times["native" if native else "python"].append(time.perf_counter() - start)
            return out

        llm.core.step = timed_step

    def set(self, native: bool) -> None:
        if self.lever in ("ends", "both"):
            for stack in self.stacks:
                stack.has_ends = native
        if self.lever in ("argmax", "both"):
            self.native_argmax = native


def summary(times: list[float]) -> dict[str, float]:
    ms = sorted(1e3 * t for t in times)
    return {
        "median_ms": statistics.median(ms),
        "p10_ms": ms[len(ms) // 10],
        "p90_ms": ms[9 * len(ms) // 10],
        "mean_ms": statistics.mean(ms),
        "steps": len(ms),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lever", choices=["ends", "argmax", "both"], default="both")
    p.add_argument("--model", default=None, help="default: the bundled model")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    model = args.model or str(prepare_default_model())
    llm = LLM(model=model, quantization=args.quantization, dtype=args.dtype)
    alternation = Alternation(llm, args.lever)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.streams)
    ]
    decode = SamplingParams(temperature=0.0, max_tokens=args.tokens + 1, ignore_eos=True)
    prefill = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts, prefill)  # the prompts into the prefix cache, the code warm
    for _ in range(args.rounds):
        alternation.recording = False
        llm.generate(prompts, prefill)  # the steps after it decode only
        alternation.recording = True
        llm.generate(prompts, decode)
    results = {path: summary(times) for path, times in alternation.times.items()}
    print(f"lever {args.lever}, {args.streams} stream(s), {torch.get_num_threads()} threads")
    for path, r in results.items():
        print(
            f"{path:7s} step median {r['median_ms']:.3f} ms  p10 {r['p10_ms']:.3f}  "
            f"p90 {r['p90_ms']:.3f}  mean {r['mean_ms']:.3f}  ({r['steps']} steps)"
        )
    native, python = results["native"], results["python"]
    print(
        f"native / python: median {native['median_ms'] / python['median_ms']:.3f}, "
        f"mean {native['mean_ms'] / python['mean_ms']:.3f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
