"""A recording stand-in for the `flashinfer` module, for CPU tests of the FlashInfer backend.

Every call is bound to FlashInfer's real signature (tests/flashinfer_api.py: the installed
flashinfer's, else one recorded from a release), so a keyword FlashInfer does not take, or
a missing argument, raises TypeError as the real call would. The stand-in then checks
what the real kernels require, computes what FlashInfer documents in float64, and records
the call as the backend made it:

- the page table is int32 (indptr, indices, last_page_len; in CUDA-graph mode also the
  buffers given to __init__, of batch_size + 1, >= the pages, and batch_size entries), its
  lengths agree, the indptr arrays are on the host, 1 <= last_page_len <= page_size;
- the workspace is a zeroed uint8 buffer on the cache's device ("must be initialized to 0
  for its first use");
- head_dim is one the ahead-of-time kernels cover (SUPPORTED_HEAD_DIMS), and decode on
  CUDA cores handles only the query/KV head ratios of CUDA_CORE_DECODE_GROUPS;
- run()'s q has q_data_type and the (k_cache, v_cache) NHD pair has kv_data_type
  (q_data_type when None), with the planned page size and head geometry;
- pages of request r are kv_indices[kv_indptr[r]:kv_indptr[r + 1]], its KV length is
  page_size * (pages - 1) + last_page_len[r]; causal=True aligns the queries to the end of
  the KV: query i sees keys 0..kv_len - q_len + i; window_left >= 0 (plan's) leaves a query
  at position p only the keys p - window_left..p;
- in use_cuda_graph mode, plan() copies the page table into the given buffers and run()
  reads the buffers.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.flashinfer_api import FlashInferApi, flashinfer_api

# The head sizes of FlashInfer's ahead-of-time FA2 kernels (flashinfer/aot.py, fa2_head_dim
# in v0.6.17), which the GPU image installs because its final stage has no compiler.
SUPPORTED_HEAD_DIMS = (64, 128, 256)
# Query heads per KV head that decode on CUDA cores is compiled for
# (DISPATCH_GQA_GROUP_SIZE, include/flashinfer/utils.cuh); tensor cores take any ratio.
CUDA_CORE_DECODE_GROUPS = (1, 2, 3, 4, 8)
PREFILL = "BatchPrefillWithPagedKVCacheWrapper"
DECODE = "BatchDecodeWithPagedKVCacheWrapper"


@dataclass
class Call:
    wrapper: str  # "prefill" or "decode"
    method: str  # "init", "plan" or "run"
    args: tuple[Any, ...]  # as the backend passed them
    kwargs: dict[str, Any] = field(default_factory=dict)
    arguments: dict[str, Any] = field(default_factory=dict)  # bound, with FlashInfer's defaults


@dataclass
class _Plan:
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    causal: bool
    sm_scale: float
    window_left: int
    q_data_type: torch.dtype
    kv_data_type: torch.dtype


def _int32(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        assert t.dtype == torch.int32, f"{name}: FlashInfer takes int32, not {t.dtype}"


def _check_page_table(
    qo: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, last: torch.Tensor, page_size: int
) -> None:
    _int32(qo_indptr=qo, kv_indptr=kv, kv_indices=idx, last_page_len=last)
    for name, t in (("qo_indptr", qo), ("kv_indptr", kv), ("last_page_len", last)):
        assert t.device.type == "cpu", f"{name}: plan() takes it on the host"
    assert len(idx) == int(kv[-1]) and len(last) == len(kv) - 1 == len(qo) - 1
    assert bool(((last >= 1) & (last <= page_size)).all())


def _check_geometry(heads: int, kv_heads: int, head_dim: int, tensor_cores: bool) -> None:
    assert head_dim in SUPPORTED_HEAD_DIMS, f"no FlashInfer kernels for head_dim {head_dim}"
    assert heads % kv_heads == 0
    if not tensor_cores:
        group = heads // kv_heads
        assert group in CUDA_CORE_DECODE_GROUPS, f"CUDA-core decode has no group size {group}"


def _make_plan(
    p: dict[str, Any], qo_indptr: torch.Tensor, table: tuple, head_dim: int, causal: bool
) -> _Plan:
    """The plan from plan()'s bound arguments, with FlashInfer's defaults resolved."""
    q_type = p["q_data_type"]
    assert isinstance(q_type, torch.dtype), "pass q_data_type as a torch.dtype"
    kv_type = p["kv_data_type"] if p["kv_data_type"] is not None else q_type
    scale = p["sm_scale"] if p["sm_scale"] is not None else head_dim**-0.5
    heads = (p["num_qo_heads"], p["num_kv_heads"], head_dim, p["page_size"])
    left = p["window_left"]
    return _Plan(qo_indptr, *table, *heads, causal, scale, left, q_type, kv_type)


def paged_attention(
    q: torch.Tensor, kv_cache: tuple[torch.Tensor, ...], plan: _Plan
) -> torch.Tensor:
    """FlashInfer's documented result, computed request by request in float64."""
    k_cache, v_cache = kv_cache
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "NHD (k_cache, v_cache)"
    assert k_cache.dtype == v_cache.dtype == plan.kv_data_type, (k_cache.dtype, plan.kv_data_type)
    assert q.dtype == plan.q_data_type, (q.dtype, plan.q_data_type)
    _, page_size, kv_heads, head_dim = k_cache.shape
    assert (page_size, kv_heads, head_dim) == (plan.page_size, plan.num_kv_heads, plan.head_dim)
    assert q.shape[1:] == (plan.num_qo_heads, plan.head_dim)
    assert q.shape[0] == int(plan.qo_indptr[-1])
    out = torch.empty_like(q)
    for r in range(len(plan.last_page_len)):
        pages = plan.kv_indices[int(plan.kv_indptr[r]) : int(plan.kv_indptr[r + 1])].long()
        kv_len = page_size * (len(pages) - 1) + int(plan.last_page_len[r])
        start, end = int(plan.qo_indptr[r]), int(plan.qo_indptr[r + 1])
        group = q.shape[1] // kv_heads
        keys = k_cache[pages].reshape(-1, kv_heads, head_dim)[:kv_len].double()
        values = v_cache[pages].reshape(-1, kv_heads, head_dim)[:kv_len].double()
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].double(), keys) * plan.sm_scale
        # Query positions: aligned to the end of the KV (a decode's one query too).
        q_pos = kv_len - (end - start) + torch.arange(end - start)
        keys_pos = torch.arange(kv_len)[None, :]
        visible = torch.ones(end - start, kv_len, dtype=torch.bool)
        if plan.causal:
            visible &= keys_pos <= q_pos[:, None]
        if plan.window_left >= 0:
            visible &= keys_pos >= q_pos[:, None] - plan.window_left
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
    return out


def _check_workspace(workspace: torch.Tensor) -> None:
    assert workspace.dtype == torch.uint8, "the float workspace is a uint8 buffer"
    assert not bool(workspace.any()), "the workspace must be initialised to 0 for its first use"


def make_fake_flashinfer(api: FlashInferApi | None = None) -> tuple[types.ModuleType, list[Call]]:
    """(a module with the two wrappers, the list every call is recorded in)."""
    api = api or flashinfer_api()
    calls: list[Call] = []

    def bind(cls: str, method: str, wrapper: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
        arguments = dict(api.bind(f"{cls}.{method}", wrapper, *args, **kwargs).arguments)
        arguments.pop("self")
        name = "prefill" if cls == PREFILL else "decode"
        calls.append(
            Call(name, "init" if method == "__init__" else method, args, kwargs, arguments)
        )
        return arguments

    class BatchPrefillWithPagedKVCacheWrapper:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            p = bind(PREFILL, "__init__", self, args, kwargs)
            _check_workspace(p["float_workspace_buffer"])
            assert p["kv_layout"] == "NHD" and not p["use_cuda_graph"]
            self._plan: _Plan | None = None

        def plan(self, *args: Any, **kwargs: Any) -> None:
            p = bind(PREFILL, "plan", self, args, kwargs)
            table = (p["paged_kv_indptr"], p["paged_kv_indices"], p["paged_kv_last_page_len"])
            _check_page_table(p["qo_indptr"], *table, p["page_size"])
            _check_geometry(p["num_qo_heads"], p["num_kv_heads"], p["head_dim_qk"], True)
            self._plan = _make_plan(p, p["qo_indptr"], table, p["head_dim_qk"], p["causal"])

        def run(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            p = bind(PREFILL, "run", self, args, kwargs)
            assert self._plan is not None, "run before plan"
            return paged_attention(p["q"], p["paged_kv_cache"], self._plan)

    class BatchDecodeWithPagedKVCacheWrapper:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            p = bind(DECODE, "__init__", self, args, kwargs)
            _check_workspace(p["float_workspace_buffer"])
            assert p["kv_layout"] == "NHD"
            self.graph, self.tensor_cores = p["use_cuda_graph"], p["use_tensor_cores"]
            self.buffers = (
                p["paged_kv_indptr_buffer"],
                p["paged_kv_indices_buffer"],
                p["paged_kv_last_page_len_buffer"],
            )
            if self.graph:
                indptr, indices, last = self.buffers
                assert indptr is not None and indices is not None and last is not None
                _int32(indptr_buffer=indptr, indices_buffer=indices, last_page_len_buffer=last)
                assert len(indptr) == len(last) + 1, "indptr buffer: batch_size + 1 entries"
            self._plan: _Plan | None = None

        def plan(self, *args: Any, **kwargs: Any) -> None:
            p = bind(DECODE, "plan", self, args, kwargs)
            table = (p["indptr"], p["indices"], p["last_page_len"])
            qo_indptr = torch.arange(len(p["indptr"]), dtype=torch.int32)
            _check_page_table(qo_indptr, *table, p["page_size"])
            _check_geometry(p["num_qo_heads"], p["num_kv_heads"], p["head_dim"], self.tensor_cores)
            if self.graph:  # FlashInfer copies into the fixed buffers; run reads those
                table = self._copy_to_buffers(*table)
            self._plan = _make_plan(p, qo_indptr, table, p["head_dim"], causal=False)

        def _copy_to_buffers(self, *table: torch.Tensor) -> tuple[torch.Tensor, ...]:
            indptr_buf, indices_buf, last_buf = self.buffers
            assert indptr_buf is not None and indices_buf is not None and last_buf is not None
            indptr, indices, last_page_len = table
            assert len(last_page_len) == len(last_buf), "the graph's batch size is fixed"
            assert len(indices) <= len(indices_buf), "more pages than the indices buffer holds"
            indptr_buf.copy_(indptr)
            indices_buf[: len(indices)].copy_(indices)
            last_buf.copy_(last_page_len)
            return indptr_buf.cpu(), indices_buf, last_buf.cpu()

        def run(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            p = bind(DECODE, "run", self, args, kwargs)
            assert self._plan is not None, "run before plan"
            return paged_attention(p["q"], p["paged_kv_cache"], self._plan)

    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    module.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    return module, calls
