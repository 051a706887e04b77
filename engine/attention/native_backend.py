"""The native CPU backend: a C++ paged-attention kernel that reads the paged cache in place.

The kernel comes from engine.ops (see engine/ops/loader.py). Unlike the torch backend,
nothing is gathered into padded tensors: each K/V row is read once per (request, KV head)
and used for every query head of the group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention.backend import write_kv
from engine.attention.metadata import AttentionMetadata
from engine.ops.loader import native_kernels


class NativeCpuAttentionBackend:
    name = "cpu-native"

    def __init__(
        self,
        kv_cache: torch.Tensor,
        num_heads: int,
        scale: float,
        windows: Sequence[int | None] = (),
        sinks: Sequence[torch.Tensor] = (),
    ) -> None:
        """`windows`: each layer's sliding window (None: none); empty: no layer has one.
        `sinks`: each layer's sink logits (num_heads,); empty: none."""
        if kv_cache.device.type != "cpu":
            raise ValueError("the cpu-native attention backend needs the KV cache on the CPU")
        kernels = native_kernels()
        if not kernels.available:
            raise RuntimeError(
                f"the native CPU attention kernels are unavailable: {kernels.reason}"
            )
        self.kv_cache = kv_cache  # (layers, 2, blocks, block_size, kv_heads, head_dim)
        _, _, _, _, self.num_kv_heads, self.head_dim = kv_cache.shape
        self.num_heads = num_heads
        self.scale = scale
        # The kernel's window argument per layer: 0 for none.
        self.windows = [w or 0 for w in windows] or [0] * kv_cache.shape[0]
        # The kernel's sinks argument per layer: float32, contiguous; None for none.
        self.sinks: list[torch.Tensor | None] = [s.float().contiguous() for s in sinks]
        self.sinks = self.sinks or [None] * kv_cache.shape[0]
        self._kernel = torch.ops.pagedserve.paged_attention
        self._slot_mapping = torch.empty(0, dtype=torch.long)
        self._metadata: tuple[torch.Tensor, ...] = ()  # qo_indptr, kv_indptr, kv_indices, last
        self._k_caches = [kv_cache[i, 0] for i in range(kv_cache.shape[0])]
        self._v_caches = [kv_cache[i, 1] for i in range(kv_cache.shape[0])]

    def plan(self, metadata: AttentionMetadata) -> None:
        """Mutates the backend: keeps this step's slot mapping and CSR page table (int32
        CPU tensors, as the kernel reads them)."""
        self._slot_mapping = metadata.slot_mapping
        self._metadata = (
            metadata.qo_indptr,
            metadata.kv_indptr,
            metadata.kv_indices,
            metadata.kv_last_page_len,
        )

    def stack_args(self) -> tuple[list[torch.Tensor] | torch.Tensor | float, ...]:
        """What pagedserve::decoder_layers needs of this backend for every layer at once:
        the layers' K caches and V caches, the step's slot mapping and page table, and the
        scale."""
        return (self._k_caches, self._v_caches, self._slot_mapping, *self._metadata, self.scale)

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Mutates the cache: writes this step's K/V, then attends over the paged history."""
        k_cache, v_cache = write_kv(self.kv_cache, layer_idx, self._slot_mapping, k, v)
        if q.stride(-1) != 1 or q.stride(-2) != self.head_dim:
            q = q.contiguous()
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # (T, heads, head_dim)
        window, sinks = self.windows[layer_idx], self.sinks[layer_idx]  # isa None: the best
        self._kernel(out, q, k_cache, v_cache, *self._metadata, self.scale, None, window, sinks)
        return out
