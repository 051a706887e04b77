"""Sliding-window models against transformers, token for token in float32, with windows of 12
tokens that most prompts exceed: Mistral (every layer windowed: the KV cache manager frees
blocks out of the window) alone, batched, in chunks, from the prefix cache and after
preemption; Qwen2 with max_window_layers (layer 0 full, layer 1 windowed) batched in
chunks."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import SamplingParams
from engine.models.arch import ModelArch
from tests.engine.models.arch_cases import MODES, PARAMS, ArchCase, check_mode, make_case
from tests.engine.test_correctness import engine_tokens, hf_greedy, make_prompts, tiny_llm
from tests.tiny_models import make_config, make_tiny_model

VARIANTS = ["mistral-swa"]


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
    assert qwen2.context_limit() == (512, "")


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
