"""What --quantization means per model and device, and the engine running each method."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineArgs, ModelConfig, resolve_quant_config
from engine.models.arch import ModelArch
from engine.models.layers import Linear
from tests.tiny_models import make_tiny_model

ARCH = ModelArch("llama", 256, 64, 128, 2, 4, 2, 16, 1e-6, 10000.0)


def model(gguf: Path | None) -> ModelConfig:
    return ModelConfig(Path("m"), None, ARCH, 256, gguf)


@pytest.mark.parametrize(
    ("requested", "gguf", "device", "expected"),
    [
        ("auto", Path("m/w.gguf"), "cpu", "gguf"),
        ("auto", None, "cpu", "none"),
        ("auto", Path("m/w.gguf"), "cuda", "none"),  # dequantized on GPU, and logged
        ("none", Path("m/w.gguf"), "cpu", "none"),
        ("int8", None, "cpu", "int8"),
        ("int4", Path("m/w.gguf"), "cpu", "int4"),
    ],
)
def test_resolution(requested: str, gguf: Path | None, device: str, expected: str) -> None:
    args = EngineArgs(quantization=requested)
    assert resolve_quant_config(args, model(gguf), device).method == expected


@pytest.mark.parametrize(
    ("method", "requested", "expected"),
    [
        ("int8", None, True),  # int8 quantizes the head by default (in groups of 32)
        ("int4", None, False),  # int4 does not: it costs accuracy (test_quantized_model.py)
        ("int8", False, False),
        ("int4", True, True),
        ("gguf", None, False),  # a GGUF file's head runs as stored
        ("none", None, False),
    ],
)
def test_lm_head_resolution(method: str, requested: bool | None, expected: bool) -> None:
    args = EngineArgs(quantization=method, quantize_lm_head=requested)
    assert resolve_quant_config(args, model(Path("m/w.gguf")), "cpu").lm_head is expected


@pytest.mark.parametrize(("method", "tp"), [("gguf", 1), ("none", 1), ("auto", 2)])
def test_quantize_lm_head_without_int_quantization_is_refused(method: str, tp: int) -> None:
    args = EngineArgs(quantization=method, quantize_lm_head=True, tensor_parallel_size=tp)
    with pytest.raises(ValueError, match="--quantize-lm-head needs --quantization int8 or int4"):
        resolve_quant_config(args, model(Path("m/w.gguf")), "cpu")


@pytest.mark.parametrize("method", ["int8", "int4", "gguf"])
def test_gpu_refuses_explicit_quantization(method: str) -> None:
    with pytest.raises(ValueError, match="runs on the CPU only"):
        resolve_quant_config(EngineArgs(quantization=method), model(Path("w.gguf")), "cuda")


def test_gguf_needs_a_gguf_file() -> None:
    with pytest.raises(ValueError, match="needs a GGUF file"):
        resolve_quant_config(EngineArgs(quantization="gguf"), model(None), "cpu")


@pytest.mark.parametrize(
    ("method", "lm_head"), [("int8", False), ("int8", True), ("int4", False), ("int4", True)]
)
def test_engine_serves_quantized_tiny_models(tmp_path: Path, method: str, lm_head: bool) -> None:
    path = make_tiny_model("qwen2", tmp_path)  # qkv bias, untied head
    options = dict(dtype="float32", num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=8)
    dense = LLM(str(path), **options)  # type: ignore[arg-type]
    quantized = LLM(str(path), quantization=method, quantize_lm_head=lm_head, **options)  # type: ignore[arg-type]
    assert quantized.config.quant.method == method
    decoder = quantized.core.runner.model
    layers = [m for m in decoder.layers.modules() if isinstance(m, Linear)]
    # Quantized, and (--quantization-dense-copy, on by default) their dequantized copies.
    assert layers and all(m.quantized is not None and m.has_dense for m in layers)
    assert (decoder.quantized_head is not None) == lm_head
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21]]  # chunked: 8-token budget
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    ours = quantized.generate(prompts, params)
    reference = dense.generate(prompts, params)
    for q, d in zip(ours, reference, strict=True):
        assert len(q.outputs[0].token_ids) == 6
        # The first token's logprob moves by quantization error only.
        q_lp, d_lp = q.outputs[0].logprobs[0].logprob, d.outputs[0].logprobs[0].logprob  # type: ignore[index]
        if q.outputs[0].token_ids[0] == d.outputs[0].token_ids[0]:
            assert abs(q_lp - d_lp) < (0.05 if method == "int8" else 0.5)
