"""Which models screen their LM head's greedy tokens (engine/models/head_screen.py), and that
the engine's greedy tokens are the same with the screen and without it, one stream or a few
at once. (tests/engine/ops/test_head_screen.py checks the op itself.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import QuantConfig
from engine.models.layers import bf16_tileable
from engine.models.loader import load_model
from engine.ops.loader import native_kernels
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(
    not (native_kernels().available and bf16_tileable(torch.zeros(16, 32, dtype=torch.bfloat16))),
    reason="the bfloat16 head is not tiled on this CPU",
)


def test_greedy_tokens_are_the_same_with_the_screen_and_without(tmp_path: Path) -> None:
    path = make_tiny_model("llama", tmp_path, vocab_size=4096)
    llm = LLM(str(path), dtype="bfloat16", max_model_len=256)
    model = llm.core.runner.model
    screen = model.head_screen
    assert screen is not None and screen.weight.shape[0] == model.dense_head.out_features
    prompts = [[5 + 7 * i + j for j in range(12 + i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def tokens(batch: list[list[int]]) -> list[list[int]]:
        return [out.outputs[0].token_ids for out in llm.generate(batch, params)]

    hidden: list[torch.Tensor] = []
    greedy = model.greedy_tokens

    def spy(rows: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        hidden.append(rows.clone())
        return greedy(rows, vocab_size)

    model.greedy_tokens = spy
    screened = [tokens(prompts[:1]), tokens(prompts[:3])]
    # The screen decided most steps itself (an empty list: the whole head ran).
    decided = [
        len(torch.ops.pagedserve.bf16_linear_screen_tiles(h, 4096, screen.weight, screen.bounds))
        > 0
        for h in hidden
    ]
    assert len(hidden) >= 48 and sum(decided) >= 0.8 * len(decided)
    model.head_screen = None
    whole = [tokens(prompts[:1]), tokens(prompts[:3])]
    assert screened == whole


def test_models_whose_greedy_tokens_skip_the_head_kernel_build_none(tmp_path: Path) -> None:
    """Gemma 3's soft-capped logits, and a quantized head (its own kernel at a few rows)."""
    capped, _ = load_model(make_tiny_model("gemma3", tmp_path / "g"), torch.bfloat16, "cpu")
    assert capped.arch.final_logit_softcapping is not None and capped.head_screen is None
    plain, _ = load_model(make_tiny_model("llama", tmp_path / "l"), torch.bfloat16, "cpu")
    assert plain.head_screen is not None


def test_the_default_models_quantized_head_has_no_screen(default_model_dir: Path) -> None:
    model, _ = load_model(
        default_model_dir, torch.bfloat16, "cpu", QuantConfig("gguf", dense_copy=True)
    )
    assert model.quantized_head is not None and model.head_screen is None
