"""Offline throughput: pagedserve's LLM against Hugging Face `generate`, in one run.

    python benchmarks/offline_throughput.py --num-prompts 64 --output-len 128 --dtype bfloat16

Both run the same model, dtype and prompts. HF runs static, left-padded batches; every
request generates exactly `--output-len` tokens on both sides (ignore_eos /
min_new_tokens). Prints output tokens/s for each, their ratio, and where pagedserve's
step time went. Not a test: timings are never asserted.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

WORDS = (
    "the of and to in is was for on that with as by at from his her an which were are "
    "river mountain city engine music history science garden winter ocean market library "
    "ancient modern quickly slowly bright quiet golden broken hidden famous simple strange "
    "travel build remember discover explain follow carry wonder gather measure describe"
).split()


def make_prompts(tokenizer, num: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        target = rng.randint(min_len, max_len)
        text = " ".join(rng.choice(WORDS) for _ in range(target * 2))
        prompts.append(tokenizer.encode(text)[:target])
    return prompts


def run_pagedserve(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, object]:
    from engine import LLM, EngineHooks, SamplingParams

    llm = LLM(
        args.model,
        hooks=EngineHooks(profile=True),
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        attention_backend=args.attention_backend,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    llm.core.runner.profiler.totals.clear()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    profile = llm.core.runner.profiler.report()
    profile["scheduler+output"] = elapsed - sum(
        v
        for k, v in profile.items()
        if k in ("metadata", "forward", "logits", "grammar", "sampling")
    )
    return {
        "output_tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "profile_s": profile,
        "model_path": str(llm.config.model.path),
    }


def run_hf(
    args: argparse.Namespace, model_path: str, prompts: list[list[int]]
) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
    # The engine's own device: CUDA when present, else the CPU.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype[args.dtype])
    model = model.to(device).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def batch_generate(batch: list[list[int]], new_tokens: int) -> int:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        return int((out.shape[1] - width) * len(batch))

    batch_generate(prompts[:2], 4)  # warm-up
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(prompts), args.hf_batch_size):
        tokens += batch_generate(prompts[i : i + args.hf_batch_size], args.output_len)
    elapsed = time.perf_counter() - start
    return {"output_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: bundled)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--min-prompt-len", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=192)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--attention-backend", default="auto", help="auto, torch or cpu-native")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from engine import prepare_default_model

    model_path = args.model or str(prepare_default_model())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = make_prompts(
        tokenizer, args.num_prompts, args.min_prompt_len, args.max_prompt_len, args.seed
    )
    args.model = model_path
    result: dict[str, object] = {"config": vars(args) | {"json": str(args.json)}}
    result["pagedserve"] = run_pagedserve(args, prompts)
    if not args.skip_hf:
        result["hf_generate"] = run_hf(args, model_path, prompts)
    print(json.dumps(result, indent=2, default=str))
    if "hf_generate" in result:
        ours_tps = result["pagedserve"]["tokens_per_s"]  # type: ignore[index]
        hf_tps = result["hf_generate"]["tokens_per_s"]  # type: ignore[index]
        ratio = ours_tps / hf_tps
        print(f"pagedserve {ours_tps:.1f} tok/s, HF generate {hf_tps:.1f} tok/s: {ratio:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
