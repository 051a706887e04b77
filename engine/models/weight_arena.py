"""A CPU model's weights moved into huge pages (engine/ops/hugepages.py), in the order a
step reads them: each layer's norms and linears (a quantized layer's quantized weights),
the final norm and the LM head; then the quantized layers' and head's dense copies, which
only steps of more than DENSE_COPY_ROWS rows read. The modules keep their tensors' shapes,
dtypes and values; only where they live changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.models.layers import Linear
from engine.models.quantized import TiledWeight
from engine.ops import hugepages

if TYPE_CHECKING:
    from engine.models.llama import DecoderModel

# A tensor to move, and what puts its copy in its place.
Slot = tuple[torch.Tensor, Callable[[torch.Tensor], None]]


def gather_weights(model: DecoderModel) -> int:
    """Moves `model`'s step weights (see the module's doc) into one huge-page mapping;
    returns the bytes moved. Call after pack_weights laid them out, before the native
    layers (FusedLayers) take their tensors."""
    step: list[Slot] = []
    dense: list[Slot] = []
    for layer in model.layers:
        for module in layer.modules():
            if isinstance(module, Linear):
                _linear_slots(module, step, dense)
            else:
                step += _parameter_slots(module)
    step += _parameter_slots(model.norm)
    _head_slots(model, step, dense)
    slots = [s for s in step + dense if s[0].device.type == "cpu" and s[0].numel()]
    copies = hugepages.gather([tensor for tensor, _ in slots])
    for (_, put), copy in zip(slots, copies, strict=True):
        put(copy)
    return sum(c.numel() * c.element_size() for c in copies)


def _parameter_slots(module: nn.Module) -> list[Slot]:
    """The module's own parameters (not its children's); sub-modules that are Linear
    layers are visited on their own."""
    if isinstance(module, Linear):
        return []
    return [_param_slot(p) for p in module.parameters(recurse=False)]


def _param_slot(param: nn.Parameter) -> Slot:
    def put(copy: torch.Tensor) -> None:
        param.data = copy

    return param, put


def _tiled_slots(owner: object, attr: str) -> list[Slot]:
    """A TiledWeight attribute's tensors; the copies replace it with a new TiledWeight."""
    weight: TiledWeight = getattr(owner, attr)
    names = [f for f in ("qweight", "scales", "mins") if getattr(weight, f) is not None]
    moved: dict[str, Any] = {}

    def putter(name: str) -> Callable[[torch.Tensor], None]:
        def put(copy: torch.Tensor) -> None:
            moved[name] = copy
            if len(moved) == len(names):
                setattr(owner, attr, dataclasses.replace(weight, **moved))

        return put

    return [(getattr(weight, name), putter(name)) for name in names]


def _linear_slots(layer: Linear, step: list[Slot], dense: list[Slot]) -> None:
    """A linear layer's weights: what small steps read to `step` (the quantized weight of a
    quantized layer, else its float one), a quantized layer's dense copy to `dense`."""
    floats: list[Slot] = []
    if layer.tiled is not None:

        def put_tiled(copy: torch.Tensor) -> None:
            layer.tiled = copy

        floats.append((layer.tiled, put_tiled))
    if layer.weight is not None:
        floats.append(_param_slot(layer.weight))
    if layer.quantized is not None:
        step += _tiled_slots(layer, "quantized")
        dense += floats
    else:
        step += floats
    if layer.bias is not None:
        step.append(_param_slot(layer.bias))


def _head_slots(model: DecoderModel, step: list[Slot], dense: list[Slot]) -> None:
    """The LM head: its quantized weight (and the embedding's, where they are one), a
    dense copy or tiled float head, or a plain float head (the embedding, where tied)."""
    if not model.has_lm_head:
        return
    if model.quantized_head is not None:
        tied = model.quantized_head is model.quantized_embed
        slots = _tiled_slots(model, "quantized_head")
        if tied:  # the embedding's lookups read the same tensors
            last = slots[-1]

            def put_last(copy: torch.Tensor) -> None:
                last[1](copy)
                model.quantized_embed = model.quantized_head

            slots[-1] = (last[0], put_last)
        step += slots
    if model.head_screen is not None:  # what steps of a few rows read instead of the head
        screen = model.head_screen

        def putter(name: str) -> Callable[[torch.Tensor], None]:
            def put(copy: torch.Tensor) -> None:
                setattr(screen, name, copy)

            return put

        step += [(getattr(screen, name), putter(name)) for name in ("weight", "bounds")]
    if model.dense_head is not None:
        _linear_slots(model.dense_head, dense if model.quantized_head is not None else step, dense)
        return
    if model.quantized_head is None:  # a plain float head, read as it is
        head = model.embed_tokens if model.lm_head is None else model.lm_head
        if head is not None:
            step.append(_param_slot(head))
