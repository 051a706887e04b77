"""Paged attention: shared metadata, the backend interface, and backend selection."""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend

BACKENDS = ("auto", "torch")


def resolve_backend_name(name: str, device: torch.device | str) -> str:
    """The concrete backend for `name` on `device`; raises ValueError when unavailable."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")
    return "torch"


def create_backend(
    name: str, kv_cache: torch.Tensor, num_heads: int, scale: float
) -> AttentionBackend:
    resolved = resolve_backend_name(name, kv_cache.device)
    if resolved == "torch":
        return TorchAttentionBackend(kv_cache, num_heads, scale)
    raise ValueError(f"attention backend {resolved!r} is not available")
