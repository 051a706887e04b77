"""FlashInfer paged attention for CUDA: the GPU counterpart of TorchAttentionBackend.

Both backends consume the same AttentionMetadata. Its qo_indptr, kv_indptr, kv_indices and
kv_last_page_len are FlashInfer's page-table CSR arrays (NHD layout), so planning hands them
over. Per layer, the step's K/V are written through slot_mapping (the torch backend's
index_copy_), then one wrapper call attends over every request's pages:

    kv_cache[layer, 0] = k_cache   (num_blocks, block_size, kv_heads, head_dim)   NHD
    kv_cache[layer, 1] = v_cache
    out = wrapper.run(q, (k_cache, v_cache))          (num_tokens, heads, head_dim)

Steps with a multi-token request use BatchPrefillWithPagedKVCacheWrapper with causal=True:
FlashInfer aligns a request's queries to the end of its KV, so query i sees keys
0..kv_len - q_len + i, which is our position rule. Steps where every request has one query
use BatchDecodeWithPagedKVCacheWrapper. A layer with a sliding window of w tokens runs on
wrappers planned with window_left = w - 1 (FlashInfer's query at position p sees keys
p - window_left..p): each distinct window among the layers has its own wrappers, planned
with the same page table. `flashinfer` is imported lazily: this module imports without it.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

from engine.attention.backend import BackendChoice, write_kv
from engine.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# FlashInfer's documented recommendation for the float workspace (split-KV partial results).
WORKSPACE_BYTES = 128 << 20


def new_workspace(device: torch.device) -> torch.Tensor:
    """FlashInfer's float workspace: zeroed, as its documentation requires for first use."""
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def flashinfer_available(
    device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> tuple[bool, str]:
    """(True, "") when FlashInfer can run here: CUDA is present (and `device`, if given, is a
    CUDA device), `dtype` (if given) is float16 or bfloat16, and `import flashinfer` works.
    Otherwise (False, the reason). Imports flashinfer; mutates nothing else."""
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    if device is not None and torch.device(device).type != "cuda":
        return False, f"it runs only on CUDA devices, not {device}"
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        return False, f"it runs float16 and bfloat16, not {dtype}"
    try:
        importlib.import_module("flashinfer")
    except Exception as error:  # a broken CUDA install fails in many ways, not only ImportError
        return False, f"`import flashinfer` failed ({error}); install the gpu extra: .[gpu]"
    return True, ""


def select_gpu_backend(
    name: str, device: torch.device | str, dtype: torch.dtype | None
) -> BackendChoice:
    """The backend `name` means on a GPU `device`: "auto" is "flashinfer" where it can run,
    else "torch" (with a warning saying why); other names are kept. Raises ValueError for
    "flashinfer" where it cannot run (on any device), with the reason."""
    if name not in ("auto", "flashinfer"):
        return BackendChoice(name, "requested")
    ok, reason = flashinfer_available(device, dtype)
    if name == "flashinfer" and not ok:
        raise ValueError(
            f"attention backend 'flashinfer' is unavailable: {reason}; "
            "use --attention-backend torch"
        )
    if name == "flashinfer":
        return BackendChoice(name, "requested")
    if not ok:
        logger.warning("FlashInfer is unavailable (%s); using the torch backend", reason)
        return BackendChoice("torch", f"auto: FlashInfer is unavailable: {reason}")
    return BackendChoice("flashinfer", "auto: FlashInfer runs here")


def use_tensor_cores(num_heads: int, num_kv_heads: int) -> bool:
    """vLLM's rule for FlashInfer decode: tensor cores pay off above 4 query heads per KV head."""
    return num_heads // num_kv_heads > 4


def window_left(window: int | None) -> int:
    """FlashInfer's window_left for a sliding window of `window` tokens: the keys before the
    query's own that it sees (-1: all of them)."""
    return -1 if window is None else window - 1


def host_page_table(md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qo_indptr, kv_indptr and kv_last_page_len as CPU int32 tensors (views of the host
    arrays): FlashInfer plans on the host, and given device tensors, plan() would copy them
    back, which waits for the GPU."""
    host = md.host
    return (
        torch.from_numpy(host.qo_indptr),
        torch.from_numpy(host.kv_indptr),
        torch.from_numpy(host.kv_last_page_len),
    )


class _PagedAttention:
    """What both FlashInfer classes share: the cache geometry, the K/V write, the decode plan."""

    name = "flashinfer"

    def __init__(
        self,
        kv_cache: torch.Tensor,
        num_heads: int,
        scale: float,
        flashinfer: ModuleType | None,
        windows: Sequence[int | None],
    ) -> None:
        if kv_cache.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"FlashInfer runs float16 and bfloat16 caches, not {kv_cache.dtype}")
        self.fi: Any = flashinfer or importlib.import_module("flashinfer")
        self.kv_cache = kv_cache  # (layers, 2, blocks, block_size, kv_heads, head_dim)
        _, _, _, self.block_size, self.num_kv_heads, self.head_dim = kv_cache.shape
        self.num_heads = num_heads
        self.scale = scale
        self.tensor_cores = use_tensor_cores(num_heads, self.num_kv_heads)
        # Each layer's window_left, and the distinct ones (a set of wrappers each).
        self.layer_lefts = [window_left(w) for w in windows] or [-1] * kv_cache.shape[0]
        self.lefts = sorted(set(self.layer_lefts))

    def _plan_decode(self, wrapper: Any, md: AttentionMetadata, left: int) -> None:
        _, kv_indptr, last_page_len = host_page_table(md)
        wrapper.plan(
            kv_indptr,
            md.kv_indices,
            last_page_len,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            q_data_type=self.kv_cache.dtype,
            kv_data_type=self.kv_cache.dtype,
            sm_scale=self.scale,
            window_left=left,
        )

    def _attend(
        self,
        wrapper: Any,
        slot_mapping: torch.Tensor,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:
        k_cache, v_cache = write_kv(self.kv_cache, layer_idx, slot_mapping, k, v)
        return wrapper.run(q, (k_cache, v_cache))  # (T, num_heads, head_dim)


class FlashInferAttentionBackend(_PagedAttention):
    """plan() once per step, forward() once per layer (see the module docstring).

    `flashinfer` is the module to call (tests pass a recording stand-in); None imports the real
    one. `workspace` is FlashInfer's float scratch buffer, which wrappers running one after
    another on the same stream may share; None allocates a new_workspace on the cache's device.
    `windows`: each layer's sliding window (None: none); empty: no layer has one.
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        num_heads: int,
        scale: float,
        flashinfer: ModuleType | None = None,
        workspace: torch.Tensor | None = None,
        windows: Sequence[int | None] = (),
    ) -> None:
        super().__init__(kv_cache, num_heads, scale, flashinfer, windows)
        if workspace is None:
            workspace = new_workspace(kv_cache.device)
        self.workspace = workspace
        self._prefill = {
            left: self.fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            for left in self.lefts
        }
        self._decode = {
            left: self.fi.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=self.tensor_cores
            )
            for left in self.lefts
        }
        self._wrappers: dict[int, Any] = self._prefill
        self._slot_mapping = torch.empty(0, dtype=torch.long, device=kv_cache.device)

    def plan(self, metadata: AttentionMetadata) -> None:
        """Mutates the backend: plans this step's wrapper. Called once per step."""
        self._slot_mapping = metadata.slot_mapping
        if metadata.is_decode_only:
            self._wrappers = self._decode
            for left, wrapper in self._decode.items():
                self._plan_decode(wrapper, metadata, left)
            return
        self._wrappers = self._prefill
        for left, wrapper in self._prefill.items():
            self._plan_prefill(wrapper, metadata, left)

    def _plan_prefill(self, wrapper: Any, metadata: AttentionMetadata, left: int) -> None:
        qo_indptr, kv_indptr, last_page_len = host_page_table(metadata)
        wrapper.plan(
            qo_indptr,
            kv_indptr,
            metadata.kv_indices,
            last_page_len,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            causal=True,
            sm_scale=self.scale,
            window_left=left,
            q_data_type=self.kv_cache.dtype,
            kv_data_type=self.kv_cache.dtype,
        )

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q: (T, heads, head_dim); k, v: (T, kv_heads, head_dim) -> (T, heads, head_dim).

        Mutates the KV cache: writes this step's K/V, then attends."""
        wrapper = self._wrappers[self.layer_lefts[layer_idx]]
        return self._attend(wrapper, self._slot_mapping, layer_idx, q, k, v)


class CudaGraphDecodeAttention(_PagedAttention):
    """Decode attention for one CUDA-graph batch size, on persistent buffers.

    The wrapper runs in FlashInfer's use_cuda_graph mode: plan() copies the page table into
    indptr (batch_size + 1,), indices (capacity,) and last_page_len (batch_size,), and the slot
    mapping into slot_mapping (batch_size,). A graph captured through forward() reads those
    addresses, so planning before each replay is all a new step needs. plan() must run
    outside graph capture.
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        num_heads: int,
        scale: float,
        buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        workspace: torch.Tensor,
        flashinfer: ModuleType | None = None,
        windows: Sequence[int | None] = (),
    ) -> None:
        super().__init__(kv_cache, num_heads, scale, flashinfer, windows)
        indptr, indices, last_page_len, self.slot_mapping = buffers
        self.batch_size = int(last_page_len.shape[0])
        # One wrapper per window, all on the same buffers (each plan copies the same table).
        self._wrappers = {
            left: self.fi.BatchDecodeWithPagedKVCacheWrapper(
                workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.tensor_cores,
                paged_kv_indptr_buffer=indptr,
                paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last_page_len,
            )
            for left in self.lefts
        }

    def plan(self, metadata: AttentionMetadata) -> None:
        """Mutates the persistent buffers. `metadata` is a decode-only step of batch_size."""
        if metadata.num_reqs != self.batch_size or not metadata.is_decode_only:
            raise ValueError(
                f"a graph of batch size {self.batch_size} replays decode-only steps of that "
                f"size, not {metadata.num_reqs} requests of "
                f"{metadata.host.query_lens.tolist()} tokens"
            )
        self.slot_mapping.copy_(metadata.slot_mapping, non_blocking=True)
        for left, wrapper in self._wrappers.items():
            self._plan_decode(wrapper, metadata, left)

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """As FlashInferAttentionBackend.forward; safe to capture in a CUDA graph."""
        wrapper = self._wrappers[self.layer_lefts[layer_idx]]
        return self._attend(wrapper, self.slot_mapping, layer_idx, q, k, v)
