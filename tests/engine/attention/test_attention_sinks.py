"""Attention sinks (gpt-oss: a learned logit per head in each softmax's denominator) in the
torch backend and the native kernels of every instruction set, against dense float64
attention: prefills, chunks, decodes short and split in parts, a shared prefix the kernel
reads once for several requests, and with a sliding window."""

from __future__ import annotations

import pytest
import torch

from engine.attention.backend import write_kv
from engine.attention.native_backend import NativeCpuAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from tests.engine.attention.test_native_attention import (
    LAYER,
    TOLERANCE,
    PagedCase,
    make_case,
    shared_prefixes,
)
from tests.isas import isa_params

# (computed, new) and the keys all requests share: a prefill, a chunk, decodes short and
# split in parts (900 keys); and three requests whose first 160 keys (on the same pages)
# the kernel reads once for all of them.
CASES = {
    "mixed": ([(0, 40), (37, 25), (20, 1), (900, 1)], 0),
    "shared": ([(170, 1), (175, 1), (165, 4)], 160),
}
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 64, 16
SCALE = HEAD_DIM**-0.5


def dense_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, computed: int, sinks: torch.Tensor,
    window: int | None,
) -> torch.Tensor:  # fmt: skip
    """transformers' gpt-oss eager attention in float64: the sinks join the softmax as one
    more column, which is then dropped."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).double(), v.repeat_interleave(group, 1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * SCALE
    q_pos = torch.arange(q.shape[0])[:, None] + computed
    keys = torch.arange(k.shape[0])[None, :]
    visible = (keys <= q_pos) & (keys > q_pos - window if window else True)
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.double()[:, None, None].expand(-1, q.shape[0], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


def max_diff(case: PagedCase, out: torch.Tensor, sinks: torch.Tensor, window: int | None) -> float:
    worst, start = 0.0, 0
    for (computed, new), hist in zip(case.requests, case.histories, strict=True):
        q = case.q[start : start + new]
        ref = dense_with_sinks(q, hist[:, 0], hist[:, 1], computed, sinks, window)
        worst, start = (
            max(worst, (out[start : start + new].double() - ref).abs().max().item()),
            start + new,
        )
    return worst


SINKS = torch.tensor([2.0, -1.0, 0.5, 8.0, -30.0, 0.0])  # 8: most weight on the sink


def case_of(name: str, dtype: torch.dtype) -> PagedCase:
    requests, shared = CASES[name]
    return make_case(
        requests, HEADS, KV_HEADS, HEAD_DIM, BLOCK, dtype, seed=6, shared_prefix=shared
    )


def test_torch_backend() -> None:
    for name in CASES:
        pc = case_of(name, torch.float32)
        for window in (None, 12):
            backend = TorchAttentionBackend(pc.kv_cache, HEADS, SCALE, [window] * 2, [SINKS] * 2)
            backend.plan(pc.metadata)
            out = backend.forward(LAYER, pc.q, pc.k, pc.v)
            assert max_diff(pc, out, SINKS, window) < 1e-5


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize(
    ("name", "dtype"), [("mixed", torch.float32), ("shared", torch.bfloat16)], ids=str
)
def test_native_kernel(name: str, dtype: torch.dtype, isa: str) -> None:
    pc = case_of(name, dtype)
    md = pc.metadata
    k_cache, v_cache = write_kv(pc.kv_cache, LAYER, md.slot_mapping, pc.k, pc.v)
    assert shared_prefixes(md, BLOCK) == ([[0, 3, 160]] if name == "shared" else [])
    for window in (0, 12):
        out = torch.empty_like(pc.q)
        torch.ops.pagedserve.paged_attention(
            out, pc.q, k_cache, v_cache, md.qo_indptr, md.kv_indptr, md.kv_indices,
            md.kv_last_page_len, SCALE, isa, window, SINKS,
        )  # fmt: skip
        diff = max_diff(pc, out, SINKS, window or None)
        print(f"{isa} {name} {dtype} window {window}: {diff:.2e}")
        assert diff < TOLERANCE[dtype]
    backend = NativeCpuAttentionBackend(pc.kv_cache, HEADS, SCALE, (), [SINKS] * 2)
    backend.plan(md)
    assert max_diff(pc, backend.forward(LAYER, pc.q, pc.k, pc.v), SINKS, None) < TOLERANCE[dtype]
