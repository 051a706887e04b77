"""A hybrid model's attention: one backend per KV cache group, over one shared cache.

The cache has a K/V pair per slot (engine/kv_cache/groups.py), and each group's backend
sees all of it as if its slots were its layers, with the group's window: layer i runs as
slot layer_slots[i] of group layer_groups[i]'s backend, which plans with that group's
block tables (AttentionMetadata.groups). The groups' blocks are disjoint, so two layers
sharing a slot never touch each other's pages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.kv_cache.groups import KVCacheGroups

# (each slot's window, each slot's sinks or none) -> a backend over the shared cache.
BackendFactory = Callable[[Sequence[int | None], Sequence[torch.Tensor]], AttentionBackend]


class GroupedAttentionBackend:
    def __init__(
        self,
        groups: KVCacheGroups,
        make_backend: BackendFactory,
        sinks: Sequence[torch.Tensor] = (),
    ) -> None:
        """`make_backend(windows, sinks)`: a backend over the shared cache, given each slot's
        window and sinks (empty: none); `sinks`: each layer's, or empty."""
        self.groups = groups
        self.backends: list[AttentionBackend] = []
        for group, window in enumerate(groups.windows):
            layers = groups.layers(group)
            slot_sinks: list[torch.Tensor] = []
            if sinks:  # a slot no layer of the group fills keeps the first one's
                slot_sinks = [
                    sinks[layers[min(s, len(layers) - 1)]] for s in range(groups.num_slots)
                ]
            self.backends.append(make_backend([window] * groups.num_slots, slot_sinks))
        self.name = self.backends[0].name

    def plan(self, metadata: AttentionMetadata) -> None:
        """Mutates the backends: each plans with its group's metadata (group 0's is
        `metadata` itself, the others' `metadata.groups`)."""
        if len(metadata.groups) != len(self.backends) - 1:
            raise ValueError(
                f"a step of {self.groups.num_groups} KV cache groups came with "
                f"{len(metadata.groups) + 1} groups' metadata"
            )
        self.backends[0].plan(metadata)
        for backend, group_metadata in zip(self.backends[1:], metadata.groups, strict=True):
            backend.plan(group_metadata)

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        backend = self.backends[self.groups.layer_groups[layer_idx]]
        return backend.forward(self.groups.layer_slots[layer_idx], q, k, v)
