"""Sliding-window models against transformers, token for token in float32, with windows of 12
tokens that most prompts exceed: Mistral (every layer windowed) alone, batched, in chunks,
from the prefix cache and after preemption; Qwen2 with max_window_layers (layer 0 full,
layer 1 windowed) batched in chunks."""

from __future__ import annotations

from pathlib import Path

import pytest

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
