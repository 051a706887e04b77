"""Paged attention: shared metadata, the backend interface, and backend selection.

    backend      device  what it is
    torch        any     the reference: block gathers + batched matmuls (tested vs dense)
    cpu-native   CPU     C++ kernels that read the paged cache in place (built at install)
    flashinfer   CUDA    FlashInfer's paged prefill/decode wrappers

`auto` picks flashinfer on CUDA and cpu-native on CPU when they can run, else torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention.backend import AttentionBackend, BackendChoice
from engine.attention.flashinfer_backend import FlashInferAttentionBackend, select_gpu_backend
from engine.attention.grouped import GroupedAttentionBackend
from engine.attention.native_backend import NativeCpuAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kv_cache.groups import KVCacheGroups
from engine.ops.loader import native_kernels

BACKENDS = ("auto", "torch", "cpu-native", "flashinfer")


def resolve_backend(
    name: str, device: torch.device | str, dtype: torch.dtype | None = None, sinks: bool = False
) -> BackendChoice:
    """The concrete backend for `name` on `device` and why; raises ValueError when `name`
    cannot run there (with the reason). May import flashinfer or load the native kernels.
    With `sinks` (a model with attention sinks, gpt-oss), flashinfer is refused, and on a GPU
    auto picks torch."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")
    on_cpu = torch.device(device).type == "cpu"
    if sinks and name == "auto" and not on_cpu:
        return BackendChoice("torch", "auto: flashinfer here has no attention sinks (gpt-oss)")
    if sinks and name == "flashinfer":
        raise ValueError(
            "attention backend 'flashinfer' does not implement attention sinks (gpt-oss); "
            "use --attention-backend torch"
        )
    if name == "flashinfer" or (name == "auto" and not on_cpu):
        return select_gpu_backend(name, device, dtype)
    if name == "cpu-native" and not on_cpu:
        raise ValueError("attention backend 'cpu-native' runs only on the CPU")
    if name == "torch":
        return BackendChoice(name, "requested")
    kernels = native_kernels()
    if name == "auto":
        if kernels.available:
            return BackendChoice("cpu-native", "auto: the native CPU kernels load")
        return BackendChoice(
            "torch", f"auto: the native CPU kernels are unavailable: {kernels.reason}"
        )
    if not kernels.available:
        raise ValueError(
            f"attention backend 'cpu-native' is unavailable: {kernels.reason}; "
            "or use --attention-backend torch"
        )
    return BackendChoice(name, "requested")


def create_backend(
    name: str,
    kv_cache: torch.Tensor,
    num_heads: int,
    scale: float,
    windows: Sequence[int | None] = (),
    sinks: Sequence[torch.Tensor] = (),
    groups: KVCacheGroups | None = None,
) -> AttentionBackend:
    """`windows`: each layer's sliding window in tokens (None: none); empty: no layer has
    one. `sinks`: each layer's attention sinks (num_heads,), which flashinfer does not
    implement; empty: none. With a hybrid model's KV cache `groups`, the cache holds one
    K/V pair a slot, and a backend per group runs over it (grouped.py)."""
    if groups is not None and groups.hybrid:
        return GroupedAttentionBackend(
            groups,
            lambda slot_windows, slot_sinks: create_backend(
                name, kv_cache, num_heads, scale, slot_windows, slot_sinks
            ),
            sinks,
        )
    resolved = resolve_backend(name, kv_cache.device, kv_cache.dtype, bool(sinks)).name
    if resolved == "flashinfer":
        return FlashInferAttentionBackend(kv_cache, num_heads, scale, windows=windows)
    if resolved == "cpu-native":
        return NativeCpuAttentionBackend(kv_cache, num_heads, scale, windows, sinks)
    return TorchAttentionBackend(kv_cache, num_heads, scale, windows, sinks)
