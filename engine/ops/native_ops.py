"""Fused CPU kernels for the decoder's elementwise ops, each with its pure-torch reference.

Each op replaces a chain of small torch ops (one kernel launch and one temporary tensor
per op) with a single pass. The kernels round every intermediate that torch would store
in the model dtype, so in float32 and bfloat16 they match the torch code in layers.py up
to float32 summation order (RMSNorm) and exp's last bit (SiLU). They run when the native
CPU kernels load (see engine.ops.loader) and the tensors are CPU
float32/bfloat16/float16; otherwise the torch reference runs.

The references are the plain torch definitions: layers.RMSNorm and the decoder call
this module, which picks the kernel or the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.ops.loader import native_kernels

_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _native(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _NATIVE_DTYPES and native_kernels().available


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(..., H) -> (rows, H) with contiguous rows (a view when possible)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x.reshape(-1, x.shape[-1])


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama RMSNorm: normalise in float32, scale in the input dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (T, heads, head_dim) in the rotate-half layout."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(..., H) -> (..., H). Pure: returns a new tensor."""
    if not _native(x):
        return rms_norm_reference(x, weight, eps)
    rows = _rows(x)
    out = torch.empty_like(rows)
    torch.ops.pagedserve.rms_norm(out, rows, weight, eps)
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for (T, H) inputs.

    Mutates x and residual on the native path (they become the two results): callers
    must not use them afterwards.
    """
    if not (_native(x) and x.is_contiguous() and residual.is_contiguous()):
        summed = x + residual
        return rms_norm_reference(summed, weight, eps), summed
    torch.ops.pagedserve.fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


def apply_rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates q (T, heads, D) and k (T, kv_heads, D) in place, rotate-half layout.

    cos, sin: (T, 1, D) in q's dtype, from RotaryEmbedding. Mutates q and k (which may be
    views into one fused QKV tensor).
    """
    heads_contiguous = all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (q, k))
    if not (_native(q) and heads_contiguous and cos.is_contiguous() and sin.is_contiguous()):
        q.copy_(rope_reference(q, cos, sin))
        k.copy_(rope_reference(k, cos, sin))
        return
    torch.ops.pagedserve.rotary_embedding(q, k, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2 * I) = [gate | up] -> (T, I): silu(gate) * up. Pure."""
    half = gate_up.shape[-1] // 2
    if not _native(gate_up) or gate_up.stride(-1) != 1:
        gate, up = gate_up.split(half, dim=-1)
        return F.silu(gate) * up
    rows = gate_up.reshape(-1, 2 * half)
    out = torch.empty(rows.shape[0], half, dtype=gate_up.dtype)
    torch.ops.pagedserve.silu_and_mul(out, rows)
    return out.view(*gate_up.shape[:-1], half)


# A tiled quantized weight as the ops take it (engine.models.quantized.TiledWeight's
# kernel_args): qweight, scales, mins, bits, group_size, n.
QuantArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int, int]


def quant_linear(
    x: torch.Tensor, weight: QuantArgs, out_dtype: torch.dtype | None = None
) -> torch.Tensor | None:
    """x (M, K) @ W^T for a tiled quantized W, or None where the native kernel cannot run
    (not CPU float32/bfloat16, or no native kernels). `out_dtype` float32 for bfloat16 x:
    the bfloat16 results as float32, as `.float()` of them would be."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not native_kernels().available:
        return None
    return torch.ops.pagedserve.quant_linear(x, *weight, out_dtype=out_dtype)


def quant_linear_argmax(x: torch.Tensor, weight: QuantArgs, n_valid: int) -> torch.Tensor | None:
    """Each row's argmax over the first `n_valid` columns of quant_linear(x, weight) as
    float32 logits, the first on ties, without the (M, n) result; None where the native
    kernel cannot run."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not native_kernels().available:
        return None
    return torch.ops.pagedserve.quant_linear_argmax(x, *weight, n_valid)


def bf16_linear(
    x: torch.Tensor, weight: torch.Tensor, n: int, out_dtype: torch.dtype | None = None
) -> torch.Tensor | None:
    """x (M, K) @ W^T for a bfloat16 W tiled by layers.tile_bf16_weight, or None where the
    native kernel cannot run (not CPU bfloat16, or no native kernels). `out_dtype`
    float32: the same bfloat16-rounded results as float32, as `.float()` of them would be."""
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or not native_kernels().available:
        return None
    return torch.ops.pagedserve.bf16_linear(x, weight, n, out_dtype=out_dtype)


def bf16_linear_argmax(
    x: torch.Tensor, weight: torch.Tensor, n: int, n_valid: int
) -> torch.Tensor | None:
    """Each row's argmax over the first `n_valid` columns of bf16_linear(x, weight, n), the
    first on ties, without the (M, n) result; None where the native kernel cannot run."""
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or not native_kernels().available:
        return None
    return torch.ops.pagedserve.bf16_linear_argmax(x, weight, n, n_valid)


def bf16_linear_argmax_screened(
    x: torch.Tensor,
    weight: torch.Tensor,
    n: int,
    n_valid: int,
    screen: torch.Tensor,
    bounds: torch.Tensor,
) -> torch.Tensor | None:
    """bf16_linear_argmax's tokens through the head's int8 screen
    (engine/models/head_screen.py); None where the native kernel cannot run."""
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or not native_kernels().available:
        return None
    return torch.ops.pagedserve.bf16_linear_argmax_screened(x, weight, n, n_valid, screen, bounds)


def quant_dequantize(
    weight: QuantArgs, rows: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor | None:
    """The (selected rows of the) dequantized weight in `dtype`, or None without the kernels."""
    if weight[0].device.type != "cpu" or not native_kernels().available:
        return None
    return torch.ops.pagedserve.quant_dequantize(*weight, rows, dtype)


def lora_apply_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    bounds: list[int],
    slots: list[int],
) -> None:
    """y[s:e] += (x[s:e] @ a[slot]^T) @ bt[slot] for each segment (s, e) = bounds[2i],
    bounds[2i + 1] of slot slots[i] (engine/models/lora_layers.py); on any device."""
    for i, slot in enumerate(slots):
        start, end = bounds[2 * i], bounds[2 * i + 1]
        y[start:end] += (x[start:end] @ a[slot].t()) @ bt[slot]


def lora_apply_(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    ranks: torch.Tensor,
    col_offsets: list[int],
    bounds: list[int],
    slots: list[int],
) -> None:
    """lora_apply_reference, in place. The native kernel reads only what can be nonzero:
    a's row blocks (one per output slice, col_offsets[b]..col_offsets[b + 1]) up to each
    slot's rank (`ranks`), and each block's rows of bt in its slice's columns."""
    if _native(y) and y.stride(-1) == 1 and x.stride(-1) == 1:
        torch.ops.pagedserve.lora_apply(y, x, a, bt, ranks, col_offsets, bounds, slots)
    else:
        lora_apply_reference(y, x, a, bt, bounds, slots)
