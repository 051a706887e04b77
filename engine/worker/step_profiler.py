"""Optional wall-clock accounting of where step time goes (off by default: no overhead).

On a GPU the kernels run asynchronously, so a section timed on the host alone would show
only its launches, and the whole step's GPU time would land in whichever section first
waits for a result (sampling's `tolist()`). There each section synchronizes the device at
its start and its end: the totals then hold each section's GPU time too, at the price of
the overlap between host and GPU work that profiling turns off."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata


class StepProfiler:
    """Accumulates seconds per named section. The model runner's sections do not overlap
    (metadata, forward, logits, grammar, sampling), except `attention`, measured inside
    `forward` where the attention backend is called from Python: the native decoder layers
    (engine/models/fused_layers.py) attend in C++, and then it is absent."""

    def __init__(self, enabled: bool, device: torch.device | str = "cpu") -> None:
        self.enabled = enabled
        self.synchronize = torch.device(device).type == "cuda"
        self.totals: dict[str, float] = defaultdict(float)

    def section(self, name: str) -> Any:
        return self._timed(name) if self.enabled else nullcontext()

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        if self.synchronize:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.synchronize:
                torch.cuda.synchronize()
            self.totals[name] += time.perf_counter() - start

    def wrap_backend(self, backend: AttentionBackend) -> AttentionBackend:
        return _TimedBackend(backend, self) if self.enabled else backend

    def report(self) -> dict[str, float]:
        return dict(self.totals)


class _TimedBackend:
    def __init__(self, inner: AttentionBackend, profiler: StepProfiler) -> None:
        self.inner = inner
        self.profiler = profiler
        self.name = inner.name
        # The native decoder layers' arguments: without them the model would fall back to
        # its Python layers, and a profile would time another path than the one it serves.
        if hasattr(inner, "stack_args"):
            self.stack_args = inner.stack_args

    def plan(self, metadata: AttentionMetadata) -> None:
        with self.profiler.section("attention_plan"):
            self.inner.plan(metadata)

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        with self.profiler.section("attention"):
            return self.inner.forward(layer_idx, q, k, v)
