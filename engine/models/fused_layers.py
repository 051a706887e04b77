"""The decoder layers as one native op on the CPU (engine/ops/csrc/decoder_ops.cpp).

The Python layer (llama.DecoderLayer) makes dozens of small torch calls per layer, each a
few microseconds of dispatch: at one token per step that rivals the arithmetic. The native
op makes the same calls, to the same kernels with the same tensors, from C++, for every
layer in one call, so its output is bit-identical; it needs the native kernels and the
cpu-native attention backend (whose `stack_args` hands it every layer's caches and the
step's page table). Each layer's weights are packed once into a TorchScript object that
holds the module's own tensors (no copy), and the layers into one DecoderStack. A sparse
MLP (moe.SparseMoE) is packed the same way into a MoeWeights, which its layer's weights
hold, and which SparseMoE.forward runs alone (engine/ops/csrc/moe_ops.cpp) where the layers
run in Python.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.config import DENSE_COPY_ROWS
from engine.models.layers import MLP, Linear
from engine.models.lora_layers import LoRAStep
from engine.models.quantized import MAX_KERNEL_ROWS, TiledWeight
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
    linear_weights; a sparse MLP's weights, which moe_weights made, pick their own)."""
    attn, mlp = layer.self_attn, layer.mlp
    q_norm = None if attn.q_norm is None else attn.q_norm.weight.detach()
    k_norm = None if attn.k_norm is None else attn.k_norm.weight.detach()
    dense_mlp = isinstance(mlp, MLP)
    assert dense_mlp or mlp.native is not None, "pack the sparse MLP first (moe_weights)"
    return torch.classes.pagedserve.LayerWeights(
        linear_weights(attn.qkv_proj, dense),
        linear_weights(attn.o_proj, dense),
        linear_weights(mlp.gate_up_proj, dense) if dense_mlp else None,
        linear_weights(mlp.down_proj, dense) if dense_mlp else None,
        None if dense_mlp else mlp.native,
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


def moe_weights(moe: Any) -> Any:
    """A moe.SparseMoE's router and experts as pagedserve's MoeWeights. Each expert's rows
    differ from the step's, so each quantized linear with a dense copy picks quantized or
    dense by its own input's rows, as Linear.forward does."""
    weights = torch.classes.pagedserve.MoeWeights(
        _row_picked_weights(moe.gate), moe.top_k, moe.norm_topk_prob
    )
    for expert in moe.experts:
        weights.append(
            _row_picked_weights(expert.gate_up_proj), _row_picked_weights(expert.down_proj)
        )
    return weights


def _row_picked_weights(layer: Linear) -> Any:
    """linear_weights, with a quantized layer's dense copy (where it has one) for inputs
    of more than DENSE_COPY_ROWS rows."""
    weights = linear_weights(layer)
    if layer.quantized is not None and layer.has_dense:
        weights.set_dense_copy(linear_weights(layer, dense=True), DENSE_COPY_ROWS)
    return weights


def sparse_moe(x: torch.Tensor, weights: Any) -> torch.Tensor:
    """moe.SparseMoE.forward as one native op: x (T, hidden), contiguous, on the CPU."""
    return _sparse_moe_op()(x, weights)


class FusedLayers:
    """A model's layers (LayerWeights, in order) as one DecoderStack; with `set_ends`, the
    whole model (run_fused_model)."""

    def __init__(self, weights: list[Any]) -> None:
        self.stack = torch.classes.pagedserve.DecoderStack()
        for layer in weights:
            self.stack.append(layer)
        self.num_layers = len(weights)
        self.has_ends = False

    def __len__(self) -> int:
        return self.num_layers

    def set_ends(
        self, embed: torch.Tensor | TiledWeight, norm_weight: torch.Tensor, eps: float
    ) -> None:
        """The model's token embedding (its float table, or its quantized one) and its
        final RMSNorm, which run_fused_model runs before and after the layers."""
        make = torch.classes.pagedserve.LinearWeights
        if isinstance(embed, TiledWeight):
            table = make(
                _QUANTIZED, embed.qweight, None, embed.scales, embed.mins, embed.bits,
                embed.group_size, embed.n, MAX_KERNEL_ROWS,
            )  # fmt: skip
        else:
            table = make(_DENSE, embed.detach(), None, None, None, 0, 0, 0, 0)
        self.stack.set_ends(table, norm_weight.detach(), eps)
        self.has_ends = True


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


def run_fused_model(
    layers: FusedLayers,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    attn: Any,
    lora: LoRAStep | None = None,
) -> torch.Tensor:
    """llama.DecoderModel.forward as one native op, on a stack with its ends: the final
    hidden states. cos_table and sin_table (positions, head_dim): RotaryEmbedding's, holding
    every one of `positions`."""
    args = (input_ids, positions, layers.stack, cos_table, sin_table, *attn.stack_args())
    if lora is None or not lora.active:
        return _decoder_model_op()(*args)
    return _decoder_model_op()(*args, lora.starts, lora.slots)


@functools.cache
def _decoder_layers_op() -> Any:
    """pagedserve::decoder_layers' C++ entry point. Calling an op packet whose schema takes
    a custom class first scans every argument for torch.compile's FakeScriptObject (8 us a
    call here); the packet's own callable (`_op`, what it calls after that scan) does not.
    Where a torch lacks it, the packet."""
    packet = torch.ops.pagedserve.decoder_layers
    return getattr(packet, "_op", packet)


@functools.cache
def _decoder_model_op() -> Any:
    """pagedserve::decoder_model's C++ entry point (see _decoder_layers_op)."""
    packet = torch.ops.pagedserve.decoder_model
    return getattr(packet, "_op", packet)


@functools.cache
def _sparse_moe_op() -> Any:
    """pagedserve::sparse_moe's C++ entry point (see _decoder_layers_op)."""
    packet = torch.ops.pagedserve.sparse_moe
    return getattr(packet, "_op", packet)
