"""GGUF files of mixture-of-experts models, in llama.cpp's layout (tests/tiny_gguf.py:
Qwen3-MoE as `qwen3moe`, Mixtral as `llama` with experts, each projection's experts stacked
in one 3-D tensor), load and run:

- the config read from the file is the model's own (transformers' reader alone drops the
  experts of both);
- the file's weights, dequantized, are exactly the ones transformers holds (Q/K un-permuted
  for `llama`), from the file alone or from a directory with the config beside it;
- greedy output equals transformers' in float32 token for token, on the float weights, or on
  the quantized ones dequantized (Q8_0, Q4_0, Q4_1), batched and one request at a time;
- quantized experts stay quantized, one weight per expert that the quantized kernel runs,
  and give the logits of their dequantized float model up to float32 summation order.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.config import QuantConfig
from engine.models.arch import ModelArch
from engine.models.hf_config import load_hf_config
from engine.models.layers import Linear
from engine.models.loader import load_model
from engine.models.moe import SparseMoE
from tests.engine.models.test_quantized_model import all_logits
from tests.engine.test_correctness import engine_tokens, hf_greedy, make_prompts, tiny_llm
from tests.tiny_gguf import make_tiny_gguf

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LENGTHS = [13, 30, 5, 45]
# (model, linear weights' type, experts' type)
FILES = {
    "qwen3moe-f32": ("qwen3_moe", "F32", "F32"),
    "mixtral-f16-experts": ("mixtral", "F32", "F16"),
    "qwen3moe-q8_0": ("qwen3_moe", "Q8_0", "Q8_0"),
    "mixtral-q4_0": ("mixtral", "Q8_0", "Q4_0"),
    "qwen3moe-q4_1-experts": ("qwen3_moe", "F32", "Q4_1"),
}
FLOAT = ("F32", "F16")


@pytest.fixture(scope="module", params=list(FILES))
def model_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    kind, linear, experts = FILES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    gguf, hf_dir = make_tiny_gguf(kind, folder, linear, experts)
    return gguf, hf_dir, experts


def test_config_is_the_models(model_file) -> None:
    gguf, hf_dir, _ = model_file
    ours = ModelArch.from_hf_config(load_hf_config(gguf.parent, gguf.name))
    theirs = ModelArch.from_hf_config(load_hf_config(hf_dir, None))
    assert ours == theirs
    assert ours.num_experts == 8 and ours.moe_layers == (0, 1) and ours.norm_topk_prob


def test_dequantized_weights_are_transformers(model_file, tmp_path: Path) -> None:
    """Every parameter, loaded as float32 from the file, equals the one loaded from the
    Hugging Face twin (which holds the file's weights dequantized); so does every parameter
    loaded from a directory of the twin's config.json beside the file (as the default
    model's directory is laid out)."""
    gguf, hf_dir, _ = model_file
    beside = tmp_path / "beside"
    beside.mkdir()
    shutil.copy(hf_dir / "config.json", beside)
    shutil.copy(gguf, beside)
    expected = dict(load_model(hf_dir, torch.float32, "cpu")[0].named_parameters())
    for source in (gguf, beside):
        ours = dict(
            load_model(source, torch.float32, "cpu", QuantConfig("none"))[0].named_parameters()
        )
        assert ours.keys() == expected.keys()
        assert [name for name in ours if not torch.equal(ours[name], expected[name])] == []


def test_greedy_matches_transformers(model_file) -> None:
    gguf, hf_dir, experts = model_file
    prompts = make_prompts(1, LENGTHS)
    reference = hf_greedy(hf_dir, prompts, PARAMS.max_tokens)
    quantized = experts not in FLOAT
    llm = tiny_llm(
        gguf,
        quantization="gguf" if quantized else "none",
        quantization_dense_copy=False,
    )
    sparse = [layer.mlp for layer in llm.core.runner.model.layers]
    assert all(isinstance(mlp, SparseMoE) for mlp in sparse)
    assert all(expert_is_quantized(mlp, experts) == quantized for mlp in sparse)
    assert engine_tokens(llm, prompts, PARAMS) == reference
    assert [engine_tokens(llm, [p], PARAMS)[0] for p in prompts[:2]] == reference[:2]


def expert_is_quantized(mlp: SparseMoE, kind: str) -> bool:
    """Every expert's projections hold only their quantized weight, in `kind`'s bits."""
    bits = 8 if kind == "Q8_0" else 4
    layers: list[Linear] = [p for e in mlp.experts for p in (e.gate_up_proj, e.down_proj)]
    return all(
        layer.quantized is not None and layer.quantized.bits == bits and not layer.has_dense
        for layer in layers
    )


@pytest.mark.parametrize("dense_copy", [False, True])
def test_quantized_experts_give_their_float_models_logits(tmp_path: Path, dense_copy: bool) -> None:
    """Q4_0 experts run as stored, against the float32 model of their dequantized weights,
    prefilled at once and decoded a token a step (so the quantized kernel runs each expert
    on one row; with a dense copy, the prefill runs on the copy)."""
    gguf, hf_dir = make_tiny_gguf("qwen3_moe", tmp_path, "F32", "Q4_0", seed=1)
    quant = replace(QuantConfig("gguf"), dense_copy=dense_copy)
    model = load_model(gguf, torch.float32, "cpu", quant)[0]
    reference = load_model(hf_dir, torch.float32, "cpu")[0]
    ids = torch.tensor(make_prompts(4, [40])[0])
    expected = all_logits(reference, ids)
    for chunk in (0, 1):
        logits = all_logits(model, ids, chunk)
        diff = (logits - expected).abs().max().item()
        print(f"chunk {chunk}, dense copy {dense_copy}: max |logit diff| {diff:.2e}")
        assert diff < 1e-4 * expected.abs().max().item()
