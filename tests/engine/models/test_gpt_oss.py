"""gpt-oss (GptOssForCausalLM) against transformers in float32: greedy tokens alone, batched,
in chunks, from the prefix cache and after preemption, and every position's logits. Its tiny
model alternates a windowed layer (12 tokens) and a full one, has YaRN rope, attention sinks
and biases, and 4 experts with biases, top-2. FlashInfer is refused for attention sinks, and so are
MXFP4 checkpoints."""

from __future__ import annotations

import pytest
import torch

from engine.attention import create_backend, resolve_backend
from engine.attention.backend import allocate_kv_cache
from engine.attention.torch_backend import TorchAttentionBackend
from engine.models.arch import ModelArch
from engine.models.gpt_oss import GptOssModel
from engine.models.loader import load_model
from tests.engine.models.arch_cases import MODES, ArchCase, check_mode, make_case
from tests.engine.models.test_quantized_model import all_logits
from tests.engine.test_correctness import make_prompts
from tests.tiny_models import make_config


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> ArchCase:
    return make_case("gpt_oss", tmp_path_factory.mktemp("gpt_oss"))


@pytest.mark.parametrize("mode", MODES)
def test_greedy_matches_transformers(gpt_oss: ArchCase, mode: str) -> None:
    check_mode(gpt_oss, mode)


def test_logits_match_transformers(gpt_oss: ArchCase) -> None:
    """Whole and in steps of 5 tokens (decodes and chunks past the window)."""
    from transformers import AutoModelForCausalLM

    model, arch = load_model(gpt_oss.path, torch.float32, "cpu")
    assert isinstance(model, GptOssModel) and arch.layer_windows == (12, None)
    assert arch.rope_scaling["rope_type"] == "yarn" and len(model.layer_sinks()) == 2
    ids = torch.tensor(make_prompts(1, [62])[0])
    hf = AutoModelForCausalLM.from_pretrained(gpt_oss.path, dtype=torch.float32)
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    for chunk in (0, 5):
        diff = (all_logits(model, ids, chunk) - expected).abs().max().item()
        print(f"steps of {chunk or len(ids)}: max logit diff {diff:.2e}")
        assert diff < 1e-4


def test_flashinfer_is_refused_for_sinks() -> None:
    """The CPU backends run sinks (tests/engine/attention/test_attention_sinks.py)."""
    assert resolve_backend("auto", "cuda", torch.bfloat16, sinks=True).name == "torch"
    with pytest.raises(ValueError, match="does not implement attention sinks"):
        resolve_backend("flashinfer", "cuda", torch.bfloat16, sinks=True)
    assert resolve_backend("cpu-native", "cpu", torch.float32, sinks=True).name == "cpu-native"
    cache = allocate_kv_cache(2, 4, 16, 2, 16, torch.float32, "cpu")
    backend = create_backend("torch", cache, 4, 0.25, sinks=[torch.zeros(4)] * 2)
    assert isinstance(backend, TorchAttentionBackend) and backend.sinks[1] is not None


def test_mxfp4_checkpoints_are_refused() -> None:
    config = make_config("gpt_oss")
    config.quantization_config = {"quant_method": "mxfp4"}
    with pytest.raises(ValueError, match="quantized as 'mxfp4'"):
        ModelArch.from_hf_config(config)
