"""Phi-3 (Phi3ForCausalLM): greedy output equals transformers' token for token in float32,
alone, batched, in chunks, from the prefix cache and after preemption; on two tensor-parallel
ranks; int8 and int4 weights run as their dequantized floats. A GGUF file is refused, and so are
lengths past longrope's original context and partial rotary embeddings outside Phi-3.

Two tiny models: Phi-3-mini's layout (plain rope), and Phi-4-mini's (longrope, rotary
embeddings over 3/4 of each head).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineArgs
from engine.config import QuantConfig, resolve_model_config
from engine.models.arch import ModelArch
from engine.models.hf_config import load_hf_config
from engine.models.layers import Linear, RotaryEmbedding, rotate_half_order
from engine.models.loader import load_model
from engine.models.quantized import dequantize
from engine.ops.native_ops import rope_reference
from tests.engine.models.arch_cases import MODES, PARAMS, ArchCase, check_mode, make_case
from tests.engine.models.test_quantized_model import all_logits
from tests.engine.test_correctness import engine_tokens
from tests.engine.test_tensor_parallel import tp_llm
from tests.tiny_models import make_config, make_tiny_model

VARIANTS = ["phi3", "phi3-longrope"]


@pytest.fixture(scope="module", params=VARIANTS)
def phi3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ArchCase:
    return make_case(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("mode", MODES)
def test_greedy_matches_transformers(phi3: ArchCase, mode: str) -> None:
    assert ModelArch.from_hf_config(load_hf_config(phi3.path, None)).model_type == "phi3"
    check_mode(phi3, mode)


def test_two_tensor_parallel_ranks(phi3: ArchCase) -> None:
    """Each rank holds whole heads, so the reordered rotary dims stay within a rank."""
    llm = tp_llm(phi3.path)
    try:
        assert engine_tokens(llm, phi3.prompts, PARAMS) == phi3.reference
    finally:
        llm.close()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_weights_run_as_their_dequantized_floats(phi3: ArchCase, method: str) -> None:
    """int8/int4 quantize every linear layer (the fused qkv and gate/up ones included, after
    the rotary dims are reordered): the logits equal those of the float model whose weights
    are the quantized ones dequantized, up to float32 summation order, also through the
    quantized kernel's decode-sized steps."""
    path, prompts = phi3.path, phi3.prompts
    quantized, _ = load_model(path, torch.float32, "cpu", QuantConfig(method))
    reference, _ = load_model(path, torch.float32, "cpu")
    pairs = [
        (ours, theirs)
        for ours, theirs in zip(quantized.layers.modules(), reference.layers.modules(), strict=True)
        if isinstance(ours, Linear) and isinstance(theirs, Linear)
    ]
    assert len(pairs) == 8 and all(ours.quantized is not None for ours, _ in pairs)
    ids = torch.tensor(prompts[4])
    float_logits = all_logits(reference, ids)
    for ours, theirs in pairs:
        assert ours.quantized is not None and theirs.weight is not None
        theirs.weight.data.copy_(dequantize(ours.quantized, torch.float32))
    expected = all_logits(reference, ids)
    for chunk in (0, 4):
        logits = all_logits(quantized, ids, chunk)
        diff = (logits - expected).abs().max().item()
        print(f"{method}, steps of {chunk or len(ids)}: max logit diff {diff:.2e}")
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(float_logits, expected, rtol=1e-4, atol=1e-4)


def test_longrope_caps_max_model_len(tmp_path: Path) -> None:
    """Past original_max_position_embeddings transformers recomputes every position with the
    long factors; the engine serves up to it, and refuses more naming longrope."""
    path = make_tiny_model("phi3-longrope", tmp_path)
    assert resolve_model_config(EngineArgs(model=str(path))).max_model_len == 256
    with pytest.raises(ValueError, match="longrope"):
        resolve_model_config(EngineArgs(model=str(path), max_model_len=257))


def test_longrope_and_partial_rotary_arch() -> None:
    arch = ModelArch.from_hf_config(make_config("phi3-longrope"))
    assert arch.rotary_dim == 12 and arch.head_dim == 16
    # transformers' factor: max_position_embeddings / original (512 / 256).
    assert arch.rope_scaling["attention_factor"] == pytest.approx((1 + 1 / 8) ** 0.5)
    plain = ModelArch.from_hf_config(make_config("phi3"))
    assert plain.rotary_dim is None and plain.context_limit() == (512, "")


def test_partial_rotary_outside_phi3_is_refused() -> None:
    config = make_config("llama")
    config.partial_rotary_factor = 0.5
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0\.5"):
        ModelArch.from_hf_config(config)


def test_reordered_partial_rotary_equals_rotating_part_of_the_head() -> None:
    """Rope over the whole head in rotate_half_order's layout equals transformers' rope of
    the first rotary_dim dims with the rest passed through, dims reordered."""
    positions = torch.arange(0, 300, 7)
    rope = RotaryEmbedding(16, 10000.0, {}, rotary_dim=12)
    cos, sin = rope.compute(positions, torch.float32)
    partial = RotaryEmbedding(12, 10000.0, {})
    pcos, psin = partial.compute(positions, torch.float32)
    x = torch.randn(len(positions), 3, 16, generator=torch.Generator().manual_seed(0))
    expected = torch.cat([rope_reference(x[..., :12], pcos, psin), x[..., 12:]], dim=-1)
    order = rotate_half_order(16, 12)
    assert order.tolist() == [0, 1, 2, 3, 4, 5, 12, 13, 6, 7, 8, 9, 10, 11, 14, 15]
    torch.testing.assert_close(rope_reference(x[..., order], cos, sin), expected[..., order])


def test_refuses_gguf_weights(tmp_path: Path) -> None:
    """A GGUF file (never opened: the refusal comes first) beside the config, as the
    weights themselves or run as stored."""
    folder = make_tiny_model("phi3", tmp_path / "phi3")
    (folder / "model.gguf").write_bytes(b"not read")
    with pytest.raises(ValueError, match="GGUF weights are not supported for phi3"):
        load_model(folder, torch.float32, "cpu", QuantConfig("gguf"))
    for safetensors in folder.glob("*.safetensors"):
        safetensors.unlink()
    with pytest.raises(ValueError, match="GGUF weights are not supported for phi3"):
        load_model(folder, torch.float32, "cpu", QuantConfig("none"))
