"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral): greedy output equals transformers'
token for token in float32, alone, batched, in chunks, from the prefix cache and after
preemption; which layers are sparse follows transformers' rule; what the experts cannot
run on (int8/int4 quantization made at load, several ranks) is refused at load. GGUF files:
tests/engine/models/test_gguf_moe.py.

One tiny model per variant: Qwen3-MoE with a dense layer and unnormalised top-k weights,
Qwen3-MoE with normalised ones, Mixtral with a sliding window (longer than the prompts).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, EngineArgs
from engine.config import resolve_model_config
from engine.models import fused_layers
from engine.models.arch import ModelArch
from engine.models.loader import load_model
from engine.models.moe import SparseMoE
from tests.engine.models.arch_cases import MODES, PARAMS, ArchCase, check_mode, make_case
from tests.engine.test_correctness import engine_tokens, tiny_llm
from tests.tiny_models import make_config, make_tiny_model

VARIANTS = {
    "qwen3_moe-dense-layer": ("qwen3_moe", dict(norm_topk_prob=False, mlp_only_layers=[0])),
    "qwen3_moe-norm-topk": ("qwen3_moe", dict(norm_topk_prob=True)),
    "mixtral": ("mixtral", dict(sliding_window=256)),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ArchCase:
    kind, overrides = VARIANTS[request.param]
    return make_case(kind, tmp_path_factory.mktemp(request.param), **overrides)


def test_some_layers_are_sparse_and_run_natively(
    moe: ArchCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The greedy tests below run the sparse MLPs natively: every layer in the one-call
    native model op (the cpu-native attention backend), the sparse MLPs through
    moe_ops.cpp. (With other backends SparseMoE.forward calls that op alone: tests/engine/
    ops/test_sparse_moe.py, and test_gguf_moe.py's logits.)"""
    op, calls = fused_layers._decoder_model_op(), []

    def counted(*args: object) -> object:
        calls.append(args)
        return op(*args)

    monkeypatch.setattr(fused_layers, "_decoder_model_op", lambda: counted)
    llm = tiny_llm(moe.path)
    assert llm.core.config.device.attention_backend == "cpu-native"
    model = llm.core.runner.model
    sparse = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    assert sparse and all(mlp.native is not None for mlp in sparse)
    assert model.fused_layers is not None and len(model.fused_layers) == len(model.layers)
    assert engine_tokens(llm, moe.prompts[:1], PARAMS) == moe.reference[:1]
    assert calls


@pytest.mark.parametrize("mode", MODES)
def test_greedy_matches_transformers(moe: ArchCase, mode: str) -> None:
    check_mode(moe, mode)


def test_sparse_layers_follow_transformers() -> None:
    """decoder_sparse_step and mlp_only_layers pick the sparse layers as transformers does."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = make_config("qwen3_moe")
    config.update(dict(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]))
    theirs = AutoModelForCausalLM.from_config(config).model.layers
    sparse = Qwen3MoeSparseMoeBlock
    expected = tuple(i for i, layer in enumerate(theirs) if isinstance(layer.mlp, sparse))
    arch = ModelArch.from_hf_config(config)
    assert arch.moe_layers == expected == (1, 5)
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (8, 2, 32)
    mixtral = ModelArch.from_hf_config(make_config("mixtral"))
    assert mixtral.moe_layers == (0, 1) and mixtral.norm_topk_prob and not mixtral.qk_norm


def test_mixtral_sliding_window_does_not_cap_max_model_len(tmp_path: Path) -> None:
    """Attention honours the window, so sequences run past it (tests/engine/models/
    test_sliding_window_models.py checks the outputs)."""
    path = make_tiny_model("mixtral", tmp_path, sliding_window=128)
    config = resolve_model_config(EngineArgs(model=str(path), max_model_len=256))
    assert config.max_model_len == 256 and config.arch.kv_window == 128


def test_stacked_experts_load_as_per_expert_ones(tmp_path: Path) -> None:
    """transformers 5 holds a layer's experts as 3-D tensors (save_pretrained writes them
    per expert, with Mixtral's own names): a checkpoint of the 3-D tensors loads the same."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    per_expert = make_tiny_model("mixtral", tmp_path / "per_expert")
    state = AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float32).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    shutil.copy(per_expert / "config.json", stacked)
    save_file({name: t.contiguous() for name, t in state.items()}, stacked / "model.safetensors")
    ours = dict(load_model(stacked, torch.float32, "cpu")[0].named_parameters())
    expected = dict(load_model(per_expert, torch.float32, "cpu")[0].named_parameters())
    assert ours.keys() == expected.keys()
    assert all(torch.equal(ours[name], expected[name]) for name in ours)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_refuses_quantization(qwen3_moe: Path, method: str) -> None:
    with pytest.raises(ValueError, match=f"--quantization {method} is not supported for mixture"):
        LLM(str(qwen3_moe), dtype="float32", quantization=method)


def test_refuses_tensor_parallelism(qwen3_moe: Path) -> None:
    with pytest.raises(ValueError, match="cannot shard a mixture-of-experts model"):
        LLM(str(qwen3_moe), dtype="float32", tensor_parallel_size=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemms_equal_the_expert_loop(dtype: torch.dtype) -> None:
    """SparseMoE.grouped (a GPU's path in bfloat16: two torch._grouped_mm calls over the
    stacked experts) against the loop over experts, on the CPU, where torch runs the same
    op: 40 tokens, top-2 of 8 experts, some experts without a token."""
    config = make_config("qwen3_moe")
    config.update(dict(hidden_size=64, moe_intermediate_size=48, norm_topk_prob=True))
    torch.manual_seed(0)
    moe = SparseMoE(ModelArch.from_hf_config(config)).to(dtype)
    for param in moe.parameters():
        param.data.normal_(0, 0.2)
    x = torch.randn(40, 64, dtype=dtype)
    moe.gate.weight.data[2:5] -= 100.0  # experts 2-4 get no token
    expected = moe.reference(x)
    moe.pack_grouped()
    assert moe.stacked is not None and moe.stacked[0].shape == (8, 96, 64)
    # The experts' weights are views of the stacks: one copy of them.
    first = moe.experts[3].down_proj.weight
    assert first is not None and first.data_ptr() == moe.stacked[1][3].data_ptr()
    grouped = moe(x)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grouped, expected, rtol=tolerance, atol=tolerance)
    assert moe.reference(x).equal(expected)  # the loop is unchanged on the views
