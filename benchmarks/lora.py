"""The cost of multi-LoRA serving, offline, in one run: output tok/s of 16 requests spread
over 4 LoRA adapters against the same 16 on the base model alone (the LoRA issue's goal:
at most 15% lower).

    python benchmarks/lora.py [--quantization none|gguf] [--dtype bfloat16] [--rounds 3]

The base is the default model (SmolLM2-135M-Instruct); the adapters are random PEFT
adapters of rank --rank on every projection (q/k/v/o, gate/up/down), made once with peft
for the base's shapes. Three engines, built once each and run in alternation:

- base:         the engine without --enable-lora;
- lora-engine:  --enable-lora --max-loras 4, every request on the base model (what
                enabling LoRA costs by itself);
- 4-adapters:   the same engine, the 16 requests over 4 adapters (4 each).

Each round generates --tokens tokens for each of 16 prompts of --prompt-tokens, all at
once (ignore_eos); the best round of each counts. Prints one JSON line per engine and the
ratios. Not a test. Run benchmarks/hardware_limits.py beside it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: Path, dst: Path, rank: int, count: int) -> list[Path]:
    """Random PEFT adapters for `base`'s shapes (from its config: no weights needed)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    paths = [dst / f"adapter{i}" for i in range(count)]
    if all((p / "adapter_config.json").exists() for p in paths):
        return paths
    config = AutoConfig.from_pretrained(base)
    for i, path in enumerate(paths):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(config)
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS)
        peft_model = get_peft_model(model, lora)
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero; a served adapter's is not
                torch.nn.init.normal_(param, std=0.02)
        peft_model.save_pretrained(path)
    return paths


def run_round(llm: Any, prompts: list[list[int]], params: Any, loras: list[Any]) -> float:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--work", type=Path, default=Path("/tmp/pagedserve-lora-bench"))
    args = parser.parse_args()

    import random

    from engine import LLM, SamplingParams, prepare_default_model
    from engine.lora import LoRARequest

    base = prepare_default_model()
    paths = make_adapters(base, args.work, args.rank, args.adapters)
    adapters = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
        for _ in range(args.requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    common = dict(
        dtype=args.dtype, quantization=args.quantization, max_num_seqs=args.requests,
        enable_prefix_caching=False,
    )  # fmt: skip
    lora_args = dict(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
    plain = LLM(**common)  # type: ignore[arg-type]
    lora = LLM(**common, **lora_args)  # type: ignore[arg-type]
    spread = [adapters[i % len(adapters)] for i in range(args.requests)]
    cases = {
        "base": (plain, [None] * args.requests),
        "lora-engine": (lora, [None] * args.requests),
        f"{args.adapters}-adapters": (lora, spread),
    }
    for llm, loras in cases.values():  # warm up: first steps, kernels, adapter slots
        llm.generate(
            prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), lora_request=loras[:4]
        )
    best: dict[str, float] = {name: 0.0 for name in cases}
    for _ in range(args.rounds):
        for name, (llm, loras) in cases.items():
            rate = run_round(llm, prompts, params, loras)
            print(json.dumps({"round_case": name, "output_tok_s": round(rate, 1)}), flush=True)
            best[name] = max(best[name], rate)
    for name, rate in best.items():
        print(json.dumps({"case": name, "output_tok_s": round(rate, 1)}))
    print(
        json.dumps(
            {
                "lora_engine_over_base": round(best["lora-engine"] / best["base"], 3),
                "adapters_over_base": round(best[f"{args.adapters}-adapters"] / best["base"], 3),
                "quantization": args.quantization,
                "dtype": args.dtype,
                "rank": args.rank,
            }
        )
    )


if __name__ == "__main__":
    main()
