"""Building blocks of a Llama-family decoder over a flat (unpadded) token batch."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import DENSE_COPY_ROWS
from engine.models.quantized import (
    QuantizedWeight,
    TiledWeight,
    dequantize,
    pack_tiles,
    quantized_linear,
)
from engine.ops import native_ops
from engine.ops.loader import native_kernels

if TYPE_CHECKING:
    from engine.models.lora_layers import LoRASlots

# oneDNN lays packed weights out for a batch size; any other batch size works as well.
_PACK_BATCH_HINT = 64


def onednn_packable(weight: torch.Tensor) -> bool:
    """oneDNN's pre-packed linear: a CPU bf16 weight, where this torch build and CPU have it.

    It gives results identical to F.linear (both run oneDNN's matmul for bf16), but without
    re-laying the weight out on every call. float32 stays on F.linear (MKL), whose numerics
    match Hugging Face's reference exactly.
    """
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


# The instruction sets with a bfloat16 tile kernel of ours: the dot product (AVX512_BF16),
# and float32 FMAs on the weights widened in registers (AVX2, where oneDNN packs no bfloat16
# and torch's bf16 matmul ran at about 9 GFLOP/s a thread).
TILED_BF16_ISAS = ("avx512_bf16", "avx2")


def bf16_tileable(weight: torch.Tensor) -> bool:
    """pagedserve's bfloat16 tile kernel (engine/ops/csrc/bf16_linear_kernels.cpp): a CPU
    bf16 weight of even width, where the native kernels run with AVX512_BF16 or AVX2.

    Its results equal oneDNN's up to the order of float32 additions. With AVX512_BF16, at the
    few rows of a decode step it reads the weights about 1.6x as fast as oneDNN, and it keeps
    up with oneDNN at prefill sizes; with AVX2, where oneDNN packs no bfloat16, it runs 1.5x
    torch's bf16 matmul at one row and about 5x from 4 rows up (benchmarks/bf16_linear.py).
    So where it runs it replaces oneDNN's packed copy rather than sitting beside it.
    """
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[1] % 2 == 0
        and native_kernels().isa in TILED_BF16_ISAS
    )


def tile_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) bf16 -> (tiles, K/2, 16, 2): each tile of 16 output rows holds, per pair of k,
    the rows' weights at k and k + 1 side by side; N is padded to whole tiles with zeros."""
    n, k = weight.shape
    tiles = -(-n // 16)
    padded = torch.cat([weight, weight.new_zeros(tiles * 16 - n, k)]) if n % 16 else weight
    return padded.reshape(tiles, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def tiled_linear(
    x: torch.Tensor, tiled: torch.Tensor, n: int, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x (..., K) @ W^T -> (..., n) for a weight tiled by tile_bf16_weight; in bfloat16, or
    float32 holding the same rounded numbers (out_dtype)."""
    flat = x.reshape(-1, x.shape[-1])
    y = native_ops.bf16_linear(flat, tiled, n, out_dtype)
    if y is None:
        raise RuntimeError("tiled bfloat16 weights need the native CPU kernels")
    return y.view(*x.shape[:-1], n)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) weight -> oneDNN's opaque packed layout, for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Module):
    """y = x W^T (+ b). Parameters start uninitialised: the loader always fills them (or
    replaces the weight by a quantized one)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight: nn.Parameter | None = nn.Parameter(
            torch.empty(out_features, in_features), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None
        self.tiled: torch.Tensor | None = None  # tile_bf16_weight's layout
        self.quantized: TiledWeight | None = None
        # LoRA adapters' slots (engine/lora), added to the step's adapted rows.
        self.lora: LoRASlots | None = None

    def quantize(self, weight: QuantizedWeight) -> None:
        """Runs on `weight` from now on; the float weight is dropped."""
        expected = (self.out_features, self.in_features)
        if weight.shape != expected:
            raise ValueError(f"quantized weight of shape {weight.shape}, expected {expected}")
        self.quantized = pack_tiles(weight)
        self.register_parameter("weight", None)

    def keep_dense_copy(self, dtype: torch.dtype) -> None:
        """A quantized layer also holds its weight dequantized to `dtype` (packed by `pack`),
        for steps of more than DENSE_COPY_ROWS tokens."""
        if self.quantized is not None:
            weight = dequantize(self.quantized, dtype)
            self.weight = nn.Parameter(weight, requires_grad=False)

    @property
    def has_dense(self) -> bool:
        return self.weight is not None or self.packed is not None or self.tiled is not None

    def pack(self, tiled: bool = True) -> None:
        """Replaces the weight by the bfloat16 kernel's tiled layout where that runs
        (bf16_tileable; `tiled=False` skips it), else by oneDNN's pre-packed layout where
        oneDNN can; the plain copy is dropped. Call after the weights are loaded and on
        their device."""
        if self.weight is None:
            return
        if tiled and bf16_tileable(self.weight):
            self.tiled = tile_bf16_weight(self.weight.detach())
        elif onednn_packable(self.weight):
            self.packed = pack_linear_weight(self.weight.detach())
        else:
            return
        self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._base_forward(x)
        if self.lora is not None and self.lora.step.active:
            self.lora.apply(y, x)
        return y

    def _base_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None and (
            not self.has_dense or x.numel() <= DENSE_COPY_ROWS * self.in_features
        ):
            return quantized_linear(x, self.quantized, self.bias)
        if self.tiled is not None:
            y = tiled_linear(x, self.tiled, self.out_features)
            return y if self.bias is None else y + self.bias
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Normalises in float32 and scales in the input dtype, as Hugging Face's Llama does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return native_ops.rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual). May reuse (mutate) x and residual."""
        return native_ops.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies for the default, linear, Llama 3 and longrope rope types (float32).

    longrope's are its short factors': ModelArch.context_limit keeps every sequence within
    the original context, where transformers uses those."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling)
    if rope_type == "longrope":
        return 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type != "llama3":
        return inv_freq
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept; the band between blends.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(in_band, blended, scaled)


def yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN's inverse frequencies, as transformers' _compute_yarn_parameters: interpolated
    by `factor` below the band of dims that turn beta_slow..beta_fast times over the
    original context, extrapolated (kept) above it, blended linearly across it."""
    factor, original = float(scaling["factor"]), scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rotate_half_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's dims under which rotate-half rope over the whole head turns only
    the first `rotary_dim` of them (partial rotary embeddings), for queries and keys alike
    (their dot products, so attention, do not change). Rope over `rotary_dim` pairs dim i
    with i + rotary_dim / 2, over the head i with i + head_dim / 2; head_dim 8, rotary_dim 4
    (r: turned, p: passed through by cos 1 and sin 0):

        checkpoint   r0 r1 r2 r3 p0 p1 p2 p3    pairs (r0, r2) (r1, r3)
        ours         r0 r1 p0 p1 r2 r3 p2 p3    pairs (r0, r2) (r1, r3) (p0, p2) (p1, p3)
    """
    dims = torch.arange(head_dim)
    turned = dims[:rotary_dim].view(2, rotary_dim // 2)
    passed = dims[rotary_dim:].view(2, (head_dim - rotary_dim) // 2)
    return torch.cat([turned, passed], dim=1).flatten()


class RotaryEmbedding(nn.Module):
    """cos and sin per position, rotate-half layout over the whole head. With `rotary_dim`
    below head_dim only that many dims turn, in rotate_half_order's layout (the loader puts
    the query and key weights in it); longrope scales cos and sin by its attention factor,
    as transformers does."""

    def __init__(
        self, head_dim: int, theta: float, scaling: dict[str, Any], rotary_dim: int | None = None
    ) -> None:
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim or head_dim
        self.attention_factor = float(scaling.get("attention_factor", 1.0))
        self.inv_freq: torch.Tensor
        inv_freq = rope_inv_freq(self.rotary_dim, theta, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

        # On the CPU, cos and sin per position in each dtype, computed once by `compute`
        # (elementwise float32 arithmetic, so the same values: tests/engine/models/
        # test_rotary.py) and regrown to the next power of two past the largest position
        # seen: a step looks its rows up with two index ops instead of computing them with
        # eight (a single-stream decode step: 0.14 to 0.11 ms). At 128k positions and
        # head_dim 128 the two float32 tables hold 128 MiB.
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin for each position: (num_tokens, 1, head_dim) each."""
        if positions.device.type == "cpu" and len(positions):
            cos, sin = self._table(int(positions.max()) + 1, dtype)
            return cos[positions][:, None, :], sin[positions][:, None, :]
        return self.compute(positions, dtype)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The CPU tables forward looks `positions` (on the CPU, not empty) up in: cos and
        sin, (at least max(positions) + 1, head_dim) each."""
        return self._table(int(positions.numpy().max()) + 1, dtype)

    def compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """forward's result computed from the positions (on a GPU, inside CUDA graphs)."""
        freqs = positions[:, None].float() * self.inv_freq.float()  # (T, rotary_dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()  # (T, rotary_dim)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        if self.rotary_dim < self.head_dim:  # each half padded: cos 1, sin 0
            pad, half = (self.head_dim - self.rotary_dim) // 2, self.rotary_dim // 2
            cos = F.pad(cos.view(-1, 2, half), (0, pad), value=1.0).flatten(1)
            sin = F.pad(sin.view(-1, 2, half), (0, pad)).flatten(1)
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def _table(self, num_positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._tables.get(dtype)
        if table is None or len(table[0]) < num_positions:
            size = max(4096, 1 << (num_positions - 1).bit_length())
            cos, sin = self.compute(torch.arange(size, device=self.inv_freq.device), dtype)
            table = self._tables[dtype] = (cos[:, 0], sin[:, 0])
        return table


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(..., 2 * I) -> (..., I): gelu(first half, tanh approximation) * second half."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one layer; with
    `act="gelu_tanh"`, GeGLU (Gemma 3): gelu in place of silu."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu") -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)
        self.act_and_mul = gelu_tanh_and_mul if act == "gelu_tanh" else native_ops.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
