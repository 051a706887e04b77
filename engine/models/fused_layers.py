"""The decoder layers as one native op on the CPU (engine/ops/csrc/decoder_ops.cpp).

The Python layer (llama.DecoderLayer) makes dozens of small torch calls per layer, each a
few microseconds of dispatch: at one token per step that rivals the arithmetic. The native
op makes the same calls, to the same kernels with the same tensors, from C++, for every
layer in one call, so its output is bit-identical; it needs the native kernels and the
cpu-native attention backend (whose `stack_args` hands it every layer's caches and the
step's page table). Each layer's weights are packed once into a TorchScript object that
holds the module's own tensors (no copy), and the layers into one DecoderStack.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.lora.layers import LoRAStep
from engine.models.layers import Linear
from engine.models.quantized import MAX_KERNEL_ROWS
from engine.ops.loader import native_kernels

_DENSE, _PACKED, _QUANTIZED, _TILED = 0, 1, 2, 3


def linear_weights(layer: Linear, dense: bool = False) -> Any:
    """The layer's weight as pagedserve's LinearWeights (dense, oneDNN-packed, quantized or
    tiled bfloat16), with its LoRA slots where it has them; with `dense`, a quantized
    layer's dense copy where it has one."""
    weights = _base_weights(layer, dense)
    if layer.lora is not None:
        slots = layer.lora
        weights.set_lora(slots.a, slots.bt, slots.ranks, slots.col_offsets)
    return weights


def _base_weights(layer: Linear, dense: bool) -> Any:
    make = torch.classes.pagedserve.LinearWeights
    if layer.quantized is not None and not (dense and layer.has_dense):
        w = layer.quantized
        return make(
            _QUANTIZED, w.qweight, layer.bias, w.scales, w.mins, w.bits, w.group_size, w.n,
            MAX_KERNEL_ROWS,
        )  # fmt: skip
    if layer.tiled is not None:
        return make(_TILED, layer.tiled, layer.bias, None, None, 0, 0, layer.out_features, 0)
    if layer.packed is not None:
        return make(_PACKED, layer.packed, layer.bias, None, None, 0, 0, 0, 0)
    assert layer.weight is not None
    return make(_DENSE, layer.weight.detach(), layer.bias, None, None, 0, 0, 0, 0)


def layer_weights(layer: Any, dense: bool = False) -> Any:
    """A llama.DecoderLayer's weights as pagedserve's LayerWeights (`dense`: see
    linear_weights)."""
    attn, mlp = layer.self_attn, layer.mlp
    q_norm = None if attn.q_norm is None else attn.q_norm.weight.detach()
    k_norm = None if attn.k_norm is None else attn.k_norm.weight.detach()
    return torch.classes.pagedserve.LayerWeights(
        linear_weights(attn.qkv_proj, dense),
        linear_weights(attn.o_proj, dense),
        linear_weights(mlp.gate_up_proj, dense),
        linear_weights(mlp.down_proj, dense),
        layer.input_layernorm.weight.detach(),
        layer.post_attention_layernorm.weight.detach(),
        q_norm,
        k_norm,
        layer.input_layernorm.eps,
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_dim,
        attn.window or 0,
    )


class FusedLayers:
    """A model's layers (LayerWeights, in order) as one DecoderStack."""

    def __init__(self, weights: list[Any]) -> None:
        self.stack = torch.classes.pagedserve.DecoderStack()
        for layer in weights:
            self.stack.append(layer)
        self.num_layers = len(weights)

    def __len__(self) -> int:
        return self.num_layers


def fused_layers_available(weight: torch.Tensor) -> bool:
    """Whether layers whose weights live like `weight` can run as native ops."""
    return weight.device.type == "cpu" and native_kernels().available


def run_fused_layers(
    layers: FusedLayers,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attn: Any,
    lora: LoRAStep | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layers' loop of llama.DecoderModel.forward, as one native op: (the last
    layer's MLP output, the residual before it); with the step's LoRA segments, if any."""
    if lora is None or not lora.active:
        return _decoder_layers_op()(x, layers.stack, cos, sin, *attn.stack_args())
    return _decoder_layers_op()(
        x, layers.stack, cos, sin, *attn.stack_args(), lora.starts, lora.slots
    )


@functools.cache
def _decoder_layers_op() -> Any:
    """pagedserve::decoder_layers' C++ entry point. Calling an op packet whose schema takes
    a custom class first scans every argument for torch.compile's FakeScriptObject (8 us a
    call here); the packet's own callable (`_op`, what it calls after that scan) does not.
    Where a torch lacks it, the packet."""
    packet = torch.ops.pagedserve.decoder_layers
    return getattr(packet, "_op", packet)
