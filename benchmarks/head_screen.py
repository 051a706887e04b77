"""The bfloat16 LM head's greedy tokens through its int8 screen (engine/models/head_screen.py)
against the whole head (bf16_linear_argmax): the rows the screen keeps, the head alone, and
decode steps.

    python benchmarks/head_screen.py            # the default model, bf16

- kept: on the hidden states of greedy generations (text prompts and random-token ones),
  the candidate tiles of 16 rows per step of one row, and the share of steps where the
  screen could not decide (the whole head ran after it);
- head: the model's own head and screen (in its huge pages), median ms of each op on one
  captured hidden state per row count, the caches flushed by reading 256 MB between calls;
- step: single-stream decode steps (200-token prompt, greedy) with the screen and without,
  one process switching between them every round, and the head's share of each (timed
  around greedy_tokens).

Run benchmarks/hardware_limits.py beside it: the head reads memory, whose speed moves. Not a
test: nothing is asserted.
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

TEXT_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash map works, with an example in Python.",
    "What are the main causes of the French Revolution?",
    "List five tips for writing clear technical documentation.",
]


def capture_hidden(llm: LLM, prompts: list[Any], max_tokens: int) -> list[torch.Tensor]:
    """Each greedy step's hidden rows, one row at a time."""
    model = llm.core.runner.model
    rows: list[torch.Tensor] = []
    greedy = model.greedy_tokens

    def spy(hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        rows.extend(hidden.clone())
        return greedy(hidden, vocab_size)

    model.greedy_tokens = spy
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for prompt in prompts:
            llm.generate([prompt], params)
    finally:
        del model.greedy_tokens
    return rows


def kept_tiles(llm: LLM, rows: list[torch.Tensor]) -> dict[str, float]:
    model = llm.core.runner.model
    screen, vocab = model.head_screen, llm.core.runner.sampler.vocab_size
    counts = [
        len(
            torch.ops.pagedserve.bf16_linear_screen_tiles(
                row[None], vocab, screen.weight, screen.bounds
            )
        )
        for row in rows
    ]
    decided = sorted(c for c in counts if c > 0)
    return {
        "steps": len(counts),
        "whole_head_share": 1 - len(decided) / len(counts),
        "tiles_mean": statistics.fmean(decided),
        "tiles_p50": decided[len(decided) // 2],
        "tiles_p99": decided[int(0.99 * (len(decided) - 1))],
        "tiles_max": decided[-1],
        "head_tiles": -(-vocab // 16),
    }


def head_alone(llm: LLM, rows: list[torch.Tensor], repeats: int) -> dict[str, dict[str, float]]:
    model = llm.core.runner.model
    dense, screen = model.dense_head, model.head_screen
    vocab = llm.core.runner.sampler.vocab_size
    flush = torch.ones(64 << 20)  # 256 MB, read between calls
    ops = torch.ops.pagedserve

    def median_ms(fn: Any) -> float:
        times = []
        for _ in range(repeats):
            flush.sum()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    out: dict[str, dict[str, float]] = {}
    n = dense.out_features
    for m in (1, 2, 4, 8):
        x = torch.stack(rows[100 : 100 + m])
        whole = median_ms(lambda x=x: ops.bf16_linear_argmax(x, dense.tiled, n, vocab))
        screened = median_ms(
            lambda x=x: ops.bf16_linear_argmax_screened(
                x, dense.tiled, n, vocab, screen.weight, screen.bounds
            )
        )
        out[str(m)] = {"whole_ms": whole, "screened_ms": screened}
    return out


def decode_steps(llm: LLM, rounds: int, steps: int) -> dict[str, list[list[float]]]:
    model = llm.core.runner.model
    screen = model.head_screen
    head_s = [0.0]
    greedy = model.greedy_tokens

    def timed(hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        start = time.perf_counter()
        tokens = greedy(hidden, vocab_size)
        head_s[0] += time.perf_counter() - start
        return tokens

    model.greedy_tokens = timed
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(200)]

    def run(n: int) -> tuple[float, float]:
        head_s[0] = 0.0
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start, head_s[0]

    results: dict[str, list[list[float]]] = {"screened": [], "whole": []}
    try:
        for _ in range(rounds):
            for name in results:
                model.head_screen = screen if name == "screened" else None
                run(1)  # the prompt into the prefix cache
                one, many = run(1), run(steps + 1)
                step_ms = 1e3 * (many[0] - one[0]) / steps
                head_ms = 1e3 * (many[1] - one[1]) / steps
                results[name].append([round(step_ms, 3), round(head_ms, 3)])
    finally:
        model.head_screen = screen
        del model.greedy_tokens
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: bundled)")
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens per capture prompt")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--cpu-isa", default=None, help="the native kernels' instruction set")
    args = p.parse_args()
    llm = LLM(
        args.model,
        dtype="bfloat16",
        quantization="none",
        max_model_len=2048,
        **({"cpu_isa": args.cpu_isa} if args.cpu_isa else {}),
    )
    if llm.core.runner.model.head_screen is None:
        raise SystemExit("no head screen: the bfloat16 head is not tiled on this CPU")
    rng = random.Random(1)
    randoms = [[rng.randrange(1000, 40000) for _ in range(50)] for _ in range(4)]
    chats = [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        for text in TEXT_PROMPTS
    ]
    rows = capture_hidden(llm, [*chats, *randoms], args.tokens)
    result = {
        "kept": kept_tiles(llm, rows),
        "head_alone": head_alone(llm, rows, args.repeats),
        "decode_step_ms_and_head_ms": decode_steps(llm, args.rounds, args.steps),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
