"""Tensor parallelism on the CPU: two ranks over gloo give transformers' greedy tokens (so
TP=1's) in float32, alone, batched, chunked, from the prefix cache and after preemption;
their logprobs match TP=1's within a stated tolerance; shapes that cannot shard are refused.

Each TP engine starts a worker process and loads the model twice, so the tests share few
engines and small models.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine import LLM, EngineHooks, SamplingParams
from tests.engine.test_correctness import (
    GREEDY,
    LENGTHS,
    MAX_TOKENS,
    engine_tokens,
    hf_greedy,
    hf_greedy_stop,
    make_prompts,
)
from tests.tiny_models import make_tiny_model

CHECKED = EngineHooks(check_invariants=True)
# float32 logprobs of TP=2 against TP=1: the two sum the same products in another order
# (one all-reduce per row-parallel layer), which moves them by float32 rounding only.
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GQA (4 query, 2 KV heads) with qkv biases: every sharded section has a bias."""
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2"))


def tp_llm(path: Path, size: int = 2, **kwargs: object) -> LLM:
    options: dict[str, object] = dict(
        dtype="float32", block_size=16, num_kv_blocks=128, max_model_len=256
    )
    options.update(kwargs)
    return LLM(str(path), hooks=CHECKED, tensor_parallel_size=size, **options)


def test_two_ranks_alone_batched_and_from_the_prefix_cache(qwen2: Path) -> None:
    prompts = make_prompts(1, LENGTHS)
    prefix = make_prompts(2, [3 * 16 + 5])[0]
    shared = [prefix + tail for tail in make_prompts(3, [4, 11, 1, 20])]
    reference = hf_greedy(qwen2, prompts + shared, MAX_TOKENS)
    llm = tp_llm(qwen2)
    try:
        assert engine_tokens(llm, prompts[:1]) == reference[:1]  # alone
        assert engine_tokens(llm, prompts) == reference[: len(prompts)]  # batched
        hits_before = llm.core.scheduler.kv_cache.counters.hits
        assert engine_tokens(llm, shared) == reference[len(prompts) :]
        assert llm.core.scheduler.kv_cache.counters.hits - hits_before >= 3 * 48
        logprobs = tp_logprobs(llm, prompts[:3])
    finally:
        llm.close()
    single = LLM(str(qwen2), dtype="float32", block_size=16, num_kv_blocks=128, max_model_len=256)
    expected = tp_logprobs(single, prompts[:3])
    diff = max(abs(a - b) for a, b in zip(logprobs, expected, strict=True))
    print(f"TP=2 vs TP=1 top-5 logprobs, max abs diff {diff:.2e} (tolerance {LOGPROB_TOLERANCE})")
    assert diff <= LOGPROB_TOLERANCE


def tp_logprobs(llm: LLM, prompts: list[list[int]]) -> list[float]:
    """The chosen token's and the top-5 logprobs of every greedy step, flattened."""
    params = replace(GREEDY, logprobs=5)
    values = []
    for output in llm.generate(prompts, params):
        completion = output.outputs[0]
        assert completion.logprobs is not None
        for step in completion.logprobs:
            values += [step.logprob, *(logprob for _, logprob in step.top)]
    return values


def test_two_ranks_chunked_and_preempted(qwen2: Path) -> None:
    prompts = make_prompts(1, LENGTHS)
    reference = hf_greedy(qwen2, prompts, MAX_TOKENS)
    llm = tp_llm(qwen2, num_kv_blocks=10, max_model_len=160, max_num_batched_tokens=16)
    try:
        assert engine_tokens(llm, prompts) == reference
        assert llm.core.scheduler.total_preemptions > 0
    finally:
        llm.close()


@pytest.mark.parametrize(
    ("size", "overrides", "message"),
    [
        (4, {}, "2 KV heads do not divide by 4"),
        (3, {}, "4 attention heads do not divide by 3"),
        (2, {"quantization": "int8"}, "--quantization int8 cannot run"),
        (0, {}, "must be positive"),
    ],
)
def test_refuses_what_cannot_shard(
    qwen2: Path, size: int, overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        tp_llm(qwen2, size, **overrides)


@pytest.mark.slow
def test_default_model_on_three_ranks(default_model_dir: Path) -> None:
    """SmolLM2-135M has 9 query and 3 KV heads: two ranks cannot split them (refused, as
    vLLM refuses it), three can. Chunked, with a prefix hit and preemption, in float
    weights (--quantization auto means none under tensor parallelism)."""
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match="9 attention heads do not divide by 2"):
        LLM(str(default_model_dir), dtype="float32", tensor_parallel_size=2)

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    texts = [
        "The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type with an oil-based ink and a screw press",
        "Photosynthesis is the process by which green plants and some other organisms use "
        "sunlight to synthesize foods from carbon dioxide and water. In most plants",
    ]
    prompts = [tokenizer.encode(t) for t in texts]
    prefixed = [prompts[0] + prompts[1], prompts[1] + prompts[0]]
    reference = hf_greedy_stop(default_model_dir, prompts + prefixed, 8)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    llm = LLM(
        str(default_model_dir),
        hooks=CHECKED,
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=8,
        max_num_batched_tokens=16,
        tensor_parallel_size=3,
    )
    try:
        assert llm.config.quant.method == "none"
        assert engine_tokens(llm, prompts[:1], params) == reference[:1]
        assert engine_tokens(llm, prompts + prefixed, params) == reference
        assert llm.core.scheduler.kv_cache.counters.hits > 0
        assert llm.core.scheduler.total_preemptions > 0
    finally:
        llm.close()
    assert torch.distributed.is_initialized() is False
