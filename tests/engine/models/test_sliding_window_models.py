"""Sliding-window models against transformers, token for token in float32, with windows of 12
tokens that most prompts exceed: Mistral (every layer windowed: the KV cache manager frees
blocks out of the window) and Gemma 3 (two local layers and a global one, Gemma3ForCausalLM),
each alone, batched, in chunks, from the prefix cache and after preemption; Qwen2 with
max_window_layers (layer 0 full, layer 1 windowed) batched in chunks; Gemma 3's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.models.arch import ModelArch
from engine.models.gemma3 import Gemma3Model
from engine.models.loader import load_model
from tests.engine.models.arch_cases import MODES, PARAMS, ArchCase, check_mode, make_case
from tests.engine.models.test_quantized_model import all_logits
from tests.engine.test_correctness import engine_tokens, hf_greedy, make_prompts, tiny_llm
from tests.tiny_models import make_config, make_tiny_model

VARIANTS = ["mistral-swa", "gemma3"]


@pytest.fixture(scope="module", params=VARIANTS)
def swa(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ArchCase:
    return make_case(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("mode", MODES)
def test_greedy_matches_transformers(swa: ArchCase, mode: str) -> None:
    check_mode(swa, mode)


def test_qwen2_max_window_layers(tmp_path: Path) -> None:
    path = make_tiny_model("qwen2-swa", tmp_path)
    prompts = make_prompts(1, [30, 45, 14])
    reference = hf_greedy(path, prompts, PARAMS.max_tokens)
    assert engine_tokens(tiny_llm(path, max_num_batched_tokens=16), prompts, PARAMS) == reference


def test_windows_per_layer_and_no_context_cap() -> None:
    assert ModelArch.from_hf_config(make_config("mistral-swa")).kv_window == 12
    qwen2 = ModelArch.from_hf_config(make_config("qwen2-swa"))
    assert qwen2.layer_windows == (None, 12) and qwen2.kv_window is None
    gemma = ModelArch.from_hf_config(make_config("gemma3"))
    assert gemma.layer_windows == (12, 12, None) and gemma.kv_window is None
    assert gemma.attention_scale == 24**-0.5 and gemma.local_rope_theta == 10000.0
    assert gemma.rope_theta == 100000.0 and gemma.rope_scaling["factor"] == 2.0
    assert gemma.context_limit() == (512, "")


def test_gemma3_logits_match_transformers(tmp_path: Path) -> None:
    """Every position's logits, soft-capped, whole and in steps of 5 tokens (decodes and
    chunks past the window)."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model("gemma3", tmp_path)
    model, arch = load_model(path, torch.float32, "cpu")
    assert isinstance(model, Gemma3Model) and arch.model_type == "gemma3_text"
    ids = torch.tensor(make_prompts(1, [62])[0])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    assert expected.abs().max() < 5.0  # the cap bounds them
    for chunk in (0, 5):
        diff = (all_logits(model, ids, chunk) - expected).abs().max().item()
        print(f"steps of {chunk or len(ids)}: max logit diff {diff:.2e}")
        assert diff < 1e-4


def test_blocks_out_of_the_window_are_freed_during_a_long_decode(tmp_path: Path) -> None:
    """Mistral's window is every layer's: one request of 70 tokens (18 blocks of 4) runs in
    a cache of 10 blocks, without preemption, only because blocks out of the window go back;
    then a request with its prompt hits the prefix cache (blocks freed while it decoded, but
    still cached) and continues as transformers does."""
    path = make_tiny_model("mistral-swa", tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = make_prompts(7, [30])[0]
    again = prompt + make_prompts(8, [5])[0]
    reference = hf_greedy(path, [prompt, again], params.max_tokens)

    small = dict(block_size=4, max_num_batched_tokens=16, max_model_len=128)
    llm = tiny_llm(path, num_kv_blocks=10, **small)
    assert engine_tokens(llm, [prompt], params) == reference[:1]
    assert llm.core.scheduler.total_preemptions == 0

    llm = tiny_llm(path, num_kv_blocks=64, **small)
    assert engine_tokens(llm, [prompt], params) == reference[:1]
    [output] = llm.generate([again], params)
    assert output.outputs[0].token_ids == reference[1]
    assert output.num_cached_tokens == 28  # the prompt's 7 full blocks


def test_a_hybrid_model_frees_its_sliding_layers_blocks(tmp_path: Path) -> None:
    """Gemma 3's sliding layers and its global one have KV cache groups of their own (one
    layer a block here), and the sliding groups give back the blocks out of their window.
    Two requests of 70 tokens (18 blocks of 4) run at once, without preemption, in 60
    blocks: one table for all three layers would need 3 * 36, and with the memory of 60
    single-layer blocks would hold 20 blocks of three layers. A prompt that hits the prefix
    cache (the global layer's blocks, and the sliding layers' blocks in its window)
    continues as transformers does."""
    path = make_tiny_model("gemma3", tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = make_prompts(9, [30, 30])
    again = prompts[0] + make_prompts(10, [5])[0]
    reference = hf_greedy(path, [*prompts, again], params.max_tokens)

    small = dict(block_size=4, max_num_batched_tokens=16, max_model_len=128)
    llm = tiny_llm(path, num_kv_blocks=60, **small)
    groups = llm.core.config.cache.groups
    assert groups is not None and groups.windows == (None, 12, 12)
    assert engine_tokens(llm, prompts, params) == reference[:2]
    assert llm.core.scheduler.total_preemptions == 0

    # A cache large enough to keep what the first request freed: the hit covers its
    # prompt's 7 full blocks, of which the sliding groups hold the 3 in the window of
    # position 28 (17..28) and skip the first 4.
    llm = tiny_llm(path, num_kv_blocks=200, **small)
    assert engine_tokens(llm, prompts[:1], params) == reference[:1]
    [output] = llm.generate([again], params)
    assert output.outputs[0].token_ids == reference[2]
    assert output.num_cached_tokens == 28
    with pytest.raises(ValueError, match="one request could never fit"):
        tiny_llm(path, num_kv_blocks=47, **small)  # 32 + 2 * 8 to run 128 tokens

    # With one table for all layers (vLLM's flag), the same memory holds 20 three-layer
    # blocks, and the two requests preempt each other; their tokens stay the same.
    llm = tiny_llm(path, num_kv_blocks=60, disable_hybrid_kv_cache_manager=True, **small)
    assert llm.core.config.cache.groups is None
    one_table = dict(small, max_model_len=80)  # 20 blocks: one request of 80 tokens
    llm = tiny_llm(path, num_kv_blocks=20, disable_hybrid_kv_cache_manager=True, **one_table)
    assert engine_tokens(llm, prompts, params) == reference[:2]
    assert llm.core.scheduler.total_preemptions > 0


def test_gemma3_refuses_what_it_does_not_run() -> None:
    config = make_config("gemma3")
    config.attn_logit_softcapping = 50.0
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        ModelArch.from_hf_config(config)
