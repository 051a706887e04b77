"""Per-step host-to-device copies through pinned buffers (CUDA only; the CPU path never uses them).

The metadata is built on the host with numpy. Each step, its tensors are copied into
persistent pinned buffers and sent to the GPU with non_blocking=True, so the host does not
wait for the transfers. Before a buffer is overwritten the next step, an event recorded after
the previous copies is waited on; the step's sampling has normally finished them long before.
"""

from __future__ import annotations

import torch


class PinnedBuffers:
    """Mutated by `to_device` only: it owns the pinned buffers, one per argument position."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: list[torch.Tensor] = []
        self._copied: torch.cuda.Event | None = None

    def to_device(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """CPU tensors in, device copies out (their transfers may still be in flight on the
        current stream, which orders them before any kernel that reads them)."""
        if self._copied is not None:
            self._copied.synchronize()
        out = tuple(self._upload(i, t) for i, t in enumerate(tensors))
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))
        return out

    def _upload(self, slot: int, tensor: torch.Tensor) -> torch.Tensor:
        if slot == len(self._buffers):
            self._buffers.append(torch.empty(0, dtype=tensor.dtype))
        buffer = self._buffers[slot]
        if buffer.numel() < tensor.numel() or buffer.dtype != tensor.dtype:
            # Grow to a power of two so buffers settle after a few steps.
            capacity = 1 << max(tensor.numel() - 1, 0).bit_length()
            buffer = torch.empty(capacity, dtype=tensor.dtype, pin_memory=True)
            self._buffers[slot] = buffer
        staged = buffer[: tensor.numel()].view(tensor.shape)
        staged.copy_(tensor)
        return staged.to(self.device, non_blocking=True)
