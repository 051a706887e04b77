"""Paged attention: shared metadata, the backend interface, and backend selection.

    backend      device  what it is
    torch        any     the reference: block gathers + batched matmuls (tested vs dense)
    cpu-native   CPU     C++ kernels that read the paged cache in place (JIT-built once)
    flashinfer   CUDA    FlashInfer's paged prefill/decode wrappers

`auto` picks flashinfer on CUDA and cpu-native on CPU when they can run, else torch.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.flashinfer_backend import FlashInferAttentionBackend, select_gpu_backend
from engine.attention.native_backend import NativeCpuAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.ops.build import native_kernels_available

BACKENDS = ("auto", "torch", "cpu-native", "flashinfer")


def resolve_backend_name(
    name: str, device: torch.device | str, dtype: torch.dtype | None = None
) -> str:
    """The concrete backend for `name` on `device`; raises ValueError when unavailable.

    May import flashinfer or compile the native CPU kernels (once per machine; cached).
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")
    on_cpu = torch.device(device).type == "cpu"
    if name == "flashinfer" or (name == "auto" and not on_cpu):
        return select_gpu_backend(name, device, dtype)
    if name == "auto":
        return "cpu-native" if native_kernels_available() else "torch"
    if name == "cpu-native":
        if not on_cpu:
            raise ValueError("attention backend 'cpu-native' runs only on the CPU")
        if not native_kernels_available():
            raise ValueError(
                "attention backend 'cpu-native' is unavailable: its C++ kernels could not be "
                "built (needs a C++ compiler and `pip install ninja`; see the warning above); "
                "use --attention-backend torch"
            )
    return name


def create_backend(
    name: str, kv_cache: torch.Tensor, num_heads: int, scale: float
) -> AttentionBackend:
    resolved = resolve_backend_name(name, kv_cache.device, kv_cache.dtype)
    if resolved == "flashinfer":
        return FlashInferAttentionBackend(kv_cache, num_heads, scale)
    if resolved == "cpu-native":
        return NativeCpuAttentionBackend(kv_cache, num_heads, scale)
    return TorchAttentionBackend(kv_cache, num_heads, scale)
