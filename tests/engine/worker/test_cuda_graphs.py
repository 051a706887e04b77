"""CUDA graphs without a GPU: capture sizes, buckets, buffer sizes, padding, and the
runner's replay path with the capture replaced by an eager stand-in."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.attention.backend import allocate_kv_cache
from engine.attention.flashinfer_backend import FlashInferAttentionBackend
from engine.attention.metadata import build_attention_metadata
from engine.kv_cache import KVCacheManager
from engine.models.loader import load_model
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.utils import cdiv
from engine.worker.cuda_graphs import (
    CudaGraphConfig,
    CudaGraphRunner,
    _Graph,
    bucket_for,
    capture_sizes,
    graph_buffer_sizes,
    pad_decode_batch,
)
from tests.fake_flashinfer import make_fake_flashinfer
from tests.tiny_models import make_tiny_model


@pytest.mark.parametrize(
    ("max_num_seqs", "expected"),
    [
        (1, (1,)),
        (5, (1, 2, 4, 5)),
        (8, (1, 2, 4, 8)),
        (16, (1, 2, 4, 8, 16)),
        (64, (1, 2, 4, 8, 16, 32, 48, 64)),
        (100, (1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100)),
    ],
)
def test_capture_sizes(max_num_seqs: int, expected: tuple[int, ...]) -> None:
    assert capture_sizes(max_num_seqs) == expected


def test_bucket_is_the_smallest_size_that_fits() -> None:
    sizes = capture_sizes(64)
    batches = (1, 2, 3, 5, 8, 9, 17, 33, 48, 49, 64)
    buckets = (1, 2, 4, 8, 8, 16, 32, 48, 48, 64, 64)
    assert [bucket_for(n, sizes) for n in batches] == list(buckets)
    assert bucket_for(65, sizes) is None
    # Every batch the scheduler can form (at most max_num_seqs requests) has a graph.
    for max_num_seqs in (1, 3, 16, 40, 100):
        sizes = capture_sizes(max_num_seqs)
        assert all(bucket_for(n, sizes) is not None for n in range(1, max_num_seqs + 1))


def test_buffer_sizes_hold_the_largest_batch_at_max_model_len() -> None:
    sizes = graph_buffer_sizes(capture_sizes(64), max_model_len=1000, block_size=16)
    assert sizes.max_batch == 64
    assert sizes.kv_indices == 64 * 63  # cdiv(1000, 16) pages per row


def test_padding_rows_go_to_the_scratch_block() -> None:
    block_size, scratch = 16, 99
    computed, tables = [5, 17], [[1], [2, 3]]
    padded = pad_decode_batch(computed, tables, size=4, scratch_block=scratch)
    assert padded == ([5, 17, 0, 0], [1, 1, 1, 1], [[1], [2, 3], [99], [99]])
    md = build_attention_metadata(*padded, block_size)
    real = build_attention_metadata(computed, [1, 1], tables, block_size)
    # The real rows are untouched; padding: position 0, slot 0 of the scratch block, kv_len 1.
    assert md.positions.tolist() == [*real.positions.tolist(), 0, 0]
    assert md.slot_mapping.tolist() == [*real.slot_mapping.tolist(), 99 * 16, 99 * 16]
    assert md.kv_indices.tolist() == [*real.kv_indices.tolist(), 99, 99]
    assert md.kv_indptr.tolist()[:3] == real.kv_indptr.tolist()
    assert md.kv_last_page_len.tolist() == [*real.kv_last_page_len.tolist(), 1, 1]
    assert md.is_decode_only and md.num_reqs == 4
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode_batch(computed, tables, size=1, scratch_block=scratch)


def test_the_kv_cache_manager_never_hands_out_the_scratch_block() -> None:
    """The runner allocates num_blocks + 1 blocks; the manager knows num_blocks of them."""
    num_blocks, block_size = 6, 4
    manager = KVCacheManager(num_blocks, block_size, enable_caching=False)
    request = Request("r", list(range(3, 3 + num_blocks * block_size)), SamplingParams())
    assert manager.allocate_slots(request, num_blocks * block_size) is not None
    assert sorted(manager.block_ids("r")) == list(range(num_blocks))
    other = Request("o", [3], SamplingParams())
    assert manager.allocate_slots(other, 1) is None  # the pool is exhausted at num_blocks


class EagerReplay:
    """Stands in for a captured graph on CPU: replay() runs the decoder on the static inputs."""

    def __init__(self, runner: CudaGraphRunner, size: int, attention: object) -> None:
        self.runner, self.size, self.attention = runner, size, attention
        self.hidden = torch.empty(size, runner.model.arch.hidden_size, dtype=torch.bfloat16)

    def replay(self) -> None:
        ids, positions = self.runner.input_ids[: self.size], self.runner.positions[: self.size]
        self.hidden.copy_(self.runner.model(ids, positions, self.attention))


class EagerReplayRunner(CudaGraphRunner):
    """The real runner with its capture replaced: run() is exercised as on the GPU."""

    def _capture_all(self) -> dict[int, _Graph]:
        graphs = {}
        for size in self.sizes:
            replay = EagerReplay(self, size, self._attention(size))
            graphs[size] = _Graph(replay, replay.attention, replay.hidden)
        return graphs


def test_graph_runner_replays_padded_decode_steps(tmp_path: Path) -> None:
    """CudaGraphRunner.run on CPU (fake FlashInfer, graphs replaced by eager replays): each
    decode step equals the eager FlashInfer backend on the unpadded step."""
    # head_dim 64: a size FlashInfer has kernels for.
    path = make_tiny_model("llama", tmp_path, hidden_size=256, head_dim=64)
    model, arch = load_model(path, torch.bfloat16, "cpu")
    fake, _ = make_fake_flashinfer()
    num_blocks, block_size, scale = 64, 16, arch.head_dim**-0.5
    shape = (arch.num_layers, num_blocks + 1, block_size, arch.num_kv_heads, arch.head_dim)
    graph_cache = allocate_kv_cache(*shape, torch.bfloat16, "cpu")
    graph_cache.normal_()  # earlier steps' K/V
    eager_cache = graph_cache.clone()
    workspace = torch.zeros(16, dtype=torch.uint8)
    config = CudaGraphConfig(capture_sizes(8), max_model_len=256)
    runner = EagerReplayRunner(model, graph_cache, config, workspace, flashinfer=fake)
    assert runner.scratch_block == num_blocks
    eager = FlashInferAttentionBackend(eager_cache, arch.num_heads, scale, fake, workspace)
    rng = np.random.default_rng(0)
    for n in (1, 3, 6, 8):
        size = runner.graph_size([1] * n)
        assert size is not None and size >= n and runner.graph_size([1] * (n - 1) + [2]) is None
        computed = rng.integers(0, 100, n).tolist()
        blocks = iter(rng.permutation(num_blocks).tolist())
        tables = [[next(blocks) for _ in range(cdiv(c + 1, block_size))] for c in computed]
        ids = rng.integers(3, 256, n)
        md = build_attention_metadata(computed, [1] * n, tables, block_size)
        padded = pad_decode_batch(computed, tables, size, runner.scratch_block)
        padded_md = build_attention_metadata(*padded, block_size)
        padded_ids = torch.from_numpy(np.pad(ids, (0, size - n)))
        with torch.inference_mode():
            hidden = runner.run(padded_md, padded_ids, n)
            eager.plan(md)
            expected = model(torch.from_numpy(ids), md.positions, eager)
        assert hidden.shape == expected.shape == (n, arch.hidden_size)
        torch.testing.assert_close(hidden, expected, atol=2e-2, rtol=2e-2)
        real = graph_cache[:, :, :num_blocks].float()
        torch.testing.assert_close(real, eager_cache[:, :, :num_blocks].float(), atol=2e-2, rtol=0)
    assert runner.graph_size([1] * 9) is None
