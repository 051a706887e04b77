"""CUDA graphs for decode-only steps: the decoder is captured once per padded batch size.

A step where every request has one new token, n requests of them, replays the graph of the
smallest capture size b >= n. Rows n..b-1 are padding:

    row    token  position  block table        slot                 kv_len
    0..n-1 real   real      the request's      real                 real
    n..b-1 0      0         [scratch]          scratch * B + 0      1

The scratch block is one extra block at the end of the KV cache tensor; the KV cache manager
is built with one block fewer and never hands it out, so padding writes land nowhere that
is read. Padding outputs are dropped.

The graphs read fixed addresses: input_ids, positions, the slot mapping and FlashInfer's
page-table buffers. Before each replay, copy_() and plan() refresh them (outside the graph).
The capture sizes, the bucket choice, the padding and the buffer sizes are pure functions.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from engine.attention.flashinfer_backend import CudaGraphDecodeAttention, new_workspace
from engine.attention.metadata import AttentionMetadata, build_attention_metadata
from engine.models.llama import DecoderModel
from engine.utils import cdiv


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, then multiples of 16, below max_num_seqs; then max_num_seqs itself, so
    every decode-only step (at most max_num_seqs requests) has a graph."""
    candidates = [1, 2, 4, 8, *range(16, max_num_seqs, 16)]
    return (*(s for s in candidates if s < max_num_seqs), max_num_seqs)


def bucket_for(batch_size: int, sizes: Sequence[int]) -> int | None:
    """The smallest capture size >= batch_size (sizes ascending); None when none is."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class GraphBufferSizes:
    max_batch: int  # rows of input_ids, positions, slot_mapping, last_page_len; indptr has +1
    kv_indices: int  # page ids of one step: every row may hold max_model_len tokens


def graph_buffer_sizes(
    sizes: Sequence[int], max_model_len: int, block_size: int
) -> GraphBufferSizes:
    """Persistent buffer lengths for these capture sizes. A padding row holds one page, never
    more than a real one may."""
    max_batch = max(sizes)
    return GraphBufferSizes(max_batch, max_batch * cdiv(max_model_len, block_size))


def pad_decode_batch(
    num_computed: Sequence[int], block_ids: Sequence[Sequence[int]], size: int, scratch_block: int
) -> tuple[list[int], list[int], list[list[int]]]:
    """build_step_metadata's (num_computed, num_new, block_ids) for a decode step of
    len(num_computed) requests padded to `size` rows (see the module docstring)."""
    pad = size - len(num_computed)
    if pad < 0:
        raise ValueError(f"{len(num_computed)} requests do not fit a graph of size {size}")
    computed = [*num_computed, *([0] * pad)]
    tables = [list(ids) for ids in block_ids] + [[scratch_block] for _ in range(pad)]
    return computed, [1] * size, tables


@dataclass(frozen=True)
class CudaGraphConfig:
    """Decided by the factory: capture these sizes (ascending) for this max_model_len."""

    sizes: tuple[int, ...]
    max_model_len: int


@dataclass(frozen=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    attention: CudaGraphDecodeAttention  # plan() it before each replay
    hidden: torch.Tensor  # (size, hidden_size), written by every replay


class CudaGraphRunner:
    """Captures at construction (after the KV cache exists); `run` replays.

    The KV cache must have one block more than the KV cache manager: the last one is the
    padding rows' scratch block. Mutates the KV cache and its persistent buffers on `run`.
    """

    def __init__(
        self,
        model: DecoderModel,
        kv_cache: torch.Tensor,
        config: CudaGraphConfig,
        workspace: torch.Tensor | None = None,
        flashinfer: ModuleType | None = None,
    ) -> None:
        """`workspace` may be the eager backend's (steps never overlap); `flashinfer` as in
        FlashInferAttentionBackend."""
        self.model = model
        self._flashinfer = flashinfer
        self.kv_cache = kv_cache
        self.sizes = config.sizes
        self.block_size = int(kv_cache.shape[3])
        self.scratch_block = int(kv_cache.shape[2]) - 1
        self.device = kv_cache.device
        if workspace is None:
            workspace = new_workspace(self.device)
        self._workspace = workspace
        sizes = graph_buffer_sizes(self.sizes, config.max_model_len, self.block_size)
        with torch.inference_mode():
            self._allocate(sizes)
            self._graphs = self._capture_all()

    def _allocate(self, sizes: GraphBufferSizes) -> None:
        def zeros(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=self.device)

        self.input_ids = zeros(sizes.max_batch, torch.long)
        self.positions = zeros(sizes.max_batch, torch.long)
        self._slot_mapping = zeros(sizes.max_batch, torch.long)
        self._indptr = zeros(sizes.max_batch + 1, torch.int32)
        self._indices = zeros(sizes.kv_indices, torch.int32)
        self._last_page_len = zeros(sizes.max_batch, torch.int32)

    def _attention(self, size: int) -> CudaGraphDecodeAttention:
        arch = self.model.arch
        buffers = (
            self._indptr[: size + 1],
            self._indices,
            self._last_page_len[:size],
            self._slot_mapping[:size],
        )
        return CudaGraphDecodeAttention(
            self.kv_cache,
            arch.num_heads,
            arch.attention_scale,
            buffers,
            self._workspace,
            self._flashinfer,
            arch.layer_windows,
        )

    def _capture_all(self) -> dict[int, _Graph]:
        self._pool = torch.cuda.graph_pool_handle()  # shared: one graph replays at a time
        # Largest first: the smaller graphs then fit in the memory it leaves in the pool.
        return {size: self._capture(size) for size in sorted(self.sizes, reverse=True)}

    def _capture(self, size: int) -> _Graph:
        attention = self._attention(size)
        padded = pad_decode_batch([], [], size, self.scratch_block)
        attention.plan(build_attention_metadata(*padded, self.block_size, self.device))
        ids, positions = self.input_ids[:size], self.positions[:size]
        # Warm up on a side stream (lazy initialisation must not be captured), as the
        # PyTorch CUDA graphs notes prescribe, then capture on torch.cuda.graph's stream.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.model(ids, positions, attention)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = self.model(ids, positions, attention)  # (size, hidden_size)
        return _Graph(graph, attention, hidden)

    def graph_size(self, num_new: Sequence[int]) -> int | None:
        """The padded batch size whose graph replays a step with these new-token counts, or
        None when the step must run eagerly (not decode-only, or too many requests)."""
        if not all(n == 1 for n in num_new):
            return None
        return bucket_for(len(num_new), self.sizes)

    def run(self, md: AttentionMetadata, input_ids: torch.Tensor, num_reqs: int) -> torch.Tensor:
        """Replays the graph of md.num_reqs rows: `md` and `input_ids` describe the step
        padded with pad_decode_batch, already on the device. Returns the first `num_reqs`
        rows' (num_reqs, hidden_size) states: a view of the graph's output, to be used before
        the next `run`."""
        return self.replay(self.prepare(md, input_ids), num_reqs)

    def prepare(self, md: AttentionMetadata, input_ids: torch.Tensor) -> int:
        """The first half of `run`: fills the graph's inputs and plans its attention (which
        stages the plan in FlashInfer's pinned host buffer). Returns the graph's size."""
        size = md.num_reqs
        graph = self._graphs.get(size)
        if graph is None or input_ids.shape[0] != size:
            raise ValueError(f"no graph of size {size} for {input_ids.shape[0]} input ids")
        self.input_ids[:size].copy_(input_ids)
        self.positions[:size].copy_(md.positions)
        graph.attention.plan(md)
        return size

    def replay(self, size: int, num_reqs: int) -> torch.Tensor:
        """The second half of `run`: replays the prepared graph."""
        graph = self._graphs[size]
        graph.graph.replay()
        return graph.hidden[:num_reqs]
