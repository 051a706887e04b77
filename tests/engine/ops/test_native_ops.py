"""Fused CPU elementwise kernels against the torch code they replace, in every instruction
set built (the ops' `isa` argument; those this CPU lacks are skipped, and say so), and the
Python bindings that dispatch them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.layers import RotaryEmbedding
from engine.ops import native_ops
from engine.ops.loader import native_kernels
from engine.ops.native_ops import rope_reference
from tests.isas import isa_params

DTYPES = [torch.float32, torch.bfloat16]
# Every instruction set this build holds (no native kernels: an empty list fails).
ISAS = isa_params()
ops = torch.ops.pagedserve


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, isa: str) -> torch.Tensor:
    out = torch.empty_like(x)
    ops.rms_norm(out, x, weight, eps, isa)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, isa: str
) -> tuple[torch.Tensor, torch.Tensor]:
    ops.fused_add_rms_norm(x, residual, weight, eps, isa)
    return x, residual


def silu_and_mul(gate_up: torch.Tensor, isa: str) -> torch.Tensor:
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
    ops.silu_and_mul(out, gate_up, isa)
    return out


def max_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| / (eps * |b|): about the difference in units in the last place."""
    spacing = torch.finfo(b.dtype).eps * b.float().abs().clamp_min(torch.finfo(b.dtype).tiny)
    return ((a.float() - b.float()).abs() / spacing).max().item()


def check(name: str, out: torch.Tensor, ref: torch.Tensor, ulps: float) -> None:
    diff, err = (out.float() - ref.float()).abs().max().item(), max_ulps(out, ref)
    print(f"{name} {ref.dtype}: max abs diff {diff:.2e}, {err:.2f} ulps")
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert err <= ulps


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# 72 and 75: not multiples of 16 (the AVX-512 loops' lanes), 75 nor of 8 (AVX2's): the tails
@pytest.mark.parametrize("hidden", [576, 72, 75])
def test_rms_norm(dtype: torch.dtype, hidden: int, isa: str) -> None:
    torch.manual_seed(0)
    x = (torch.randn(37, hidden) * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    out = rms_norm(x, weight, 1e-5, isa)
    # Only the float32 mean's summation order differs: a last-bit change in float32.
    check("rms_norm", out, native_ops.rms_norm_reference(x, weight, 1e-5), ulps=4)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [80, 83])  # 83: a tail after 16 and 8 lanes
def test_add_rms_norm(dtype: torch.dtype, hidden: int, isa: str) -> None:
    torch.manual_seed(1)
    x, residual = torch.randn(2, 19, hidden).to(dtype).unbind(0)
    weight = torch.randn(hidden).to(dtype)
    summed = x + residual
    ref = native_ops.rms_norm_reference(summed, weight, 1e-6)
    out, new_residual = add_rms_norm(x.clone(), residual.clone(), weight, 1e-6, isa)
    assert torch.equal(new_residual, summed)
    check("add_rms_norm", out, ref, ulps=4)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 40])
def test_rope_in_place_on_fused_qkv_views(dtype: torch.dtype, head_dim: int, isa: str) -> None:
    torch.manual_seed(2)
    tokens, heads, kv_heads = 23, 9, 3
    positions = torch.randint(0, 2000, (tokens,))
    cos, sin = RotaryEmbedding(head_dim, 10000.0, {})(positions, dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    q_ref, k_ref = rope_reference(q, cos, sin), rope_reference(k, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    ops.rotary_embedding(q, k, cos, sin, isa)
    # Every rounding of the torch expression is reproduced: bit-identical.
    check("rope q", q, q_ref, ulps=0)
    check("rope k", k, k_ref, ulps=0)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("intermediate", [1536, 100])
def test_silu_and_mul(dtype: torch.dtype, intermediate: int, isa: str) -> None:
    torch.manual_seed(3)
    gate_up = (torch.randn(29, 2 * intermediate) * 4).to(dtype)
    gate, up = gate_up.split(intermediate, dim=-1)
    # exp's last float32 bit differs from torch's, which can move a bf16 rounding by 1 ulp.
    check("silu_and_mul", silu_and_mul(gate_up, isa), F.silu(gate) * up, ulps=4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bindings_run_the_cpus_best_instruction_set(dtype: torch.dtype) -> None:
    """native_ops' functions equal the ops in the set the CPU was found to run best."""
    best = native_kernels().supported[0]
    assert native_kernels().isa == best
    torch.manual_seed(4)
    x, residual = (torch.randn(2, 9, 96) * 2).to(dtype).unbind(0)
    weight = torch.randn(96).to(dtype)
    assert torch.equal(native_ops.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5, best))
    out, summed = native_ops.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    expected_out, expected_summed = add_rms_norm(x.clone(), residual.clone(), weight, 1e-5, best)
    assert torch.equal(out, expected_out) and torch.equal(summed, expected_summed)
    gate_up = torch.randn(9, 192).to(dtype)
    assert torch.equal(native_ops.silu_and_mul(gate_up), silu_and_mul(gate_up, best))
    cos, sin = RotaryEmbedding(32, 10000.0, {})(torch.arange(9), dtype)
    q, k = torch.randn(2, 9, 3, 32).to(dtype).unbind(0)
    q2, k2 = q.clone(), k.clone()
    native_ops.apply_rope_(q, k, cos, sin)
    ops.rotary_embedding(q2, k2, cos, sin, best)
    assert torch.equal(q, q2) and torch.equal(k, k2)


def test_other_dtypes_fall_back_to_torch() -> None:
    x = torch.randn(4, 32, dtype=torch.float64)
    weight = torch.ones(32, dtype=torch.float64)
    ref = native_ops.rms_norm_reference(x, weight, 1e-6)
    assert torch.equal(native_ops.rms_norm(x, weight, 1e-6), ref)
    q, k = torch.randn(2, 4, 3, 32, dtype=torch.float64).unbind(0)
    cos, sin = RotaryEmbedding(32, 10000.0, {})(torch.arange(4), torch.float64)
    q_ref, k_ref = rope_reference(q, cos, sin), rope_reference(k, cos, sin)
    native_ops.apply_rope_(q, k, cos, sin)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_silu_and_mul_at_the_edges_of_exp(dtype: torch.dtype, isa: str) -> None:
    """Gates where exp(-gate) nears float32's limits (its overflow past 88.7 gives torch's
    -0), zeros, infinities and NaN, in every lane of the vector loops and their tails."""
    edges = [-1e4, -200, -100, -89.5, -88.5, -87.5, -87, -86, -20, -1e-30, 0, 1e-30, 20,
             86, 87.5, 88.5, 89.5, 200, float("inf"), float("-inf"), float("nan")]  # fmt: skip
    gate = torch.tensor(edges * 3).to(dtype)  # 63 values: every lane, and a tail
    up = (1.5 + torch.arange(len(gate)) / 64).to(dtype)
    check_silu_and_mul("silu_and_mul edges", gate, up, isa)


def check_silu_and_mul(name: str, gate: torch.Tensor, up: torch.Tensor, isa: str) -> None:
    """The op on one row against torch's: NaN, infinities and signs alike, the rest within
    4 ulps."""
    out = silu_and_mul(torch.cat([gate, up]).unsqueeze(0), isa)[0]
    ref = F.silu(gate) * up
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out[ref.isinf()], ref[ref.isinf()])
    finite = ref.isfinite()
    assert torch.equal(out[finite].signbit(), ref[finite].signbit())
    check(name, out[finite], ref[finite], ulps=4)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_silu_and_mul_every_16_bit_gate(dtype: torch.dtype, isa: str) -> None:
    """Every one of the 65,536 values a 16-bit gate can hold (the AVX2 set looks SiLU up
    in a table of them), against torch's, twice: times 1 and times an up that varies."""
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    for up in (torch.ones_like(gate), (0.75 + torch.arange(len(gate)) % 97 / 64).to(dtype)):
        check_silu_and_mul("silu_and_mul every gate", gate, up, isa)
