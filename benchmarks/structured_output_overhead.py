"""What structured outputs cost: output tokens/s at concurrency 16 with every request
constrained by a JSON schema against none, and the time to compile a first-seen schema.

    python benchmarks/structured_output_overhead.py [--model DIR] [--rounds 2] [--json out]

Both modes run the same prompts through an in-process AsyncLLM. The schema forces a long,
fixed-shape answer (an array of 12 objects); each unconstrained request ignores EOS and
generates as many tokens as its constrained twin did, so both modes decode the same amounts
in the same batch shapes. Rounds alternate the modes to spread the machine's noise over
both. Because tok/s on a shared machine is noisy, it also reports `grammar_share`: of the
constrained rounds' step time (metadata + forward + sampling), the share spent filling and
applying grammar bitmasks, measured inside the same steps (the scheduler's matcher advance,
a few microseconds per token, is not in it). The compile times are those of the grammar
threads, measured from the engine's side: the very first constrained request also builds the
tokenizer tables. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 999},
                    "tag": {"enum": ["alpha", "beta", "gamma"]},
                },
                "required": ["id", "tag"],
                "additionalProperties": False,
            },
            "minItems": 12,
            "maxItems": 12,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
TOPICS = "apples rivers engines music maps clocks trees ships birds stones bread glass".split()


async def run_batch(
    engine: Any, prompts: list[list[int]], params: list[Any]
) -> tuple[list[int], float]:
    """(output tokens per request, seconds) for all requests at once."""

    async def one(prompt: list[int], p: Any) -> int:
        tokens = 0
        async for out in engine.generate(prompt, p, uuid.uuid4().hex):
            tokens = len(out.outputs[0].token_ids)
        return tokens

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(q, p) for q, p in zip(prompts, params, strict=True)))
    return list(counts), time.perf_counter() - start


def compile_ms(engine: Any, schema: dict[str, Any]) -> float:
    from engine import StructuredOutputsParams

    start = time.perf_counter()
    engine.core.grammars.compile(StructuredOutputsParams(json=schema)).result()
    return (time.perf_counter() - start) * 1e3


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from engine import AsyncLLM, EngineArgs, EngineHooks, SamplingParams, StructuredOutputsParams

    engine = AsyncLLM.from_engine_args(
        EngineArgs(
            model=args.model,
            dtype=args.dtype,
            max_num_seqs=args.concurrency,
            engine_in_process=True,  # reads the core's grammar compiler and step profile
        ),
        EngineHooks(profile=True),
    )
    engine.start()
    tokenizer = engine.tokenizer
    prompts = []
    for i in range(args.concurrency):
        topic = TOPICS[i % len(TOPICS)]
        messages = [{"role": "user", "content": f"List twelve {topic} with an id and a tag."}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))

    first = compile_ms(engine, SCHEMA)  # includes building the tokenizer tables
    fresh = [compile_ms(engine, {**SCHEMA, "title": f"fresh-{i}"}) for i in range(5)]
    constrained = [
        SamplingParams(
            temperature=0.0, max_tokens=400, structured_outputs=StructuredOutputsParams(json=SCHEMA)
        )
    ] * args.concurrency
    warm = [SamplingParams(temperature=0.0, max_tokens=8)] * 2
    await run_batch(engine, prompts[:2], warm)
    lengths, _ = await run_batch(engine, prompts, constrained)
    plain = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]

    rates: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    profile = engine.core.runner.profiler.totals
    step_s = grammar_s = 0.0
    for _ in range(args.rounds):
        for mode, params in (("unconstrained", plain), ("constrained", constrained)):
            before = dict(profile)
            counts, seconds = await run_batch(engine, prompts, params)
            rates[mode].append(sum(counts) / seconds)
            if mode == "constrained":
                spent = {k: v - before.get(k, 0.0) for k, v in profile.items()}
                step_s += sum(
                    spent.get(k, 0.0)
                    for k in ("metadata", "forward", "logits", "grammar", "sampling")
                )
                grammar_s += spent.get("grammar", 0.0)
    await engine.stop()
    median = {mode: statistics.median(values) for mode, values in rates.items()}
    return {
        "concurrency": args.concurrency,
        "tokens_per_request": lengths,
        "tok_s": {mode: [round(v, 1) for v in values] for mode, values in rates.items()},
        "median_tok_s": {mode: round(v, 1) for mode, v in median.items()},
        "throughput_cost": round(1 - median["constrained"] / median["unconstrained"], 3),
        "grammar_share": round(grammar_s / step_s, 4),
        "first_compile_ms": round(first, 1),
        "fresh_schema_compile_ms": round(statistics.median(fresh), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF model directory (default: bundled)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
