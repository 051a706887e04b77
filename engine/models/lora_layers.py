"""The adapters' weights beside one linear layer, and how a step applies them.

Each adaptable layer holds, for every one of the --max-loras slots, A stacked over its
output slices and B laid out to match, so that one slot is one pair of GEMMs whatever
the adapter targets. qkv_proj with rank limit R, for an adapter of rank r on q and v:

    a[slot]:  rows 0..r of the q block = A_q, rows 2R..2R+r of the v block = A_v, else 0
              (3R, in_features)
    bt[slot]: B_q^T at rows 0..r, columns 0..q_size; B_v^T at rows 2R..2R+r, the v
              columns; else 0                                  (3R, out_features)

so x a[slot]^T bt[slot] is (B_q A_q x, 0, B_v A_v x). Every slot has one shape; the native
kernel reads only each block's rows up to the adapter's rank, and of bt only the block's
own output columns (`col_offsets`). A step's tokens come in request order; LoRAStep holds the
runs of consecutive tokens of one adapter, and `apply` adds each run's product to the
layer's output rows, leaving the base model's rows untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.models.lora_adapter import LoRAPart
from engine.ops import native_ops


@dataclass
class LoRAStep:
    """The step's adapter segments: token rows starts[2i] to starts[2i + 1] use slot
    slots[i]; empty when no token of the step has an adapter."""

    starts: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return bool(self.slots)

    def set(self, row_slots: list[int], row_tokens: list[int]) -> None:
        """From each request's slot (-1: the base model) and token count, in batch order.
        `starts` holds each run's [begin, end) bounds, two entries per slot entry."""
        starts: list[int] = []
        slots: list[int] = []
        row = 0
        for slot, count in zip(row_slots, row_tokens, strict=True):
            if slot >= 0 and count:
                if slots and slots[-1] == slot and starts[-1] == row:
                    starts[-1] = row + count  # the run before goes on
                else:
                    starts += [row, row + count]
                    slots.append(slot)
            row += count
        self.starts, self.slots = starts, slots

    def clear(self) -> None:
        self.starts, self.slots = [], []


class LoRASlots:
    """One layer's adapter slots (see the module's docstring)."""

    def __init__(
        self,
        in_features: int,
        slice_sizes: tuple[int, ...],
        max_loras: int,
        max_rank: int,
        step: LoRAStep,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.slice_sizes = slice_sizes
        self.max_rank = max_rank
        # Where each slice's outputs start, and the end: [0, q, q + k, q + k + v].
        self.col_offsets = [0]
        for size in slice_sizes:
            self.col_offsets.append(self.col_offsets[-1] + size)
        rows = max_rank * len(slice_sizes)
        self.a = torch.zeros(max_loras, rows, in_features, dtype=dtype, device=device)
        self.bt = torch.zeros(max_loras, rows, sum(slice_sizes), dtype=dtype, device=device)
        # Per slot, the adapter's rank: the kernel skips each block's rows past it.
        self.ranks = torch.zeros(max_loras, dtype=torch.long)
        self.step = step

    def load(self, slot: int, parts: list[LoRAPart]) -> None:
        """Puts an adapter's parts for this layer in `slot` (none: the slot adds zero)."""
        self.a[slot].zero_()
        self.bt[slot].zero_()
        self.ranks[slot] = max((part.a.shape[0] for part in parts), default=0)
        offsets = self.col_offsets
        for part in parts:
            r = part.a.shape[0]
            # A part for the whole layer is one per slice: the same A in each slice's block,
            # and B's rows for that slice's outputs.
            for s in range(len(self.slice_sizes)) if part.slice is None else [part.slice]:
                row, cols = s * self.max_rank, slice(offsets[s], offsets[s + 1])
                b = part.b if part.slice is not None else part.b[cols]
                self.a[slot, row : row + r].copy_(part.a)
                self.bt[slot, row : row + r, cols].copy_(b.t())

    def apply(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """Adds the step's adapters' products to y (T, out) in place; x is (T, in)."""
        native_ops.lora_apply_(
            y,
            x,
            self.a,
            self.bt,
            self.ranks,
            self.col_offsets,
            self.step.starts,
            self.step.slots,
        )
