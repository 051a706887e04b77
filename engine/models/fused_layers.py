"""Decoder layers as single native ops on the CPU (engine/ops/csrc/decoder_ops.cpp).

The Python layer (llama.DecoderLayer) makes dozens of small torch calls per layer, each a
few microseconds of dispatch: at one token per step that rivals the arithmetic. The native
op makes the same calls, to the same kernels with the same tensors, from C++, so its output
is bit-identical; it needs the native kernels and the cpu-native attention backend (whose
`layer_args` hands it the layer's caches and the step's page table). Each layer's weights
are packed once into a TorchScript object that holds the module's own tensors (no copy).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, overload

import torch

from engine.models.layers import Linear
from engine.models.quantized import MAX_KERNEL_ROWS
from engine.ops.loader import native_kernels

_DENSE, _PACKED, _QUANTIZED, _TILED = 0, 1, 2, 3


def linear_weights(layer: Linear, dense: bool = False) -> Any:
    """The layer's weight as pagedserve's LinearWeights (dense, oneDNN-packed, quantized or
    tiled bfloat16);
    with `dense`, a quantized layer's dense copy where it has one."""
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
    )


class FusedLayers(Sequence[Any]):
    """A model's layers as LayerWeights, in order, and the same layers as one DecoderStack:
    with a backend that has `stack_args`, a step crosses into C++ once (decoder_layers)
    rather than once a layer."""

    def __init__(self, weights: list[Any]) -> None:
        self.weights = weights
        self.stack = torch.classes.pagedserve.DecoderStack()
        for layer in weights:
            self.stack.append(layer)

    def __len__(self) -> int:
        return len(self.weights)

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...
    def __getitem__(self, index: int | slice) -> Any:
        return self.weights[index]


def fused_layers_available(weight: torch.Tensor) -> bool:
    """Whether layers whose weights live like `weight` can run as native ops."""
    return weight.device.type == "cpu" and native_kernels().available


def run_fused_layers(
    layers: Sequence[Any], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The decoder layers' loop of llama.DecoderModel.forward, in one native op when the
    backend hands over every layer's caches at once, else one native op per layer: (the last
    layer's MLP output, the residual before it)."""
    stack_args = getattr(attn, "stack_args", None)
    if isinstance(layers, FusedLayers) and len(layers) and stack_args is not None:
        return _decoder_layers_op()(x, layers.stack, cos, sin, *stack_args())
    decoder_layer = _decoder_layer_op()
    residual = None
    for i, weights in enumerate(layers):
        x, residual = decoder_layer(x, residual, weights, cos, sin, *attn.layer_args(i))
    return x, residual


@functools.cache
def _decoder_layer_op() -> Any:
    """pagedserve::decoder_layer's C++ entry point. Calling an op packet whose schema takes
    a custom class first scans every argument for torch.compile's FakeScriptObject (8 us a
    call here, a quarter of a millisecond a decode step over 30 layers); the packet's own
    callable (`_op`, what it calls after that scan) does not. Where a torch lacks it, the
    packet."""
    packet = torch.ops.pagedserve.decoder_layer
    return getattr(packet, "_op", packet)


@functools.cache
def _decoder_layers_op() -> Any:
    """pagedserve::decoder_layers' C++ entry point, for the same reason as _decoder_layer_op."""
    packet = torch.ops.pagedserve.decoder_layers
    return getattr(packet, "_op", packet)
