"""A recording stand-in for the `flashinfer` module, for CPU tests of the FlashInfer backend.

Its two wrappers accept only the parameters that FlashInfer documents and that our backend
is meant to pass, record every call, check the documented input contract (int32 CSR
arrays, host indptr, 1 <= last_page_len <= page_size, NHD (k_cache, v_cache) tuples) and
compute what FlashInfer documents, in float64:

- pages of request r are kv_indices[kv_indptr[r]:kv_indptr[r + 1]], its KV length is
  page_size * (pages - 1) + last_page_len[r];
- causal=True aligns the queries to the end of the KV: query i sees keys
  0..kv_len - q_len + i (the docstring of BatchPrefillWithPagedKVCacheWrapper shows it equal
  to a custom mask tril(diagonal=kv_len - q_len));
- in use_cuda_graph mode, plan() copies the page table into the given buffers and run()
  reads the buffers.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Call:
    wrapper: str  # "prefill" or "decode"
    method: str  # "init", "plan" or "run"
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Plan:
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor
    page_size: int
    causal: bool
    sm_scale: float
    q_data_type: torch.dtype


def _check_page_table(
    qo: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, last: torch.Tensor, page_size: int
) -> None:
    for name, t in (("qo_indptr", qo), ("kv_indptr", kv), ("last_page_len", last)):
        assert t.dtype == torch.int32 and t.device.type == "cpu", f"{name}: host int32 expected"
    assert idx.dtype == torch.int32
    assert len(idx) == int(kv[-1]) and len(last) == len(kv) - 1 == len(qo) - 1
    assert bool(((last >= 1) & (last <= page_size)).all())


def paged_attention(
    q: torch.Tensor, kv_cache: tuple[torch.Tensor, ...], plan: _Plan
) -> torch.Tensor:
    """FlashInfer's documented result, computed request by request in float64."""
    k_cache, v_cache = kv_cache
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "NHD (k_cache, v_cache)"
    assert k_cache.shape[1] == plan.page_size and q.dtype == plan.q_data_type
    assert q.shape[0] == int(plan.qo_indptr[-1])
    _, page_size, kv_heads, head_dim = k_cache.shape
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
        if plan.causal:
            limit = kv_len - (end - start) + torch.arange(end - start)
            visible = torch.arange(kv_len)[None, :] <= limit[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
    return out


def make_fake_flashinfer() -> tuple[types.ModuleType, list[Call]]:
    """(a module with the two wrappers, the list every call is recorded in)."""
    calls: list[Call] = []

    class BatchPrefillWithPagedKVCacheWrapper:
        def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
            calls.append(Call("prefill", "init", (float_workspace_buffer, kv_layout)))
            self._plan: _Plan | None = None

        def plan(
            self,
            qo_indptr: torch.Tensor,
            paged_kv_indptr: torch.Tensor,
            paged_kv_indices: torch.Tensor,
            paged_kv_last_page_len: torch.Tensor,
            num_qo_heads: int,
            num_kv_heads: int,
            head_dim_qk: int,
            page_size: int,
            *,
            causal: bool = False,
            sm_scale: float | None = None,
            q_data_type: torch.dtype | str = "float16",
            kv_data_type: torch.dtype | None = None,
        ) -> None:
            table = (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
            args = (*table, num_qo_heads, num_kv_heads, head_dim_qk, page_size)
            kwargs = {
                "causal": causal,
                "sm_scale": sm_scale,
                "q_data_type": q_data_type,
                "kv_data_type": kv_data_type,
            }
            calls.append(Call("prefill", "plan", args, kwargs))
            _check_page_table(*table, page_size)
            self._plan = _Plan(*table, page_size, causal, sm_scale, q_data_type)

        def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
            calls.append(Call("prefill", "run", (q, paged_kv_cache)))
            assert self._plan is not None, "run before plan"
            return paged_attention(q, paged_kv_cache, self._plan)

    class BatchDecodeWithPagedKVCacheWrapper:
        def __init__(
            self,
            float_workspace_buffer: torch.Tensor,
            kv_layout: str = "NHD",
            use_cuda_graph: bool = False,
            use_tensor_cores: bool = False,
            paged_kv_indptr_buffer: torch.Tensor | None = None,
            paged_kv_indices_buffer: torch.Tensor | None = None,
            paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        ) -> None:
            self.buffers = (
                paged_kv_indptr_buffer,
                paged_kv_indices_buffer,
                paged_kv_last_page_len_buffer,
            )
            kwargs = {"use_cuda_graph": use_cuda_graph, "use_tensor_cores": use_tensor_cores}
            calls.append(Call("decode", "init", (float_workspace_buffer, kv_layout), kwargs))
            self.graph = use_cuda_graph
            self._plan: _Plan | None = None

        def plan(
            self,
            indptr: torch.Tensor,
            indices: torch.Tensor,
            last_page_len: torch.Tensor,
            num_qo_heads: int,
            num_kv_heads: int,
            head_dim: int,
            page_size: int,
            *,
            q_data_type: torch.dtype | str = "float16",
            kv_data_type: torch.dtype | None = None,
            sm_scale: float | None = None,
        ) -> None:
            args = (indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size)
            kwargs = {
                "q_data_type": q_data_type,
                "kv_data_type": kv_data_type,
                "sm_scale": sm_scale,
            }
            calls.append(Call("decode", "plan", args, kwargs))
            qo_indptr = torch.arange(len(indptr), dtype=torch.int32)
            _check_page_table(qo_indptr, indptr, indices, last_page_len, page_size)
            if self.graph:  # FlashInfer copies into the fixed buffers; run reads those
                indptr, indices, last_page_len = self._copy_to_buffers(
                    indptr, indices, last_page_len
                )
            table = (qo_indptr, indptr, indices, last_page_len)
            self._plan = _Plan(*table, page_size, False, sm_scale, q_data_type)

        def _copy_to_buffers(self, *table: torch.Tensor) -> tuple[torch.Tensor, ...]:
            indptr_buf, indices_buf, last_buf = self.buffers
            assert indptr_buf is not None and indices_buf is not None and last_buf is not None
            indptr, indices, last_page_len = table
            assert len(last_page_len) == len(last_buf), "the graph's batch size is fixed"
            indptr_buf.copy_(indptr)
            indices_buf[: len(indices)].copy_(indices)
            last_buf.copy_(last_page_len)
            return indptr_buf.cpu(), indices_buf, last_buf.cpu()

        def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
            calls.append(Call("decode", "run", (q, paged_kv_cache)))
            assert self._plan is not None, "run before plan"
            return paged_attention(q, paged_kv_cache, self._plan)

    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    module.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    return module, calls
