"""What a hybrid model's KV cache holds at the same memory: with KV cache groups (the
sliding layers free their blocks out of the window, the default on the CPU) and with one
block table for every layer (--disable-hybrid-kv-cache-manager), offline, in one run.

    python benchmarks/hybrid_kv.py [--requests 16] [--prompt 1024] [--output 256]
        [--kv-cache-mib 32] [--dtype bfloat16]

The model is a random-weight gpt-oss-shaped one with the default model's tokenizer, sized
for a small CPU: hidden 512, 8 layers alternating a 128-token window and full attention,
8 query heads and 2 KV heads of 64, 8 experts of 512 a layer, top-2. Every request has a
prompt of `--prompt` random tokens (no shared prefix) and decodes `--output` tokens
greedily. For each mode: the KV blocks the memory holds, the most requests running at
once, the preemptions, the wall time and the output tokens a second; and whether the two
modes' tokens are the same. In float32 they must be (preemption recomputes, and a request's
tokens do not depend on its batch); in bfloat16 a step's batch, which the preemptions
change, can round a near tie the other way. Prints one JSON line a mode. Not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

SHAPE = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=512,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=128,
    max_position_embeddings=4096,
    layer_types=["sliding_attention", "full_attention"] * 4,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
)
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def make_model(dst: Path) -> Path:
    """The random-weight model, saved once under `dst`."""
    if (dst / "config.json").exists():
        return dst
    import torch
    from transformers import AutoModelForCausalLM, GptOssConfig

    from engine import prepare_default_model

    src = prepare_default_model()
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    config = GptOssConfig(**SHAPE, vocab_size=vocab, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # sinks of 0 would leave them untested; small ones count
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 0.5)
    model.save_pretrained(dst)
    for name in COPIED:
        if (src / name).exists():
            (dst / name).write_bytes((src / name).read_bytes())
    return dst


def run(llm: Any, prompts: list[list[int]], output: int) -> tuple[dict[str, Any], list[Any]]:
    """Generates, counting the most requests the scheduler runs in one step."""
    from engine import SamplingParams

    core, most = llm.core, [0]
    step = core.step

    def counted() -> Any:
        result = step()
        most[0] = max(most[0], len(core.scheduler.running))
        return result

    core.step = counted
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    core.step = step
    stats = {
        "kv_blocks": core.config.cache.num_blocks,
        "groups": None if core.config.cache.groups is None else core.config.cache.groups.describe(),
        "most_running": most[0],
        "preemptions": core.scheduler.total_preemptions,
        "seconds": round(seconds, 2),
        "output_tok_s": round(len(prompts) * output / seconds, 1),
    }
    return stats, [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--output", type=int, default=256)
    parser.add_argument("--kv-cache-mib", type=int, default=32, help="KV cache memory, MiB")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--work", type=Path, default=Path("/tmp/pagedserve-hybrid-bench"))
    args = parser.parse_args()
    from engine import LLM

    path = make_model(args.work / "gpt-oss-shaped")
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 40000) for _ in range(args.prompt)] for _ in range(args.requests)
    ]
    tokens = {}
    for disable in (False, True):
        llm = LLM(
            str(path),
            dtype=args.dtype,
            max_model_len=args.prompt + args.output,
            kv_cache_memory=args.kv_cache_mib << 20,
            disable_hybrid_kv_cache_manager=disable,
            max_num_seqs=args.requests,
        )
        stats, tokens[disable] = run(llm, prompts, args.output)
        mode = "one table (--disable-hybrid-kv-cache-manager)" if disable else "KV cache groups"
        print(json.dumps({"mode": mode, **stats}), flush=True)
        llm.close()
    print(json.dumps({"same_tokens": tokens[False] == tokens[True]}), flush=True)


if __name__ == "__main__":
    main()
