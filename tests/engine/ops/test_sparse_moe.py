"""The sparse mixture-of-experts op (engine/ops/csrc/moe_ops.cpp, moe.SparseMoE.forward on
the CPU) against a float64 reference on every instruction set, with float32, bfloat16 and
quantized (GGUF Q8_0-style int8 and Q4_1-style int4) experts; and, on the active set, equal
to the bit to SparseMoE's Python path. The model tests (test_moe.py, test_gguf_moe.py,
test_fused_layers.py) run it inside whole models."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from engine.config import DENSE_COPY_ROWS
from engine.models import fused_layers
from engine.models.arch import ModelArch
from engine.models.layers import Linear
from engine.models.moe import SparseMoE
from engine.models.quantized import (
    dequantize_reference,
    quantize_int4,
    quantize_int8,
)
from engine.ops.loader import native_kernels
from tests.isas import isa_params
from tests.tiny_models import make_config

ISAS = isa_params()
# (activations' dtype, experts' quantization, keep a dense copy), and the tolerance on
# max |op - reference| / max |reference|: float32's summation order; bfloat16's roundings
# of activations, logits, routing weights and sums.
CASES = {
    "f32": (torch.float32, None, False, 1e-5),
    "bf16": (torch.bfloat16, None, False, 2e-2),
    "f32-q8_0": (torch.float32, "q8_0", False, 1e-5),
    "bf16-q4": (torch.bfloat16, "q4", False, 2e-2),
    "f32-q4-dense-copy": (torch.float32, "q4", True, 1e-5),
}
# A decode step's single token; a step whose experts get several tokens (a few get more
# than DENSE_COPY_ROWS, so a dense copy runs beside quantized experts).
NUM_TOKENS = (1, 36)
# A token's k-th and (k+1)-th router logits differ by more than this in float64, so the
# op's rounded logits choose the reference's experts.
MIN_LOGIT_GAP = 0.1


def make_moe(
    dtype: torch.dtype, quant: str | None, dense_copy: bool, norm_topk_prob: bool
) -> tuple[SparseMoE, dict[str, torch.Tensor]]:
    """A random SparseMoE laid out for its kernels, and its weights in float64 by name."""
    arch = ModelArch.from_hf_config(make_config("qwen3_moe"))
    moe = SparseMoE(replace(arch, norm_topk_prob=norm_topk_prob)).to(dtype)
    gen = torch.Generator().manual_seed(0)
    exact: dict[str, torch.Tensor] = {}
    for name, module in moe.named_modules():
        if not isinstance(module, Linear):
            continue
        w = torch.randn(module.weight.shape, generator=gen) / module.in_features**0.5
        module.weight.data.copy_(w * (4.0 if name == "gate" else 1.0))  # spread the logits
        if quant is not None and name != "gate":
            w = module.weight
            q = quantize_int8(w, 32) if quant == "q8_0" else quantize_int4(w)
            module.quantize(q)
            exact[name] = dequantize_reference(q).double()
            if dense_copy:
                module.keep_dense_copy(dtype)
        else:
            exact[name] = module.weight.detach().double()
        module.pack()
    moe.pack_native()
    return moe, exact


def reference(x: torch.Tensor, moe: SparseMoE, exact: dict[str, torch.Tensor]) -> torch.Tensor:
    """SparseMoE in float64, a token and an expert at a time."""
    x64 = x.double()
    probs = torch.softmax(x64 @ exact["gate"].T, dim=-1)
    weights, chosen = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x64)
    for t in range(len(x64)):
        for weight, e in zip(weights[t].tolist(), chosen[t].tolist(), strict=True):
            gate, up = (x64[t] @ exact[f"experts.{e}.gate_up_proj"].T).chunk(2)
            out[t] += weight * (exact[f"experts.{e}.down_proj"] @ (F.silu(gate) * up))
    return out


def routable_tokens(exact: dict[str, torch.Tensor], dtype: torch.dtype, n: int) -> torch.Tensor:
    """n random (hidden,) tokens in `dtype` whose top-k experts are clear (MIN_LOGIT_GAP)."""
    router = exact["gate"]
    x = torch.randn(8 * n, router.shape[1], generator=torch.Generator().manual_seed(n))
    x = x.to(dtype)
    logits = torch.sort(x.double() @ router.T, dim=-1, descending=True).values
    top_k = 2  # qwen3_moe's tiny config
    clear = (logits[:, top_k - 1] - logits[:, top_k]) > MIN_LOGIT_GAP
    assert int(clear.sum()) >= n, "too few tokens with clear routing"
    return x[clear][:n].contiguous()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", list(CASES))
def test_op_matches_float64_reference(isa: str, case: str) -> None:
    dtype, quant, dense_copy, tol = CASES[case]
    moe, exact = make_moe(dtype, quant, dense_copy, norm_topk_prob=True)
    assert moe.top_k == 2
    for num_tokens in NUM_TOKENS:
        x = routable_tokens(exact, dtype, num_tokens)
        if dense_copy and num_tokens > DENSE_COPY_ROWS:  # experts on either side of it
            rows = torch.bincount(torch.topk(x.double() @ exact["gate"].T, 2).indices.flatten())
            assert 0 < rows[rows > 0].min() <= DENSE_COPY_ROWS < rows.max()
        out = torch.ops.pagedserve.sparse_moe(x, moe.native, isa)
        expected = reference(x, moe, exact)
        diff = (out.double() - expected).abs().max().item()
        scale = expected.abs().max().item()
        print(f"{isa} {case} T={num_tokens}: max |diff| {diff:.2e} of max |ref| {scale:.2e}")
        assert out.dtype == dtype and out.shape == x.shape
        assert diff <= tol * scale


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_runs_the_op_and_equals_python_path(
    case: str, norm_topk_prob: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU SparseMoE.forward is one op call, whose output is the Python path's to
    the bit: the same kernels, routing and roundings."""
    assert native_kernels().available
    dtype, quant, dense_copy, _ = CASES[case]
    moe, exact = make_moe(dtype, quant, dense_copy, norm_topk_prob)
    op, calls = fused_layers._sparse_moe_op(), []

    def counted(*args: object) -> torch.Tensor:
        calls.append(args)
        return op(*args)

    monkeypatch.setattr(fused_layers, "_sparse_moe_op", lambda: counted)
    for num_tokens in NUM_TOKENS:
        x = routable_tokens(exact, dtype, num_tokens)
        with torch.inference_mode():
            native, python = moe(x), moe.reference(x)
        assert torch.equal(native, python)
    assert len(calls) == len(NUM_TOKENS)


def test_op_refuses_strided_input() -> None:
    moe, exact = make_moe(torch.float32, None, False, norm_topk_prob=True)
    x = routable_tokens(exact, torch.float32, 4)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.pagedserve.sparse_moe(x.T.contiguous().T, moe.native)
