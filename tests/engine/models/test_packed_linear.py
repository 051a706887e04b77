"""oneDNN pre-packed linear layers give exactly F.linear's results, only faster (where the
bfloat16 dot-product kernel does not take their place: tests/engine/ops/test_bf16_linear.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.attention.backend import allocate_kv_cache
from engine.attention.metadata import build_attention_metadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.models.layers import Linear, bf16_tileable, onednn_packable
from engine.models.llama import DecoderModel
from engine.models.loader import WeightLoader, _iter_safetensors, load_model
from tests.tiny_models import make_tiny_model

# oneDNN packs bfloat16 only where the CPU has AVX-512 (or AVX-NE-CONVERT); elsewhere the
# tests below check the fallback instead: the plain weight, on F.linear.
ONEDNN = onednn_packable(torch.empty(1, dtype=torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_equals_f_linear(rows: int) -> None:
    dtype = torch.bfloat16
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=True)
    layer.weight.data.normal_()  # type: ignore[union-attr]
    layer.bias.data.normal_()  # type: ignore[union-attr]
    layer = layer.to(dtype)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()  # type: ignore[union-attr]
    layer.pack(tiled=False)
    if ONEDNN:
        assert layer.packed is not None and layer.weight is None
    else:
        assert layer.packed is None and layer.weight is not None
    x = torch.randn(rows, 96, dtype=dtype)
    assert torch.equal(layer(x), F.linear(x, weight, bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_dtypes_stay_on_f_linear(dtype: torch.dtype) -> None:
    layer = Linear(8, 8).to(dtype)
    layer.pack()
    assert layer.packed is None and layer.weight is not None


def logits(model: DecoderModel) -> torch.Tensor:
    arch = model.arch
    md = build_attention_metadata([0, 0], [5, 9], [[0], [1]], block_size=16)
    ids = torch.randint(3, 256, (14,), generator=torch.Generator().manual_seed(0))
    cache = allocate_kv_cache(
        arch.num_layers, 4, 16, arch.num_kv_heads, arch.head_dim, torch.bfloat16, "cpu"
    )
    backend = TorchAttentionBackend(cache, arch.num_heads, arch.head_dim**-0.5)
    backend.plan(md)
    with torch.inference_mode():
        return model.compute_logits(model(ids, md.positions, backend))


@pytest.mark.parametrize("tiled", [False, True])
def test_packed_model_gives_the_plain_models_logits(tmp_path: Path, tiled: bool) -> None:
    """oneDNN's packed layout gives identical logits; the bfloat16 kernel's tiles (where this
    CPU runs them) the same up to float32 summation order."""
    path = make_tiny_model("qwen2", tmp_path)  # qkv bias, untied head
    loaded, arch = load_model(path, torch.bfloat16, "cpu")  # load_model packs
    models = []
    for pack in (True, False):
        model = DecoderModel(arch).to(torch.bfloat16)
        WeightLoader(model, arch).load(_iter_safetensors(path))
        if pack:
            model.pack_weights(tiled=tiled)
        models.append(model.eval())
    packed, plain = models
    if tiled and bf16_tileable(plain.lm_head):  # type: ignore[arg-type]
        for model in (packed, loaded):
            assert model.dense_head is not None and model.dense_head.tiled is not None
        torch.testing.assert_close(logits(packed), logits(plain), rtol=0.05, atol=0.05)
        assert torch.equal(logits(packed), logits(loaded))
    else:
        if ONEDNN:
            assert packed.dense_head is not None and packed.dense_head.packed is not None
        assert torch.equal(logits(packed), logits(plain))
