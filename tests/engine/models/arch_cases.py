"""The engine modes every architecture is checked in, token for token against transformers'
greedy output in float32: each request alone and all batched, chunked prefill, a prefix-cache
hit, and preemption. One case per tiny model; test modules parametrize over MODES."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine import EngineArgs, SamplingParams
from engine.config import resolve_model_config
from engine.kv_cache.groups import KVCacheGroups, blocks_for_one_request
from tests.engine.test_correctness import engine_tokens, hf_greedy, make_prompts, tiny_llm
from tests.tiny_models import make_tiny_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# Most cross a block boundary while decoding, so a small cache must preempt.
LENGTHS = [13, 30, 45, 14, 62, 7]
MODES = ["alone-and-batched", "chunked-prefill", "prefix-cache-hit", "preemption"]


@dataclass(frozen=True)
class ArchCase:
    path: Path
    prompts: list[list[int]]
    shared: list[list[int]]  # a two-block prefix and different tails
    reference: list[list[int]]
    shared_reference: list[list[int]]


def make_case(kind: str, path: Path, **overrides: object) -> ArchCase:
    path = make_tiny_model(kind, path, **overrides)
    prompts = make_prompts(1, LENGTHS)
    prefix = make_prompts(2, [2 * 16 + 3])[0]  # two full blocks of 16 and a bit
    shared = [prefix + tail for tail in make_prompts(3, [4, 11, 1])]
    reference = hf_greedy(path, prompts + shared, PARAMS.max_tokens)
    return ArchCase(path, prompts, shared, reference[: len(prompts)], reference[len(prompts) :])


def check_mode(case: ArchCase, mode: str) -> None:
    """Asserts the engine's greedy tokens equal transformers' in `mode`."""
    if mode == "alone-and-batched":
        llm = tiny_llm(case.path, enable_prefix_caching=False)
        assert [engine_tokens(llm, [p], PARAMS)[0] for p in case.prompts] == case.reference
        assert engine_tokens(llm, case.prompts, PARAMS) == case.reference
    elif mode == "chunked-prefill":
        llm = tiny_llm(case.path, max_num_batched_tokens=16)
        assert engine_tokens(llm, case.prompts, PARAMS) == case.reference
    elif mode == "prefix-cache-hit":
        llm = tiny_llm(case.path)
        first = engine_tokens(llm, case.shared[:1], PARAMS)
        outputs = llm.generate(case.shared[1:], PARAMS)
        assert first + [o.outputs[0].token_ids for o in outputs] == case.shared_reference
        assert all(o.num_cached_tokens == 32 for o in outputs)
    else:
        assert mode == "preemption"
        llm = tiny_llm(case.path, max_model_len=96, **smallest_cache(case.path, 96))
        assert engine_tokens(llm, case.prompts, PARAMS) == case.reference
        assert llm.core.scheduler.total_preemptions > 0


def smallest_cache(path: Path, max_model_len: int) -> dict[str, int]:
    """tiny_llm's options for the smallest cache one request of max_model_len fits: 6
    blocks of 16, or for a hybrid model (KV cache groups: sliding layers beside full ones)
    a block table's worth in the full groups and a window's in the sliding ones, with
    chunks of a block."""
    arch = resolve_model_config(EngineArgs(model=str(path))).arch
    groups = KVCacheGroups.for_layers(arch.layer_windows)
    if not groups.hybrid:
        return {"num_kv_blocks": -(-max_model_len // 16)}
    blocks = blocks_for_one_request(groups.windows, 16, max_model_len, 16)
    return {"num_kv_blocks": blocks, "max_num_batched_tokens": 16}
