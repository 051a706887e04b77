"""Greedy output equals transformers token for token, in float32, in every engine mode.

(a) each request alone, (b) 8 requests of different lengths together, (c) chunked
prefill, also within the partial-prefill limits, (d) shared prefixes served from the prefix
cache, also across the choices of an n > 1 request, (e) preemption. The block pool
invariants are checked after every step (check_invariants=True).
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, EngineHooks, SamplingParams
from tests.tiny_models import greedy_tokens, make_tiny_model

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Reference: transformers' generate, one unpadded prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return greedy_tokens(model, prompts, max_tokens)


def engine_tokens(
    llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY
) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def make_prompts(seed: int, lengths: list[int], vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


LENGTHS = [5, 17, 33, 48, 64, 9, 80, 23]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    prompts = make_prompts(1, LENGTHS)
    prefix = make_prompts(2, [3 * 16 + 5])[0]  # more than 3 blocks of 16
    shared = [prefix + tail for tail in make_prompts(3, [4, 11, 1, 20])]
    reference = hf_greedy(path, prompts + shared, MAX_TOKENS)
    return path, prompts, shared, reference[: len(prompts)], reference[len(prompts) :]


# Every step of every test here verifies the KV block pool.
CHECKED = EngineHooks(check_invariants=True)


def tiny_llm(path: Path, **kwargs: object) -> LLM:
    options: dict[str, object] = dict(
        dtype="float32", block_size=16, num_kv_blocks=128, max_model_len=256
    )
    options.update(kwargs)
    return LLM(str(path), hooks=CHECKED, **options)


def test_each_request_alone(tiny) -> None:
    path, prompts, _, reference, _ = tiny
    llm = tiny_llm(path, enable_prefix_caching=False)
    assert [engine_tokens(llm, [p])[0] for p in prompts] == reference


def test_eight_requests_batched(tiny) -> None:
    path, prompts, _, reference, _ = tiny
    assert engine_tokens(tiny_llm(path), prompts) == reference


def test_chunked_prefill(tiny) -> None:
    path, prompts, _, reference, _ = tiny
    assert engine_tokens(tiny_llm(path, max_num_batched_tokens=16), prompts) == reference


@pytest.mark.parametrize(
    ("limits", "chunks"),
    [
        (dict(long_prefill_token_threshold=8), (8, 0, 0.0)),
        (dict(long_prefill_token_threshold=12, max_num_partial_prefills=3), (12, 0, 0.0)),
        (dict(max_num_partial_prefills=2, max_long_partial_prefills=2), (10, 64, 1.0)),
        (dict(max_num_batched_tokens=96), (0, 64, 1.0)),
        (dict(max_num_batched_tokens=96, prefill_time_beside_decodes=0.01), (0, 64, 0.01)),
    ],
    ids=[
        "threshold-8",
        "threshold-12-three-partial",
        "two-long-partial",
        "beside-decodes",
        "beside-decodes-in-time",
    ],
)
def test_partial_prefill_limits(
    tiny, limits: dict[str, Any], chunks: tuple[int, int, float]
) -> None:
    """Chunks capped by --long-prefill-token-threshold, several prompts part-way at once
    (with two and no threshold given, it is 4% of max_model_len: 10 tokens here), and the
    CPU's default caps in a step that also decodes: 64 tokens until the steps are timed,
    then --prefill-time-beside-decodes' (at a ratio of 0.01, step_cost.MIN_TOKENS)."""
    path, prompts, _, reference, _ = tiny
    llm = tiny_llm(path, **{"max_num_batched_tokens": 32, **limits})
    config = llm.core.scheduler.config
    assert (
        config.long_prefill_token_threshold,
        config.prefill_chunk_beside_decodes,
        config.prefill_time_beside_decodes,
    ) == chunks
    caps: list[int] = []
    if config.prefill_time_beside_decodes:
        # The steps' times as a fixed cost would give them (1 ms, 2 ms a decode, 1 ms a
        # prompt token): a tiny model's wall-clock times are mostly noise, whose fit may
        # find no cost per token, and then the cap in time never applies.
        scheduler = llm.core.scheduler

        def observe(seconds: float) -> None:
            decodes, tokens = scheduler.last_step_mix
            scheduler.step_cost.observe(decodes, tokens, (1 + 2 * decodes + tokens) / 1e3)
            caps.append(scheduler.prefill_tokens_beside_decodes())

        scheduler.observe_step_time = observe  # type: ignore[method-assign]
    assert engine_tokens(llm, prompts) == reference
    if config.prefill_time_beside_decodes:  # the cap in time applied: 32 tokens, not 64
        assert llm.core.scheduler.step_cost.ms_per_token() == pytest.approx(1.0, rel=1e-2)
        assert 32 in caps and caps[0] == 64


def test_prefix_cache_hits(tiny) -> None:
    path, _, shared, _, reference = tiny
    llm = tiny_llm(path)
    first = engine_tokens(llm, shared[:1])
    outputs = llm.generate(shared[1:], GREEDY)
    assert first + [o.outputs[0].token_ids for o in outputs] == reference
    assert llm.core.scheduler.kv_cache.counters.hits > 0
    assert all(o.num_cached_tokens >= 48 for o in outputs)
    # Same-batch sharing: all four at once, from a cold cache.
    assert engine_tokens(tiny_llm(path), shared) == reference


def test_n_greedy_choices_share_the_prefix(tiny) -> None:
    """n=3 greedy: every choice equals transformers; the 2nd and 3rd reuse the 1st's full
    prompt blocks (admitted in the same step), and a later prompt with the same prefix
    reports them as cached."""
    path, _, shared, _, reference = tiny
    llm = tiny_llm(path)
    counters = llm.core.scheduler.kv_cache.counters
    params = replace(GREEDY, n=3)
    (first,) = llm.generate([shared[0]], params)
    assert [c.token_ids for c in first.outputs] == [reference[0]] * 3
    prefix_hit = 3 * 16  # the shared prefix holds three full blocks
    assert counters.hits == 2 * prefix_hit and first.num_cached_tokens == 0
    (second,) = llm.generate([shared[1]], params)
    assert [c.token_ids for c in second.outputs] == [reference[1]] * 3
    assert counters.hits == 5 * prefix_hit and second.num_cached_tokens == prefix_hit


def test_preemption(tiny) -> None:
    path, prompts, _, reference, _ = tiny
    llm = tiny_llm(path, num_kv_blocks=10, max_model_len=160)
    assert engine_tokens(llm, prompts) == reference
    assert llm.core.scheduler.total_preemptions > 0


def test_llama3_rope_scaling(tmp_path: Path) -> None:
    path = make_tiny_model("llama3-rope", tmp_path)
    prompts = make_prompts(4, [70, 90])
    assert engine_tokens(tiny_llm(path), prompts) == hf_greedy(path, prompts, MAX_TOKENS)


def test_long_context_decodes(tmp_path: Path) -> None:
    """Decodes over 512 keys or more attend in parts (4 at 520 keys, 8 from about 1024),
    merged after (engine/ops/csrc/attention_ops.cpp), alone and beside each other."""
    path = make_tiny_model("llama", tmp_path, max_position_embeddings=2048)
    prompts = make_prompts(5, [520, 1030, 1500])
    reference = hf_greedy(path, prompts, MAX_TOKENS)
    llm = tiny_llm(path, num_kv_blocks=200, max_model_len=2048, max_num_batched_tokens=2048)
    assert engine_tokens(llm, prompts) == reference
    assert [engine_tokens(llm, [p])[0] for p in prompts] == reference


@pytest.mark.slow
def test_default_model_all_modes(default_model_dir: Path) -> None:
    """The bundled SmolLM2, float32, prompts of 32+ tokens, stopping at EOS like HF."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    texts = [
        "The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type with an oil-based ink and a screw press "
        "borrowed from the wine makers of the Rhine valley",
        "Photosynthesis is the process by which green plants and some other organisms use "
        "sunlight to synthesize foods from carbon dioxide and water. In most plants the "
        "process takes place in the leaves, where",
        "Write a short poem about the sea. The waves roll in under a grey morning sky, and "
        "the gulls cry out above the harbour where the fishing boats rock gently at their "
        "moorings, waiting for",
        'def fibonacci(n):\n    """Return the n-th Fibonacci number, computed iteratively '
        "so that large inputs do not overflow the recursion limit of the interpreter, which "
        'is a thousand frames by default."""\n',
    ]
    prompts = [tokenizer.encode(t) for t in texts]
    assert min(len(p) for p in prompts) >= 32
    reference = hf_greedy_stop(default_model_dir, prompts, 16)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    options: dict = dict(dtype="float32", max_model_len=512, hooks=CHECKED)

    llm = LLM(str(default_model_dir), num_kv_blocks=128, enable_prefix_caching=False, **options)
    assert [engine_tokens(llm, [p], params)[0] for p in prompts] == reference  # (a)
    llm = LLM(str(default_model_dir), num_kv_blocks=128, **options)
    assert engine_tokens(llm, prompts, params) == reference  # (b)
    shared = [prompts[0] + p for p in prompts[1:]]
    shared_ref = hf_greedy_stop(default_model_dir, shared, 16)
    assert engine_tokens(llm, shared, params) == shared_ref  # (d)
    assert llm.core.scheduler.kv_cache.counters.hits > 0
    chunked = LLM(str(default_model_dir), num_kv_blocks=128, max_num_batched_tokens=16, **options)
    assert engine_tokens(chunked, prompts, params) == reference  # (c)
    options["max_model_len"] = 128
    small = LLM(str(default_model_dir), num_kv_blocks=14, **options)
    assert engine_tokens(small, prompts + shared, params) == reference + shared_ref  # (e)
    assert small.core.scheduler.total_preemptions > 0


def hf_greedy_stop(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outputs = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs
