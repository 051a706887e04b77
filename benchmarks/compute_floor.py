"""The compute floor of a serving run: the arithmetic its requests needed, done at this
machine's fastest GEMM rate, against the run's own wall time.

    python benchmarks/serve_bench.py ... --out runs/throughput      # writes runs/throughput.json
    python benchmarks/compute_floor.py runs/throughput.json --model MODEL_DIR [--gflops 144]

Without --gflops, the rate is measured first, as benchmarks/hardware_limits.py does (the
fastest of its GEMM shapes and dtypes on all threads). The work is counted per request from
the model's config.json and the request's own prompt and output token counts:

- every token fed through the decoder layers (the prompt, then each generated token but
  the last, which is never fed back) costs 2 FLOPs per weight of the layers' linears;
- every generated token costs the LM head once (2 * hidden * vocab): a prompt's other
  tokens need no logits;
- attention costs 4 * heads * head_dim FLOPs per layer per (query, visible key) pair.

Issue 11 counted 0.27 GFLOP for every token (the LM head included, on prompt tokens too);
this counts what a forward pass needs, attention included: for its throughput workload (64
requests, 200 in, 128 out) that is 5,145 GFLOP against 5,668, a stricter floor. A prefix cache
hit skips work that is still counted here, so a run with hits can beat its floor. Not a
test: nothing is asserted (tests/test_compute_floor.py checks the counting).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        heads = config["num_attention_heads"]
        return cls(
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab=config["vocab_size"],
        )

    def layer_weights(self) -> int:
        """Weights of one decoder layer's linears (q, k, v, o, gate, up, down)."""
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (q_out + 2 * kv_out) + q_out * self.hidden
        return attention + 3 * self.hidden * self.intermediate

    def token_flops(self) -> int:
        """One token through every decoder layer's linears."""
        return 2 * self.layers * self.layer_weights()

    def lm_head_flops(self) -> int:
        return 2 * self.hidden * self.vocab

    def attention_flops(self, keys: int) -> int:
        """One query token against `keys` visible keys, in every layer."""
        return 4 * self.layers * self.heads * self.head_dim * keys


@dataclass(frozen=True)
class Work:
    linears: float  # FLOPs
    lm_head: float
    attention: float

    @property
    def total(self) -> float:
        return self.linears + self.lm_head + self.attention


def request_work(shape: ModelShape, prompt_tokens: int, output_tokens: int) -> Work:
    """The arithmetic one request needs, with no prefix cache."""
    fed = prompt_tokens + max(output_tokens, 1) - 1  # the last generated token is not fed
    # Token t (0-based) sees keys 0..t: sum over t < fed of (t + 1).
    pairs = fed * (fed + 1) // 2
    return Work(
        linears=fed * shape.token_flops(),
        lm_head=output_tokens * shape.lm_head_flops(),
        attention=shape.attention_flops(pairs),
    )


def run_work(shape: ModelShape, requests: list[dict[str, Any]]) -> Work:
    done = [r for r in requests if r.get("error") is None]
    if any(r["prompt_tokens"] is None for r in done):
        raise ValueError(
            "the run has requests with no prompt token count (text prompts to a server whose "
            "stream reports no usage)"
        )
    parts = [request_work(shape, r["prompt_tokens"], r["output_tokens"]) for r in done]
    return Work(
        linears=sum(w.linears for w in parts),
        lm_head=sum(w.lm_head for w in parts),
        attention=sum(w.attention for w in parts),
    )


def fastest_gemm_gflops(reps: int) -> float:
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    from hardware_limits import SHAPES, matmul_gflops

    return max(
        matmul_gflops(m, k, n, dtype, reps)
        for m, k, n in SHAPES.values()
        for dtype in (torch.bfloat16, torch.float32)
    )


def report(path: Path, shape: ModelShape, gflops: float) -> dict[str, Any]:
    run = json.loads(path.read_text())
    if "requests" not in run:
        raise ValueError("no per-request records (run serve_bench.py with --out)")
    work = run_work(shape, run["requests"])
    summary = run["summary"]
    floor_s = work.total / (gflops * 1e9)
    return {
        "run": str(path),
        "label": run.get("label"),
        "output_tokens": summary["output_tokens"],
        "wall_s": summary["wall_s"],
        "gflop": {
            "linears": work.linears / 1e9,
            "lm_head": work.lm_head / 1e9,
            "attention": work.attention / 1e9,
        },
        "gemm_gflops": gflops,
        "floor_s": floor_s,
        "floor_tokens_per_s": summary["output_tokens"] / floor_s,
        "output_tokens_per_s": summary["output_tokens_per_s"],
        "share_of_floor": floor_s / summary["wall_s"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", type=Path, nargs="+", help="serve_bench.py --out JSON files")
    p.add_argument("--model", type=Path, required=True, help="the served model's directory")
    p.add_argument("--gflops", type=float, default=None, help="default: measured now")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    shape = ModelShape.from_config(json.loads((args.model / "config.json").read_text()))
    gflops = args.gflops if args.gflops is not None else fastest_gemm_gflops(args.reps)
    for path in args.runs:
        try:
            r = report(path, shape, gflops)
        except ValueError as exc:
            print(f"{path}: no floor: {exc}")
            continue
        g = r["gflop"]
        print(
            f"{r['label']}: {r['output_tokens']} tokens in {r['wall_s']:.1f} s = "
            f"{r['output_tokens_per_s']:.1f} tok/s; work {g['linears']:.0f} + "
            f"{g['lm_head']:.0f} (LM head) + {g['attention']:.0f} (attention) GFLOP at "
            f"{gflops:.1f} GFLOP/s: floor {r['floor_s']:.1f} s = "
            f"{r['floor_tokens_per_s']:.1f} tok/s, {100 * r['share_of_floor']:.0f}% of it"
        )
        print(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
