"""Weight-only quantized weights: int8/int4 made at load time, and GGUF's Q4_0, Q4_1 and
Q8_0 kept as they are stored.

One block-quantized format serves all of them (the layout of
engine/ops/csrc/quant_kernels.cpp): weights in blocks of 32 along K, float16 scales (and
mins, for 4 bits) per group of `group_size` weights.

    format                      bits  group  value
    GGUF Q4_0                   4     32     d * q - 8 d   (stored as min m = -8 d, exact)
    GGUF Q4_1, int4             4     32/64  d * q + m     q in 0..15
    GGUF Q8_0                   8     32     d * q         q in -128..127
    int8 (per output channel)   8     K      d * q

Activations stay float32/bfloat16 and every sum is float32, so a quantized linear equals the
dense linear of `dequantize_reference(weight)` up to the order of float32 additions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.ops import native_ops

BLOCK = 32


@dataclass(frozen=True)
class QuantizedWeight:
    qweight: torch.Tensor  # 4-bit: uint8 (N, K / 2), nibble pairs; 8-bit: int8 (N, K)
    scales: torch.Tensor  # float16 (N, K / group_size)
    mins: torch.Tensor | None  # float16 (N, K / group_size); 4-bit only
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        if self.bits not in (4, 8) or self.group_size % BLOCK:
            raise ValueError(f"unsupported quantization: {self.bits} bits, group {self.group_size}")
        if (self.mins is None) != (self.bits == 8):
            raise ValueError("4-bit weights carry mins; 8-bit weights do not")

    @property
    def shape(self) -> tuple[int, int]:
        n, width = self.qweight.shape
        return n, width * 2 if self.bits == 4 else width

    @property
    def nbytes(self) -> int:
        parts = (self.qweight, self.scales, self.mins)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def rows(self, index: torch.Tensor | np.ndarray) -> QuantizedWeight:
        """The weight with its output rows reordered or selected (rows are independent)."""
        index = torch.as_tensor(index, dtype=torch.long)
        mins = None if self.mins is None else self.mins[index]
        return QuantizedWeight(
            self.qweight[index], self.scales[index], mins, self.bits, self.group_size
        )

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Row-wise concatenation of weights with the same K and format (fused layers)."""
        first = parts[0]
        for part in parts[1:]:
            same = (part.bits, part.group_size, part.shape[1])
            if same != (first.bits, first.group_size, first.shape[1]):
                raise ValueError("fused quantized weights must share K and format")
        mins = None if first.mins is None else torch.cat([p.mins for p in parts])  # type: ignore[misc]
        return QuantizedWeight(
            torch.cat([p.qweight for p in parts]),
            torch.cat([p.scales for p in parts]),
            mins,
            first.bits,
            first.group_size,
        )


# ---- quantizing float weights ---------------------------------------------------------


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric int8 per output channel, or per group of `group_size` weights along K (GGUF
    Q8_0's format at 32): d = max|w| / 127 (float16), q = round(w / d)."""
    w = weight.detach().float()
    n, k = w.shape
    group = k if group_size is None else group_size
    if k % group or group % BLOCK:
        raise ValueError(f"K={k} does not split into int8 groups of {group}")
    groups = w.view(n, k // group, group)
    scale = (groups.abs().amax(-1) / 127.0).to(torch.float16)
    safe = scale.float().clamp_min(torch.finfo(torch.float16).tiny)
    q = torch.round(groups / safe[..., None]).clamp(-128, 127).to(torch.int8)
    return QuantizedWeight(q.view(n, k).contiguous(), scale.contiguous(), None, 8, group)


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Affine int4 per group: m = min(w), d = (max - min) / 15 (both float16), q = round((w -
    m) / d) in 0..15, computed with the rounded d and m so that dequantization is exact."""
    w = weight.detach().float()
    n, k = w.shape
    if k % group_size or group_size % BLOCK:
        raise ValueError(f"K={k} does not split into int4 groups of {group_size}")
    groups = w.view(n, k // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    d = ((high - low) / 15.0).to(torch.float16)
    m = low.to(torch.float16)
    safe = d.float().clamp_min(torch.finfo(torch.float16).tiny)[..., None]
    q = torch.round((groups - m.float()[..., None]) / safe).clamp(0, 15).to(torch.uint8)
    return QuantizedWeight(
        pack_nibbles(q.view(n, k)), d.contiguous(), m.contiguous(), 4, group_size
    )


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values 0..15 -> (N, K / 2) bytes: in each 32-block, byte j holds value j (low
    nibble) and value j + 16 (high nibble), as GGUF's Q4 types do."""
    n, k = q.shape
    blocks = q.view(n, k // BLOCK, 2, BLOCK // 2).to(torch.uint8)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_nibbles: (N, K / 2) bytes -> (N, K) values 0..15 (uint8)."""
    n, half = packed.shape
    blocks = packed.view(n, half * 2 // BLOCK, BLOCK // 2)
    return torch.stack((blocks & 0x0F, blocks >> 4), dim=2).reshape(n, half * 2)


def dequantize_reference(weight: QuantizedWeight) -> torch.Tensor:
    """(N, K) float32 weights, in plain torch: the reference the kernels are tested against."""
    n, k = weight.shape
    q = unpack_nibbles(weight.qweight) if weight.bits == 4 else weight.qweight
    q = q.float().view(n, k // weight.group_size, weight.group_size)
    w = q * weight.scales.float()[..., None]
    if weight.mins is not None:
        w = w + weight.mins.float()[..., None]
    return w.view(n, k)


# ---- GGUF's block types ---------------------------------------------------------------

# GGUF type name -> (bits, bytes per 32-weight block).
GGUF_BLOCK_TYPES = {"Q4_0": (4, 18), "Q4_1": (4, 20), "Q8_0": (8, 34)}


def from_gguf(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """A GGUF tensor's raw blocks (uint8, (N, K / 32 * block bytes)) as stored, repacked
    without any arithmetic but Q4_0's -8 d (exact: a power-of-two multiple)."""
    _, block_bytes = GGUF_BLOCK_TYPES[type_name]
    n, k = shape
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // BLOCK, block_bytes)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
    if type_name == "Q8_0":
        q = blocks[:, :, 2:].copy().view(np.int8).reshape(n, k)
        return QuantizedWeight(torch.from_numpy(q), torch.from_numpy(d.copy()), None, 8, BLOCK)
    if type_name == "Q4_1":
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0]
        nibbles = blocks[:, :, 4:]
    else:
        m = (d.astype(np.float32) * -8.0).astype(np.float16)
        nibbles = blocks[:, :, 2:]
    packed = torch.from_numpy(nibbles.reshape(n, k // 2).copy())
    return QuantizedWeight(packed, torch.from_numpy(d.copy()), torch.from_numpy(m.copy()), 4, BLOCK)


# ---- running them ---------------------------------------------------------------------

TILE = 16
# Steps with more rows than this dequantize the weight and run a dense GEMM instead.
MAX_KERNEL_ROWS = 16
# Steps with more rows than DENSE_COPY_ROWS (engine/config.py: the flags' help and
# `pagedserve info` state it) run on the dense copy of the weights where there is one.


@dataclass(frozen=True)
class TiledWeight:
    """A QuantizedWeight repacked for the CPU kernel: 16 output rows per tile (see the layout
    in engine/ops/csrc/quant_kernels.cpp); N is padded to whole tiles with zeros."""

    # 4-bit: uint8 (tiles, K/32, 4, 16, 4) viewed as (tiles, K/32, 16, 16); 8-bit: int8
    # (tiles, K/32, 32, 16)
    qweight: torch.Tensor
    scales: torch.Tensor  # float16 (tiles, K / group_size, 16)
    mins: torch.Tensor | None
    bits: int
    group_size: int
    n: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.qweight.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        parts = (self.qweight, self.scales, self.mins)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def kernel_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int, int]:
        """The weight as the quant_linear / quant_dequantize ops take it."""
        return self.qweight, self.scales, self.mins, self.bits, self.group_size, self.n


def pack_tiles(weight: QuantizedWeight) -> TiledWeight:
    """Repacks without arithmetic: the same integers, scales and mins, reordered."""
    n, k = weight.shape
    tiles = -(-n // TILE)
    pad = tiles * TILE - n

    def rows_padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t

    def per_tile(t: torch.Tensor) -> torch.Tensor:  # (N, G) -> (tiles, G, 16)
        return rows_padded(t).view(tiles, TILE, -1).transpose(1, 2).contiguous()

    blocks = k // BLOCK
    if weight.bits == 8:
        q = rows_padded(weight.qweight).view(tiles, TILE, blocks, BLOCK)
        packed = q.permute(0, 2, 3, 1).contiguous()
    else:
        q = rows_padded(unpack_nibbles(weight.qweight))
        # (tile, row, block, octet, high, low, parity): k = 8 octet + 2 (2 high + low) +
        # parity. A row's 8 weights of an octet fill 4 bytes, bytes 2 parity + high holding
        # low = 0 in their low nibble and low = 1 in their high one.
        q = q.view(tiles, TILE, blocks, BLOCK // 8, 2, 2, 2).permute(0, 2, 3, 1, 6, 4, 5)
        packed = (q[..., 0] | (q[..., 1] << 4)).reshape(tiles, blocks, BLOCK // 2, TILE)
    mins = None if weight.mins is None else per_tile(weight.mins)
    return TiledWeight(
        packed.contiguous(), per_tile(weight.scales), mins, weight.bits, weight.group_size, n
    )


def dequantize(
    weight: TiledWeight, dtype: torch.dtype, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """(N, K) (or the selected rows) in `dtype`."""
    native = native_ops.quant_dequantize(weight.kernel_args(), rows, dtype)
    if native is None:
        raise RuntimeError("quantized weights need the native CPU kernels")
    return native


def quantized_linear(
    x: torch.Tensor,
    weight: TiledWeight,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x (..., K) @ W^T (+ bias) -> (..., N) in x's dtype, then in `out_dtype` if given
    (float32 logits: the kernel writes them, without a copy in x's dtype first)."""
    flat = x.reshape(-1, x.shape[-1])
    y = None
    if flat.shape[0] <= MAX_KERNEL_ROWS:
        wide = out_dtype == torch.float32 and bias is None
        y = native_ops.quant_linear(flat, weight.kernel_args(), torch.float32 if wide else None)
    if y is None:
        y = F.linear(flat, dequantize(weight, x.dtype))
    if bias is not None:
        y = y + bias
    if out_dtype is not None:
        y = y.to(out_dtype)
    return y.view(*x.shape[:-1], y.shape[-1])
