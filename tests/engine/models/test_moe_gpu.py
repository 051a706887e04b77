"""Sparse MLPs on a CUDA GPU (run on a GPU host: `pytest -m gpu`; skipped without CUDA):
in bfloat16 on compute capability 9 or more (H100, H200) each layer's experts run as two
grouped GEMMs (SparseMoE.grouped, torch._grouped_mm), checked against a float64 loop over
the experts, in a module and in a loaded model that generates. On an older GPU the loop
runs, and the tests check that it is the one chosen."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.arch import ModelArch
from engine.models.loader import load_model
from engine.models.moe import SparseMoE, grouped_gemm_runs
from tests.engine.test_correctness import make_prompts
from tests.tiny_models import make_config, make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = dict(hidden_size=128, moe_intermediate_size=64, norm_topk_prob=True)


def grouped_expected() -> bool:
    return torch.cuda.get_device_capability()[0] >= 9


def test_grouped_experts_match_a_float64_loop() -> None:
    config = make_config("qwen3_moe")
    config.update(SHAPES)
    torch.manual_seed(0)
    moe = SparseMoE(ModelArch.from_hf_config(config)).double()
    for param in moe.parameters():
        param.data.normal_(0, 0.1)
    x = torch.randn(300, 128, dtype=torch.float64)
    expected = moe.reference(x)
    moe = moe.to("cuda", torch.bfloat16)
    x_gpu = x.to("cuda", torch.bfloat16)
    weight = moe.experts[0].gate_up_proj.weight
    assert weight is not None
    assert grouped_gemm_runs(weight, 128, 64) == grouped_expected()
    if grouped_expected():
        moe.pack_grouped()
    out = moe(x_gpu).double().cpu()
    scale = expected.abs().max().item()
    print(
        f"grouped: {moe.stacked is not None}, max error {(out - expected).abs().max() / scale:.2e}"
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=3e-2 * scale)


def test_a_loaded_model_runs_its_experts_grouped(tmp_path: Path) -> None:
    path = make_tiny_model("qwen3_moe", tmp_path, **SHAPES, intermediate_size=256)
    model, _ = load_model(path, torch.bfloat16, "cuda")
    sparse = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    assert sparse and all((m.stacked is not None) == grouped_expected() for m in sparse)
    torch.manual_seed(1)
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    for mlp in sparse:
        loop = mlp.reference(x).float()
        torch.testing.assert_close(mlp(x).float(), loop, rtol=0, atol=2e-2 * loop.abs().max())
    del model

    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=256)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outputs = llm.generate(make_prompts(1, [13, 30, 45]), params)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8, 8]
    finally:
        llm.close()
