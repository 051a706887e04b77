"""How a model's layers share the paged KV cache: groups of layers, one block table each
(pure Python).

A model whose layers all attend alike (all see every token, or all the same sliding window)
has one group: every layer reads and writes the same pages of its own K/V tensor. A hybrid
model mixes full layers with sliding ones (gpt-oss alternates them, Gemma 3 has five local
layers a global one): the full layers need a page for every token, the sliding ones only for
the last window's. Giving both one table would keep the sliding layers' pages for the whole
sequence. Instead, as vLLM's hybrid allocator does, layers of one kind are grouped, each
group has its own block table, and all groups draw blocks from one shared pool:

    gpt-oss, 4 layers     F S F S          (F: full attention, S: sliding window)
    groups                g0 = F layers 0, 2      g1 = S layers 1, 3
    slots                 layer 0 -> slot 0, layer 2 -> slot 1 (g0)
                          layer 1 -> slot 0, layer 3 -> slot 1 (g1)

The cache tensor has one K/V pair per slot, not per layer: (num_slots, 2, blocks, ...). A
block id belongs to one group at a time, so layer 0 and layer 1 can share slot 0's tensor:
block 7 holds layer 0's K/V when group 0 owns it, layer 1's when group 1 does. A group holds
as many layers as the smallest kind has (`num_slots`); a kind with more layers gets several
groups (Gemma 3's 22 sliding and 4 full layers: 6 sliding groups of up to 4 and one full).
A block costs num_slots layers' K/V, and a long sequence holds pages in the full groups for
every token but in the sliding ones for its window only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.utils import cdiv


@dataclass(frozen=True)
class KVCacheGroups:
    # Each group's sliding window in tokens (None: the group's layers see every token).
    windows: tuple[int | None, ...]
    # Each layer's group, and its index in the cache tensor's first dimension.
    layer_groups: tuple[int, ...]
    layer_slots: tuple[int, ...]
    num_slots: int

    @classmethod
    def single(cls, num_layers: int, window: int | None = None) -> KVCacheGroups:
        """One group, one slot a layer: every layer reads the same pages."""
        return cls((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)

    @classmethod
    def for_layers(cls, layer_windows: Sequence[int | None]) -> KVCacheGroups:
        """Groups of layers with equal windows, full-attention groups first (group 0 is a
        full one in a hybrid model: its blocks are the ones KV events report)."""
        kinds = sorted(set(layer_windows), key=lambda w: -1 if w is None else w)
        if len(kinds) == 1:
            return cls.single(len(layer_windows), kinds[0])
        layers_of = {w: [i for i, lw in enumerate(layer_windows) if lw == w] for w in kinds}
        num_slots = min(len(layers) for layers in layers_of.values())
        windows: list[int | None] = []
        groups = [0] * len(layer_windows)
        slots = [0] * len(layer_windows)
        for window in kinds:
            layers = layers_of[window]
            for start in range(0, len(layers), num_slots):
                for slot, layer in enumerate(layers[start : start + num_slots]):
                    groups[layer], slots[layer] = len(windows), slot
                windows.append(window)
        return cls(tuple(windows), tuple(groups), tuple(slots), num_slots)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_layers(self) -> int:
        return len(self.layer_groups)

    @property
    def hybrid(self) -> bool:
        return self.num_groups > 1

    def describe(self) -> str:
        """For the startup log: '2 groups (full, window 128) of 12 layers'."""
        kinds = ", ".join("full" if w is None else f"window {w}" for w in self.windows)
        return f"{self.num_groups} groups ({kinds}) of {self.num_slots} layers"

    def layers(self, group: int) -> list[int]:
        """The group's layers, in slot order."""
        return [i for i, g in enumerate(self.layer_groups) if g == group]


def blocks_for_one_request(
    windows: Sequence[int | None], block_size: int, max_model_len: int, max_chunk: int
) -> int:
    """The most blocks one request of up to max_model_len tokens, scheduled in chunks of up
    to max_chunk, holds at once over groups with these windows: in each group, all of its
    pages, or with a window, those of the window before a chunk and the chunk's (one more
    where the window starts mid-block)."""
    whole = cdiv(max_model_len, block_size)
    return sum(
        whole if window is None else min(whole, cdiv(window - 1 + max_chunk, block_size) + 1)
        for window in windows
    )
