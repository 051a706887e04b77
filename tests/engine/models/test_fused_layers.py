"""The decoder layers as native ops give bit-identical results to the Python layers: the same
kernels on the same tensors, only the dispatch moved to C++, all the layers in one call."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention.backend import allocate_kv_cache
from engine.attention.metadata import build_attention_metadata
from engine.attention.native_backend import NativeCpuAttentionBackend
from engine.config import QuantConfig
from engine.models import fused_layers
from engine.models.llama import DecoderModel
from engine.models.loader import load_model
from engine.models.moe import SparseMoE
from tests.tiny_models import make_tiny_model

# A step mixing a decode over a long history, a prefill chunk over history, and a new prompt.
COMPUTED, NEW = [37, 16, 0], [1, 9, 20]
TABLES = [[3, 0, 7], [5, 2], [1, 4]]


def forward(model: DecoderModel, fused: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states, KV cache after the step), from a random KV history."""
    arch, dtype = model.arch, model.norm.weight.dtype
    cache = allocate_kv_cache(
        arch.num_layers, 8, 16, arch.num_kv_heads, arch.head_dim, dtype, "cpu"
    )
    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(seed)))
    backend = NativeCpuAttentionBackend(cache, arch.num_heads, arch.head_dim**-0.5)
    md = build_attention_metadata(COMPUTED, NEW, TABLES, 16)
    backend.plan(md)
    ids = torch.randint(3, 256, (md.num_tokens,), generator=torch.Generator().manual_seed(seed))
    layers, dense_layers = model.fused_layers, model.fused_dense_layers
    if not fused:
        model.fused_layers = model.fused_dense_layers = None
    try:
        with torch.inference_mode():
            return model(ids, md.positions, backend), cache
    finally:
        model.fused_layers, model.fused_dense_layers = layers, dense_layers


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize(
    ("dtype", "quant"),
    [
        (torch.float32, QuantConfig("none")),
        (torch.bfloat16, QuantConfig("none")),
        (torch.bfloat16, QuantConfig("int4")),
        (torch.float32, QuantConfig("int8")),
        (torch.bfloat16, QuantConfig("int4", dense_copy=True)),
        (torch.float32, QuantConfig("int8", dense_copy=True)),
    ],
    ids=["f32", "bf16", "bf16-int4", "f32-int8", "bf16-int4-dense", "f32-int8-dense"],
)
def test_native_layers_equal_python_layers(
    tmp_path: Path, kind: str, dtype: torch.dtype, quant: QuantConfig
) -> None:
    model, _ = load_model(make_tiny_model(kind, tmp_path), dtype, "cpu", quant)
    assert model.fused_layers is not None and len(model.fused_layers) == model.arch.num_layers
    assert (model.fused_dense_layers is not None) == quant.dense_copy
    python_hidden, python_cache = forward(model, fused=False, seed=1)
    native_hidden, native_cache = forward(model, fused=True, seed=1)
    assert torch.equal(native_hidden, python_hidden)
    assert torch.equal(native_cache, python_cache)  # the same K/V written to the same slots


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [("qwen3_moe", torch.float32), ("mixtral", torch.bfloat16)],
    ids=["qwen3_moe-f32", "mixtral-bf16"],
)
def test_native_layers_with_sparse_mlps_equal_python_layers(
    tmp_path: Path, kind: str, dtype: torch.dtype
) -> None:
    """Mixture-of-experts layers run in the stack too (their MLPs through moe_ops.cpp), to
    the bit as the Python layers with SparseMoE's Python path."""
    model, _ = load_model(make_tiny_model(kind, tmp_path), dtype, "cpu", QuantConfig())
    assert model.fused_layers is not None and len(model.fused_layers) == model.arch.num_layers
    sparse = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    assert sparse and all(mlp.native is not None for mlp in sparse)
    native_hidden, native_cache = forward(model, fused=True, seed=4)
    packed = [mlp.native for mlp in sparse]
    for mlp in sparse:
        mlp.native = None  # SparseMoE.forward takes its Python path
    try:
        python_hidden, python_cache = forward(model, fused=False, seed=4)
    finally:
        for mlp, weights in zip(sparse, packed, strict=True):
            mlp.native = weights
    assert torch.equal(native_hidden, python_hidden)
    assert torch.equal(native_cache, python_cache)


def test_native_layer_refuses_a_slot_outside_the_cache(tmp_path: Path) -> None:
    model, _ = load_model(make_tiny_model("llama", tmp_path), torch.float32, "cpu", QuantConfig())
    arch = model.arch
    cache = allocate_kv_cache(arch.num_layers, 8, 16, arch.num_kv_heads, arch.head_dim,
                              torch.float32, "cpu")  # fmt: skip
    backend = NativeCpuAttentionBackend(cache, arch.num_heads, arch.head_dim**-0.5)
    md = build_attention_metadata(COMPUTED, NEW, TABLES, 16)
    md.slot_mapping[3] = 8 * 16  # one past the last slot
    backend.plan(md)
    ids = torch.randint(3, 256, (md.num_tokens,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), pytest.raises(RuntimeError, match="outside the cache"):
        model(ids, md.positions, backend)


def test_one_native_call_runs_the_whole_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedding, the rotary rows, every layer and the final norm in one native call:
    none of the Python modules' own ops runs."""
    model, _ = load_model(make_tiny_model("llama", tmp_path), torch.float32, "cpu", QuantConfig())
    assert model.arch.num_layers > 1 and model.fused_layers is not None
    assert model.fused_layers.has_ends
    op, calls = fused_layers._decoder_model_op(), []

    def counted(*args: object) -> object:
        calls.append(args)
        return op(*args)

    def not_called(*args: object) -> None:
        raise AssertionError("ran in Python")

    monkeypatch.setattr(fused_layers, "_decoder_model_op", lambda: counted)
    monkeypatch.setattr(fused_layers, "_decoder_layers_op", not_called)
    monkeypatch.setattr(model, "embed", not_called)
    monkeypatch.setattr(model.rotary, "forward", not_called)
    monkeypatch.setattr(model.norm, "add_forward", not_called)
    forward(model, fused=True, seed=2)
    assert len(calls) == 1


def test_a_model_with_its_own_embedding_runs_only_its_layers_natively(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subclass that embeds tokens its own way keeps its embedding (and so the ends) in
    Python, and its layers still run as one native op, to the bit as the Python layers."""

    class ScaledEmbedding(DecoderModel):
        def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
            return super().embed(input_ids) * 2.0

    monkeypatch.setattr("engine.models.loader._MODEL_CLASSES", {"llama": ScaledEmbedding})
    model, _ = load_model(make_tiny_model("llama", tmp_path), torch.float32, "cpu", QuantConfig())
    assert isinstance(model, ScaledEmbedding)
    assert model.fused_layers is not None and not model.fused_layers.has_ends
    op, calls = fused_layers._decoder_layers_op(), []

    def counted(*args: object) -> object:
        calls.append(args)
        return op(*args)

    monkeypatch.setattr(fused_layers, "_decoder_layers_op", lambda: counted)
    native_hidden, native_cache = forward(model, fused=True, seed=5)
    assert len(calls) == 1
    python_hidden, python_cache = forward(model, fused=False, seed=5)
    assert torch.equal(native_hidden, python_hidden)
    assert torch.equal(native_cache, python_cache)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_native_model_with_the_gguf_embedding_equals_python(
    default_model_dir: Path, dtype: torch.dtype
) -> None:
    """The default model's GGUF file as stored: its Q8_0 token table, dequantized row by
    row inside the native op, and its Q4_1 layers."""
    model, _ = load_model(default_model_dir, dtype, "cpu", QuantConfig("gguf"))
    assert model.quantized_embed is not None
    assert model.fused_layers is not None and model.fused_layers.has_ends
    python_hidden, python_cache = forward(model, fused=False, seed=6)
    native_hidden, native_cache = forward(model, fused=True, seed=6)
    assert torch.equal(native_hidden, python_hidden)
    assert torch.equal(native_cache, python_cache)


def test_kernel_time_counts_only_while_asked(tmp_path: Path) -> None:
    """benchmarks/decode_breakdown.py's in-step counter: the layers' kernels and, within
    them, attention, counted while enabled and not otherwise."""
    model, _ = load_model(make_tiny_model("llama", tmp_path), torch.float32, "cpu", QuantConfig())
    counter = torch.ops.pagedserve.kernel_time_ns
    counter(False)  # reset
    forward(model, fused=True, seed=3)
    assert tuple(counter(True)) == (0, 0)
    forward(model, fused=True, seed=3)
    kernels_ns, attention_ns = counter(False)
    assert 0 < attention_ns < kernels_ns
    forward(model, fused=True, seed=3)
    assert tuple(counter(False)) == (0, 0)
