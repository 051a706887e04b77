"""Sliding-window attention in every backend against dense float64 attention with the same
window (a query at position p sees keys p - window + 1..p, as transformers' sliding_window):
the torch reference, the native kernels in every instruction set, and FlashInfer through its
recording stand-in. Windows are per layer: a layer without one sees everything."""

from __future__ import annotations

import pytest
import torch

from engine.attention.flashinfer_backend import FlashInferAttentionBackend
from engine.attention.metadata import build_attention_metadata
from engine.attention.native_backend import NativeCpuAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from tests.engine.attention.test_native_attention import (
    LAYER,
    TOLERANCE,
    PagedCase,
    make_case,
)
from tests.engine.attention.test_torch_backend import dense_reference
from tests.fake_flashinfer import make_fake_flashinfer
from tests.isas import isa_params

# (computed, new) per request: prefills longer than the windows, chunks of prefill with
# history, decodes short and long (from 512 keys the native kernel splits them in parts).
REQUESTS = [(0, 40), (37, 25), (20, 1), (3, 1), (60, 3), (900, 1)]
WINDOWS = [1, 12, 16, 100, 700]  # 700: the 900-key decode is split in parts


def max_diff_to_dense(case: PagedCase, out: torch.Tensor, window: int | None) -> float:
    scale = case.q.shape[-1] ** -0.5
    max_diff, start = 0.0, 0
    for (computed, new), hist in zip(case.requests, case.histories, strict=True):
        q = case.q[start : start + new]
        ref = dense_reference(q, hist[:, 0], hist[:, 1], computed, scale, window)
        diff = (out[start : start + new].double() - ref).abs().max().item()
        max_diff, start = max(max_diff, diff), start + new
    return max_diff


def layer_windows(window: int | None) -> tuple[int | None, ...]:
    """The case's layer LAYER (1) has `window`; layer 0 the other kind, which must not leak
    into it."""
    return (None if window is not None else 8, window)


def test_torch_backend() -> None:
    pc = make_case(REQUESTS, 6, 2, 32, 16, torch.float32, seed=3)
    for window in [*WINDOWS, None]:
        backend = TorchAttentionBackend(pc.kv_cache, 6, 32**-0.5, layer_windows(window))
        backend.plan(pc.metadata)
        out = backend.forward(LAYER, pc.q, pc.k, pc.v)
        max_diff = max_diff_to_dense(pc, out, window)
        print(f"window {window}: {max_diff:.2e}")
        assert max_diff < 1e-5


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize(
    ("dtype", "block_size"), [(torch.float32, 8), (torch.bfloat16, 16)], ids=["f32-8", "bf16-16"]
)
def test_native_kernel(dtype: torch.dtype, block_size: int, isa: str) -> None:
    """Each window through the backend (the CPU's best set), then the op in `isa`."""
    pc = make_case(REQUESTS, 9, 3, 64, block_size, dtype, seed=4)
    md, (k_cache, v_cache) = pc.metadata, pc.kv_cache[LAYER]
    for window in WINDOWS:
        backend = NativeCpuAttentionBackend(pc.kv_cache, 9, 64**-0.5, layer_windows(window))
        backend.plan(md)
        best = backend.forward(LAYER, pc.q, pc.k, pc.v)
        assert max_diff_to_dense(pc, best, window) < TOLERANCE[dtype]
        out = torch.empty_like(pc.q)
        torch.ops.pagedserve.paged_attention(
            out, pc.q, k_cache, v_cache, md.qo_indptr, md.kv_indptr, md.kv_indices,
            md.kv_last_page_len, 64**-0.5, isa, window,
        )  # fmt: skip
        max_diff = max_diff_to_dense(pc, out, window)
        print(f"{isa} {dtype} bs={block_size} window {window}: {max_diff:.2e}")
        assert max_diff < TOLERANCE[dtype]


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("block_size", [8, 16, 24])
def test_a_windowed_prompt_gives_the_same_rows_whole_or_in_chunks(
    block_size: int, isa: str
) -> None:
    """A row's walk over its window starts on a whole page and a whole chunk of keys, so the
    same row sums its keys in the same chunks wherever the prompt was cut into prefill
    chunks, or the rows into work items: bit for bit the same. (Started on a page only, the
    chunk grid of a row moved with the cut where pages are smaller than chunks.)"""
    prompt, cut, window = 150, 56, 40
    pc = make_case([(0, prompt)], 9, 3, 64, block_size, torch.float32, seed=6)
    md, (k_cache, v_cache) = pc.metadata, pc.kv_cache[LAYER]
    backend = NativeCpuAttentionBackend(pc.kv_cache, 9, 64**-0.5, layer_windows(window))
    backend.plan(md)
    backend.forward(LAYER, pc.q, pc.k, pc.v)  # writes the whole prompt's K/V

    def attend(computed: int, new: int) -> torch.Tensor:
        pages = md.kv_indices[: -(-(computed + new) // block_size)].tolist()
        chunk = build_attention_metadata([computed], [new], [pages], block_size)
        out = torch.empty_like(pc.q[computed : computed + new])
        torch.ops.pagedserve.paged_attention(
            out, pc.q[computed : computed + new], k_cache, v_cache, chunk.qo_indptr,
            chunk.kv_indptr, chunk.kv_indices, chunk.kv_last_page_len, 64**-0.5, isa, window,
        )  # fmt: skip
        return out

    whole = attend(0, prompt)
    assert max_diff_to_dense(pc, whole, window) < TOLERANCE[torch.float32]
    for computed in (cut, cut + 5):
        assert torch.equal(attend(computed, prompt - computed), whole[computed:])


def test_native_kernel_refuses_a_negative_window() -> None:
    pc = make_case([(3, 2)], 2, 2, 16, 16, torch.float32)
    md, (k_cache, v_cache) = pc.metadata, pc.kv_cache[LAYER]
    with pytest.raises(RuntimeError, match="window must be 0"):
        torch.ops.pagedserve.paged_attention(
            torch.empty_like(pc.q), pc.q, k_cache, v_cache, md.qo_indptr, md.kv_indptr,
            md.kv_indices, md.kv_last_page_len, 1.0, window=-1,
        )  # fmt: skip


@pytest.mark.parametrize("window", [12, None])
@pytest.mark.parametrize("decode_only", [False, True])
def test_flashinfer_plans_each_window(window: int | None, decode_only: bool) -> None:
    """Every window among the layers gets its wrappers, planned with window_left =
    window - 1 (-1: none); a layer runs on its own window's."""
    requests = [(20, 1), (3, 1), (250, 1)] if decode_only else REQUESTS[:7]
    pc = make_case(requests, 4, 2, 64, 16, torch.float16, seed=5)
    fake, calls = make_fake_flashinfer()
    windows = layer_windows(window)
    backend = FlashInferAttentionBackend(pc.kv_cache, 4, 64**-0.5, fake, windows=windows)
    backend.plan(pc.metadata)
    planned = sorted(c.arguments["window_left"] for c in calls if c.method == "plan")
    assert planned == sorted(-1 if w is None else w - 1 for w in windows)
    out = backend.forward(LAYER, pc.q, pc.k, pc.v)
    assert max_diff_to_dense(pc, out, window) < TOLERANCE[torch.float16]
