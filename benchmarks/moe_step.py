"""Decode steps of a mixture-of-experts model against a dense model with the same active
parameters, offline, in one run (the MoE issue's goal: at most 1.3x the dense step).

    python benchmarks/moe_step.py [--dtype bfloat16] [--batches 1,16] [--steps 32]

Both are random-weight Qwen3-shaped models with the default model's tokenizer, sized for a
small CPU: hidden 1024, 8 layers, 16 query heads and 8 KV heads of 64, and

- MoE (Qwen3-MoE): 16 experts with intermediate size 768, top-2, so a token's MLP is
  2 x 768 = 1536 wide;
- dense (Qwen3): intermediate size 1536.

So a token runs the same attention and as many MLP weights in each; the MoE holds 8x the
MLP weights, of which a step reads the experts its tokens chose. For each batch size: the
decode step time (greedy, end tokens ignored, 32-token prompts), taken as the difference
between generating `--steps` + 1 tokens and 1, best of `--rounds`, alternating the models;
and the MoE's over the dense's. Prints one JSON line per batch size. Not a test.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

SHAPE = dict(
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=4096,
)
MOE = dict(
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=768,
    intermediate_size=1536,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)
DENSE = dict(intermediate_size=2 * 768)
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def make_model(kind: str, dst: Path) -> Path:
    """A random-weight model of `kind` ("moe" or "dense") with the default model's
    tokenizer, saved once under `dst`."""
    if (dst / "config.json").exists():
        return dst
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    from engine import prepare_default_model

    src = prepare_default_model()
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    common = dict(SHAPE, vocab_size=vocab, tie_word_embeddings=True)
    config = Qwen3MoeConfig(**common, **MOE) if kind == "moe" else Qwen3Config(**common, **DENSE)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(dst)
    for name in COPIED:
        if (src / name).exists():
            (dst / name).write_bytes((src / name).read_bytes())
    return dst


def step_time(llm: Any, batch: int, steps: int) -> float:
    """Seconds per decode step of `batch` requests."""
    from engine import SamplingParams

    prompts = [[100 + (7 * i + j) % 5000 for j in range(32)] for i in range(batch)]

    def run(tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    return (run(steps + 1) - run(1)) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/pagedserve-moe-bench"))
    args = parser.parse_args()
    from engine import LLM

    llms = {
        kind: LLM(
            str(make_model(kind, args.work / kind)),
            dtype=args.dtype,
            max_model_len=512,
            num_kv_blocks=512,
            quantization="none",
        )
        for kind in ("moe", "dense")
    }
    for batch in map(int, args.batches.split(",")):
        best = {kind: float("inf") for kind in llms}
        for _ in range(args.rounds):
            for kind, llm in llms.items():
                best[kind] = min(best[kind], step_time(llm, batch, args.steps))
        print(
            json.dumps(
                {
                    "batch": batch,
                    "dtype": args.dtype,
                    "moe_step_ms": round(best["moe"] * 1e3, 2),
                    "dense_step_ms": round(best["dense"] * 1e3, 2),
                    "moe_over_dense": round(best["moe"] / best["dense"], 2),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
