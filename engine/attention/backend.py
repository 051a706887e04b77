"""The interface every attention backend implements, and the KV cache it works on."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.attention.metadata import AttentionMetadata
from engine.ops import hugepages


@dataclass(frozen=True)
class BackendChoice:
    """The concrete backend an --attention-backend setting means on a device, and why."""

    name: str  # "torch", "cpu-native" or "flashinfer"
    reason: str

    def describe(self) -> str:
        return f"{self.name} ({self.reason})"


class AttentionBackend(Protocol):
    """`plan` once per step, then `forward` once per layer.

    `forward` writes the step's K/V into the paged cache through `slot_mapping` first and
    then attends over each request's whole paged history, so requests in the same batch
    can share blocks that are being filled in this very step.
    """

    name: str

    def plan(self, metadata: AttentionMetadata) -> None:
        """Mutates the backend: prepares per-step state. Called once per step."""
        ...

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q: (T, heads, head_dim); k, v: (T, kv_heads, head_dim) -> (T, heads, head_dim)."""
        ...


def write_kv(
    kv_cache: torch.Tensor,
    layer_idx: int,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mutates the cache: stores this step's K/V (T, kv_heads, head_dim) at their slots.

    Returns the layer's (k_cache, v_cache), each (blocks, block_size, kv_heads, head_dim).
    """
    k_cache, v_cache = kv_cache[layer_idx]
    _, _, num_kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
    return k_cache, v_cache


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), allocated once.

    kv_cache[layer, 0] and kv_cache[layer, 1] are that layer's contiguous K and V (NHD).
    """
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # On the CPU in huge pages: attention's reads hop from block to block. Faulted in
    # before the engine is ready (hugepages.py says why not behind its start).
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return hugepages.zeros(nbytes).view(dtype).view(shape)


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size
