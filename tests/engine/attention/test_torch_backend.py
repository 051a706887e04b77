"""Attention metadata and the torch backend against plain dense causal attention."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine.attention.backend import allocate_kv_cache
from engine.attention.metadata import (
    build_attention_metadata,
    decode_step_metadata,
    general_step_metadata,
)
from engine.attention.torch_backend import TorchAttentionBackend


def test_metadata_matches_the_worked_example() -> None:
    md = build_attention_metadata([5, 0], [3, 2], [[7, 2], [4]], block_size=4)
    assert md.positions.tolist() == [5, 6, 7, 0, 1]
    assert md.slot_mapping.tolist() == [9, 10, 11, 16, 17]
    assert md.qo_indptr.tolist() == [0, 3, 5]
    assert md.kv_indptr.tolist() == [0, 2, 3]
    assert md.kv_indices.tolist() == [7, 2, 4]
    assert md.kv_last_page_len.tolist() == [4, 2]
    assert md.qo_indptr.dtype == torch.int32 and md.kv_indices.dtype == torch.int32


def test_metadata_ignores_blocks_beyond_this_step() -> None:
    # A request may own a block it will only fill next step; it is not part of the pages.
    md = build_attention_metadata([3], [1], [[5, 9]], block_size=4)
    assert md.kv_indices.tolist() == [5]
    assert md.kv_last_page_len.tolist() == [4]
    assert md.slot_mapping.tolist() == [23]


@pytest.mark.parametrize("seed", range(20))
def test_decode_metadata_equals_the_general_path(seed: int) -> None:
    """The decode steps' own builder gives every array of the general one, dtype and all:
    random histories (a page boundary included), tables with blocks beyond the step."""
    rng = np.random.default_rng(seed)
    n, block = int(rng.integers(1, 40)), int(rng.choice([1, 4, 16]))
    computed = [int(c) for c in rng.integers(0, 300, n)]
    computed[0] = 2 * block - 1  # the new token starts a fresh page
    tables = [
        [int(b) for b in rng.integers(0, 5000, -(-(c + 1) // block) + int(rng.integers(0, 3)))]
        for c in computed
    ]
    decode = decode_step_metadata(computed, tables, block)
    general = general_step_metadata(computed, [1] * n, tables, block)
    assert decode.block_size == general.block_size
    for field in dataclasses.fields(general):
        if field.name != "block_size":
            ours, theirs = getattr(decode, field.name), getattr(general, field.name)
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, field.name
            assert np.array_equal(ours, theirs), field.name


def dense_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    computed: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q: (q_len, H, D) for positions computed.., k/v: (kv_len, Hkv, D), all in float64;
    with a `window`, a query at position p sees only keys p - window + 1..p."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(q.shape[0])[:, None] + computed
    visible = torch.arange(k.shape[0])[None, :] <= q_pos
    if window is not None:
        visible &= torch.arange(k.shape[0])[None, :] > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


CASES = {
    "prefill": [(0, 9), (0, 17), (0, 1)],
    "decode": [(12, 1), (3, 1), (40, 1), (0, 1)],
    "mixed": [(20, 1), (0, 13), (7, 6), (33, 1), (16, 16)],
}


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2)])
def test_torch_backend_matches_dense_attention(
    block_size: int, case: str, num_heads: int, num_kv_heads: int
) -> None:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    head_dim, num_layers, num_blocks = 16, 2, 64
    layer = 1
    kv_cache = allocate_kv_cache(
        num_layers, num_blocks, block_size, num_kv_heads, head_dim, torch.float32, "cpu"
    )
    backend = TorchAttentionBackend(kv_cache, num_heads, scale=head_dim**-0.5)
    requests = CASES[case]
    free_blocks = list(rng.permutation(num_blocks))
    tables, histories = [], []
    for computed, new in requests:
        pages = -(-(computed + new) // block_size)
        tables.append([int(free_blocks.pop()) for _ in range(pages)])
        histories.append(torch.randn(computed + new, 2, num_kv_heads, head_dim))
    # Write the already-computed history into the cache, as earlier steps would have.
    flat = kv_cache[layer].view(2, -1, num_kv_heads, head_dim)
    for (computed, _), table, hist in zip(requests, tables, histories, strict=True):
        for p in range(computed):
            slot = table[p // block_size] * block_size + p % block_size
            flat[:, slot] = hist[p]

    md = build_attention_metadata(
        [c for c, _ in requests], [n for _, n in requests], tables, block_size
    )
    backend.plan(md)
    q = torch.randn(md.num_tokens, num_heads, head_dim)
    k = torch.cat([h[c:, 0] for (c, _), h in zip(requests, histories, strict=True)])
    v = torch.cat([h[c:, 1] for (c, _), h in zip(requests, histories, strict=True)])
    out = backend.forward(layer, q, k, v)

    max_diff = 0.0
    start = 0
    for (computed, new), hist in zip(requests, histories, strict=True):
        ref = dense_reference(
            q[start : start + new], hist[:, 0], hist[:, 1], computed, head_dim**-0.5
        )
        max_diff = max(max_diff, (out[start : start + new].double() - ref).abs().max().item())
        start += new
    print(
        f"{case} block_size={block_size} heads={num_heads}/{num_kv_heads}: "
        f"max abs diff {max_diff:.2e}"
    )
    assert max_diff < 1e-5
