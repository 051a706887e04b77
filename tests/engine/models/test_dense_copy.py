"""--quantization-dense-copy: quantized layers also keep their weights dequantized, and steps
of more than DENSE_COPY_ROWS tokens run on that copy. The copy is the quantized weight, not the
original float one, so results match the quantized model's own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import DENSE_COPY_ROWS, QuantConfig
from engine.models.layers import Linear
from engine.models.llama import DecoderModel
from engine.models.loader import load_model
from engine.models.quantized import MAX_KERNEL_ROWS, dequantize
from tests.tiny_models import make_tiny_model


def load(path: Path, method: str, dense_copy: bool, lm_head: bool = False) -> DecoderModel:
    quant = QuantConfig(method, lm_head=lm_head, dense_copy=dense_copy)
    return load_model(path, torch.float32, "cpu", quant)[0]


def linears(model: DecoderModel) -> list[Linear]:
    return [m for m in model.layers.modules() if isinstance(m, Linear)]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_each_quantized_layer_holds_its_own_weights_dequantized(
    tmp_path: Path, method: str
) -> None:
    model = load(make_tiny_model("llama", tmp_path), method, dense_copy=True)
    for layer in linears(model):
        assert layer.quantized is not None and layer.weight is not None  # float32: not packed
        assert torch.equal(layer.weight, dequantize(layer.quantized, torch.float32))
    assert not any(layer.has_dense for layer in linears(load(tmp_path, method, False)))


@pytest.mark.parametrize("rows", [1, DENSE_COPY_ROWS, DENSE_COPY_ROWS + 1, MAX_KERNEL_ROWS + 3])
def test_a_layer_takes_the_copy_past_a_few_rows(tmp_path: Path, rows: int) -> None:
    model = load(make_tiny_model("llama", tmp_path), "int4", dense_copy=True)
    layer = linears(model)[0]
    assert layer.weight is not None
    x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        y = layer(x)
        dense = torch.nn.functional.linear(x, layer.weight)
    if rows > DENSE_COPY_ROWS:
        assert torch.equal(y, dense)  # the copy itself, not the kernel
    else:
        assert not torch.equal(y, dense)  # the quantized kernel: another summation order
    torch.testing.assert_close(y, dense, rtol=1e-4, atol=1e-4)


def test_a_quantized_head_keeps_a_copy_too(tmp_path: Path) -> None:
    path = make_tiny_model("llama", tmp_path)
    with_copy, without = load(path, "int4", True, lm_head=True), load(path, "int4", False, True)
    assert with_copy.quantized_head is not None and with_copy.dense_head is not None
    assert without.dense_head is None
    hidden = torch.randn(MAX_KERNEL_ROWS, with_copy.arch.hidden_size)
    with torch.inference_mode():
        for rows in (1, DENSE_COPY_ROWS + 1, MAX_KERNEL_ROWS):
            torch.testing.assert_close(
                with_copy.compute_logits(hidden[:rows]),
                without.compute_logits(hidden[:rows]),
                rtol=1e-4,
                atol=1e-4,
            )
        rows = hidden[: DENSE_COPY_ROWS + 1]
        weight = with_copy.dense_head.weight  # float32: neither tiled nor oneDNN-packed
        assert weight is not None
        assert torch.equal(weight, dequantize(with_copy.quantized_head, torch.float32))
        copy = torch.nn.functional.linear(rows, weight).float()
        assert torch.equal(with_copy.compute_logits(rows), copy)
