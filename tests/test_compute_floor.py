"""benchmarks/compute_floor.py counts the arithmetic a request needs: checked against
torch's own FLOP counter on transformers' forward pass of the same configs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import compute_floor as cf

from tests.tiny_models import make_config

# A made-up shape for the counting tests that need no model.
SMALL = cf.ModelShape(
    hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1, head_dim=4, vocab=10
)


def hf_model(kind: str) -> tuple[torch.nn.Module, dict]:
    from transformers import AutoModelForCausalLM

    config = make_config(kind)
    if kind == "qwen3":
        config.head_dim = 24  # not hidden / heads (64 / 4), as in Qwen3's own configs
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval(), config.to_dict()


# llama: grouped KV heads; qwen2: q/k/v biases (adds, which the counter leaves out);
# qwen3: a head_dim of its own.
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_a_prefill_counts_as_transformers_forward_does(kind: str) -> None:
    model, config = hf_model(kind)
    shape = cf.ModelShape.from_config(config)
    n = 37
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(torch.randint(0, config["vocab_size"], (1, n)), logits_to_keep=1)
    counts = counter.get_flop_counts()["Global"]
    matmuls = sum(v for op, v in counts.items() if "mm" in str(op) and "bmm" not in str(op))
    bmm = sum(v for op, v in counts.items() if "bmm" in str(op))
    # A request of n prompt tokens and one output token: its linears and the one LM head
    # row are exactly transformers' 2-D matmuls.
    work = cf.request_work(shape, n, 1)
    assert matmuls == work.linears + work.lm_head
    # Eager attention scores every (query, key) pair, the masked ones too: n * n pairs in
    # the same formula, where the floor counts only the n (n + 1) / 2 visible ones.
    assert bmm == shape.attention_flops(n * n)
    assert work.attention == shape.attention_flops(n * (n + 1) // 2)


def test_a_run_counts_each_requests_tokens_and_skips_failed_ones() -> None:
    shape = SMALL
    # The last generated token is never fed back: 5 + 3 - 1 = 7 tokens through the layers.
    one = cf.request_work(shape, 5, 3)
    assert one.linears == 7 * shape.token_flops()
    assert one.lm_head == 3 * shape.lm_head_flops()
    assert one.attention == shape.attention_flops(7 * 8 // 2)
    requests = [
        {"prompt_tokens": 5, "output_tokens": 3, "error": None},
        {"prompt_tokens": 5, "output_tokens": 3, "error": None},
        {"prompt_tokens": 9, "output_tokens": 0, "error": "HTTP 500"},
    ]
    assert cf.run_work(shape, requests).total == 2 * one.total


def test_the_report_puts_the_runs_wall_time_against_the_floor(tmp_path: Path) -> None:
    shape = SMALL
    requests = [{"prompt_tokens": 5, "output_tokens": 3, "error": None}] * 4
    total = cf.run_work(shape, requests).total
    run = tmp_path / "run.json"
    summary = {"output_tokens": 12, "wall_s": 2.0, "output_tokens_per_s": 6.0}
    run.write_text(json.dumps({"label": "x", "summary": summary, "requests": requests}))
    r = cf.report(run, shape, gflops=total / 1e9)  # a rate that does the work in 1 s
    assert r["floor_s"] == pytest.approx(1.0)
    assert r["share_of_floor"] == pytest.approx(0.5)
    assert r["floor_tokens_per_s"] == pytest.approx(12.0)


def test_a_run_without_prompt_token_counts_has_no_floor(tmp_path: Path) -> None:
    """serve_bench records None for a text prompt to a server that reports no usage (its
    characters are not tokens): the floor refuses such a run rather than count them."""
    shape = SMALL
    requests = [
        {"prompt_tokens": 5, "output_tokens": 3, "error": None},
        {"prompt_tokens": None, "output_tokens": 3, "error": None},
    ]
    with pytest.raises(ValueError, match="no prompt token count"):
        cf.run_work(shape, requests)


def test_a_run_without_per_request_records_has_no_floor(tmp_path: Path) -> None:
    """Both callers (compute_floor's main and compare_servers --floor) print "no floor" for a
    ValueError and go on to the next run."""
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"label": "x", "summary": {"output_tokens": 1, "wall_s": 1.0}}))
    with pytest.raises(ValueError, match="no per-request records"):
        cf.report(run, SMALL, gflops=1.0)
