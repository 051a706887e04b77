"""A single-stream decode step against its kernels alone, without a profiler: the share of
the step spent outside the matmul and attention kernels (dispatch, the small ops between
them, metadata, sampling, scheduling, output processing).

    python benchmarks/decode_breakdown.py                      # bf16
    python benchmarks/decode_breakdown.py --quantization auto  # the default model's Q4_1 file
    python benchmarks/decode_breakdown.py --quantization auto --streams 16

The step: `--streams` requests (one by default) whose prompts are in the prefix cache,
greedy, timed as the difference between generating `--steps` + 1 tokens and 1 token (so
only decode steps count). Its kernels are timed two ways:

- in the step: the native decoder layers count the wall time of their linears and attention
  (pagedserve::kernel_time_ns, which also gives attention's share alone), and the LM head is
  timed around compute_logits and greedy_tokens, in the same runs as the step itself, so
  with the caches as a real step leaves them. Around them, the same runs time the native
  layers' op as a whole (its small ops between the kernels: norms, rotary, the K/V write,
  SiLU, the activations' conversions, allocation, dispatch; where the whole model runs as
  one op, its embedding, rotary rows and final norm too), the rest of the forward (the
  step's metadata; else the embedding and final norm too), the rest of sampling, and what the
  engine does outside the model runner (scheduling, output processing);
- alone: each layer's four linears and its attention, called from Python with the step's own
  weights and page table, and the LM head, as one loop. This pays a Python dispatch per
  kernel (about 150 of them) and runs with the caches warm from the previous pass, so it is
  only a cross-check.

torch.profiler charges its own cost per op to the ops around the kernels, so step_profile.py's
shares overstate the rest on a small model; neither of these does. Best of `--rounds`,
alternating. Not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from typing import Any

import torch

import engine.models.llama as llama
from engine import LLM, SamplingParams

# The native ops a step's layers run in: the layers alone, or the whole model with its ends
# (token embedding, rotary rows, final norm).
NATIVE_OPS = ("run_fused_layers", "run_fused_model")


def best_ms(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def capture_layer_args(llm: LLM, prompt: list[int]) -> list[tuple[Any, ...]]:
    """Each native decoder layer's attention arguments in one decode step: its K and V
    caches, the step's slot mapping and page table, the scale."""
    captured: list[list[tuple[Any, ...]]] = []
    originals = {name: getattr(llama, name) for name in NATIVE_OPS}

    def spy_on(run: Callable[..., Any]) -> Callable[..., Any]:
        def spy(*args: Any) -> Any:
            attn = next(a for a in args if hasattr(a, "stack_args"))
            k_caches, v_caches, *shared = attn.stack_args()
            captured.append([(k, v, *shared) for k, v in zip(k_caches, v_caches, strict=True)])
            return run(*args)

        return spy

    for name, run in originals.items():
        setattr(llama, name, spy_on(run))
    try:
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    finally:
        for name, run in originals.items():
            setattr(llama, name, run)
    if not captured:
        raise SystemExit("the native decoder layers did not run: no native kernels here?")
    return captured[-1]


def kernels_loop(llm: LLM, layer_args: list[tuple[Any, ...]]) -> Callable[[], None]:
    """One decode step's kernels: per layer the four linears and attention, then the head."""
    model = llm.core.runner.model
    dtype = getattr(torch, llm.config.device.dtype)
    calls: list[Callable[[], Any]] = []
    for layer, args in zip(model.layers, layer_args, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            x = torch.randn(1, lin.in_features).to(dtype)
            if lin.quantized is not None:
                qargs = lin.quantized.kernel_args()
                calls.append(lambda x=x, q=qargs: torch.ops.pagedserve.quant_linear(x, *q))
            elif lin.tiled is not None:
                tiled, n = lin.tiled, lin.out_features
                calls.append(lambda x=x, t=tiled, n=n: torch.ops.pagedserve.bf16_linear(x, t, n))
            else:
                calls.append(lambda x=x, lin=lin: lin(x))
        q = torch.randn(1, attn.num_heads, attn.head_dim).to(dtype)
        out = torch.empty_like(q)
        k_cache, v_cache, _, *metadata, scale = args
        calls.append(
            lambda q=q, o=out, k=k_cache, v=v_cache, m=metadata, s=scale: (
                torch.ops.pagedserve.paged_attention(o, q, k, v, *m, s)
            )
        )
    hidden = torch.randn(1, model.arch.hidden_size).to(dtype)
    calls.append(lambda: model.compute_logits(hidden))

    def loop() -> None:
        for call in calls:
            call()

    return loop


# What each run times besides the wall clock, by the callable it wraps: (owner, attribute).
TIMED = {
    "head": (("model", "compute_logits"), ("model", "greedy_tokens")),
    "layers_op": tuple(("llama", name) for name in NATIVE_OPS),
    "forward": (("runner", "forward"),),
    "execute": (("runner", "execute"),),
}


def time_calls(owners: dict[str, Any]) -> dict[str, float]:
    """Wraps each callable of TIMED in a timer; returns the seconds they add up to, by name
    (the caller zeroes them)."""
    totals = dict.fromkeys(TIMED, 0.0)
    for name, targets in TIMED.items():
        for owner_name, attribute in targets:
            owner = owners[owner_name]
            inner = getattr(owner, attribute)

            def timed(*args: Any, _inner: Any = inner, _name: str = name, **kw: Any) -> Any:
                start = time.perf_counter()
                try:
                    return _inner(*args, **kw)
                finally:
                    totals[_name] += time.perf_counter() - start

            setattr(owner, attribute, timed)
    return totals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: bundled)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default="none")
    p.add_argument("--quantize-lm-head", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--streams", type=int, default=1, help="requests decoding together")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        quantize_lm_head=args.quantize_lm_head,
        max_model_len=2048,
        max_num_seqs=max(args.streams, 1),
    )
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(args.streams)
    ]
    kernels = None
    if args.streams == 1:  # the cross-check replays one request's step
        kernels = kernels_loop(llm, capture_layer_args(llm, prompts[0]))
    else:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))

    runner = llm.core.runner
    totals = time_calls({"model": runner.model, "llama": llama, "runner": runner})

    def generate(n: int) -> dict[str, float]:
        """Seconds of generating n tokens: the wall clock, the kernels, the timed calls."""
        torch.ops.pagedserve.kernel_time_ns(True)
        for name in totals:
            totals[name] = 0.0
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        wall = time.perf_counter() - start
        kernels_ns, attention_ns = torch.ops.pagedserve.kernel_time_ns(False)
        measured = {"wall": wall, "kernels": 1e-9 * kernels_ns, "attention": 1e-9 * attention_ns}
        return measured | totals

    best: dict[str, float] | None = None  # per decode step, ms
    kernel_ms = float("inf")
    for _ in range(args.rounds):
        one = min((generate(1) for _ in range(2)), key=lambda r: r["wall"])
        many = generate(args.steps + 1)
        step = {k: 1e3 * (many[k] - one[k]) / args.steps for k in many}
        if best is None or step["wall"] < best["wall"]:
            best = step
        if kernels is not None:
            kernel_ms = min(kernel_ms, best_ms(kernels, args.steps))
    assert best is not None
    step_ms, layers_ms, head_ms = best["wall"], best["kernels"], best["head"]
    result = {
        "quantization": args.quantization,
        "quantize_lm_head": llm.config.quant.lm_head,
        "streams": args.streams,
        "decode_step_ms": step_ms,
        "in_step_layer_kernels_ms": layers_ms,
        "in_step_attention_ms": best["attention"],
        "in_step_lm_head_ms": head_ms,
        "in_step_layers_small_ops_ms": best["layers_op"] - layers_ms,
        "in_step_forward_rest_ms": best["forward"] - best["layers_op"],
        "in_step_sampling_rest_ms": best["execute"] - best["forward"] - head_ms,
        "outside_model_runner_ms": step_ms - best["execute"],
        "outside_kernels": 1 - (layers_ms + head_ms) / step_ms,
    }
    print(
        f"{args.quantization}, {args.streams} stream(s): decode step {step_ms:.2f} ms; in it, "
        f"the layers' linears and attention {layers_ms:.2f} ms (attention "
        f"{best['attention']:.2f}) and the LM head {head_ms:.2f} ms: "
        f"{100 * result['outside_kernels']:.0f}% outside them, of which the layers' small ops "
        f"{result['in_step_layers_small_ops_ms']:.2f}, the rest of the forward "
        f"{result['in_step_forward_rest_ms']:.2f}, of sampling "
        f"{result['in_step_sampling_rest_ms']:.2f}, outside the model runner "
        f"{result['outside_model_runner_ms']:.2f}"
    )
    if kernels is not None:
        result["kernels_alone_ms"] = kernel_ms
        result["outside_kernels_alone"] = 1 - kernel_ms / step_ms
        print(
            f"the kernels alone, from Python: {kernel_ms:.2f} ms, "
            f"{100 * result['outside_kernels_alone']:.0f}% outside them"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
