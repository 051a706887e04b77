"""The engine's host work per request and step, apart from the model: scheduling, input
metadata, sampling, detokenization and output processing, on a model so small that its
forward costs next to nothing. On a GPU this work decides the step time of a small model
(the first GPU run in docs/gpu.md: scheduler and output processing were 37-47% of the time
at 128-256 sequences), so it is measured here, on the CPU, where it runs in any case.

    python benchmarks/host_overhead.py --num-seqs 256 --output-len 64
    python benchmarks/host_overhead.py --compare-decode   # also with transformers' decode

A random-weight llama of tests/tiny_models with a byte-level BPE tokenizer, float32 on the
CPU, greedy, every request at once. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine import LLM, EngineHooks, SamplingParams

SECTIONS = ("metadata", "forward", "logits", "grammar", "sampling")


def measure(llm: LLM, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """One run: per step, each section's ms and the host's µs a request."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    profiler = llm.core.runner.profiler
    profiler.totals.clear()
    steps_before = llm.core.num_steps
    start = time.perf_counter()
    llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    steps = llm.core.num_steps - steps_before
    sections = profiler.report()
    host = elapsed - sum(v for k, v in sections.items() if k in SECTIONS)
    return {
        "steps": steps,
        "ms_per_step": 1e3 * elapsed / steps,
        "sections_ms_per_step": {k: 1e3 * v / steps for k, v in sections.items()},
        "scheduler_and_output_ms_per_step": 1e3 * host / steps,
        "host_us_per_request_step": 1e6
        * (elapsed - sections.get("forward", 0.0))
        / (steps * len(prompts)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--compare-decode", action="store_true")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's tests/
    from tests.tiny_models import make_tiny_model

    path = make_tiny_model("llama", Path(tempfile.mkdtemp()), byte_level=True)
    llm = LLM(
        str(path),
        dtype="float32",
        max_num_seqs=args.num_seqs,
        max_num_batched_tokens=max(2048, args.num_seqs * 2),
        hooks=EngineHooks(profile=True),
    )
    rng = random.Random(0)
    vocab = llm.config.model.arch.vocab_size
    prompts = [
        [rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_seqs)
    ]
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    import engine.detokenizer as detokenizer

    decoders = {"direct decode": detokenizer.window_decoder}
    if args.compare_decode:
        # As before the direct path: every window through transformers' decode.
        decoders["transformers decode"] = detokenizer.transformers_window_decoder
    # The variants alternate run by run, so the machine's drift hits them alike; each
    # keeps its fastest run.
    results: dict[str, dict[str, Any]] = {}
    try:
        for _ in range(args.rounds):
            for name, decoder in decoders.items():
                detokenizer.window_decoder = decoder
                run = measure(llm, prompts, args.output_len)
                if name not in results or run["ms_per_step"] < results[name]["ms_per_step"]:
                    results[name] = run
    finally:
        detokenizer.window_decoder = decoders["direct decode"]
    for name, r in results.items():
        sections = ", ".join(f"{k} {v:.2f}" for k, v in r["sections_ms_per_step"].items())
        print(
            f"{name:20s} {r['ms_per_step']:7.2f} ms/step ({r['steps']} steps): {sections}, "
            f"scheduler+output {r['scheduler_and_output_ms_per_step']:.2f}; host "
            f"{r['host_us_per_request_step']:.1f} us per request and step"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
