"""Per-step attention metadata shared by every backend: built once on the host, uploaded once.

For a step with two requests, block_size B = 4:

    request  computed  new   block table      tokens this step (flat batch)
    r0       5         3     [7, 2]           t0 t1 t2      positions 5 6 7
    r1       0         2     [4]              t3 t4         positions 0 1

    qo_indptr        = [0, 3, 5]       query tokens of request r: qo_indptr[r]..qo_indptr[r+1]
    kv_indptr        = [0, 2, 3]       pages of request r in kv_indices
    kv_indices       = [7, 2, 4]
    kv_last_page_len = [4, 2]          r0 holds 8 tokens: the last page is full
    slot_mapping[t]  = block_table[r][p // B] * B + p % B
                     = [2*4+1, 2*4+2, 2*4+3, 4*4+0, 4*4+1] = [9, 10, 11, 16, 17]

These are exactly the arrays FlashInfer's paged wrappers plan with (NHD layout).
`build_step_metadata` computes them with vectorised numpy (no loop over tokens) into a
StepMetadata; `upload` turns that into the AttentionMetadata backends receive, which keeps
the host arrays beside their device copies: backends that plan on the host (FlashInfer, the
torch reference) read the former, kernels the latter. Nobody recomputes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, chain

import numpy as np
import torch


@dataclass(frozen=True)
class StepMetadata:
    """Host (numpy) arrays of one step, requests in batch order."""

    block_size: int
    query_lens: np.ndarray  # (num_reqs,) int64
    seq_lens: np.ndarray  # (num_reqs,) int64: KV length after this step
    block_table: np.ndarray  # (num_reqs, max_pages) int64, zero padded
    positions: np.ndarray  # (num_tokens,) int64
    slot_mapping: np.ndarray  # (num_tokens,) int64
    qo_indptr: np.ndarray  # (num_reqs + 1,) int32
    kv_indptr: np.ndarray  # (num_reqs + 1,) int32
    kv_indices: np.ndarray  # (kv_indptr[-1],) int32
    kv_last_page_len: np.ndarray  # (num_reqs,) int32

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    @property
    def num_computed(self) -> np.ndarray:
        return self.seq_lens - self.query_lens

    @property
    def is_decode_only(self) -> bool:
        return bool((self.query_lens == 1).all())


@dataclass(frozen=True)
class AttentionMetadata:
    """A step's metadata on the device, with the host arrays it came from."""

    host: StepMetadata
    positions: torch.Tensor  # (num_tokens,) int64
    slot_mapping: torch.Tensor  # (num_tokens,) int64
    qo_indptr: torch.Tensor  # (num_reqs + 1,) int32
    kv_indptr: torch.Tensor  # (num_reqs + 1,) int32
    kv_indices: torch.Tensor  # (kv_indptr[-1],) int32
    kv_last_page_len: torch.Tensor  # (num_reqs,) int32
    # A hybrid model's KV cache groups after the first (engine/kv_cache/groups.py): the
    # same step over each group's block tables. This one is group 0's.
    groups: tuple[AttentionMetadata, ...] = ()

    @property
    def block_size(self) -> int:
        return self.host.block_size

    @property
    def num_reqs(self) -> int:
        return self.host.num_reqs

    @property
    def num_tokens(self) -> int:
        return self.host.num_tokens

    @property
    def is_decode_only(self) -> bool:
        return self.host.is_decode_only


# The device arrays, in the order `upload` hands them to a copy function.
DEVICE_FIELDS = (
    "positions",
    "slot_mapping",
    "qo_indptr",
    "kv_indptr",
    "kv_indices",
    "kv_last_page_len",
)


def pad_block_table(block_ids: Sequence[Sequence[int]], num_pages: np.ndarray) -> np.ndarray:
    """(num_reqs, max_pages) array holding the first num_pages[r] block ids of each request."""
    table = np.zeros((len(block_ids), max(int(num_pages.max(initial=0)), 1)), dtype=np.int64)
    for row, (ids, n) in enumerate(zip(block_ids, num_pages, strict=True)):
        table[row, :n] = ids[:n]
    return table


def build_step_metadata(
    num_computed: Sequence[int],
    num_new: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    block_size: int,
) -> StepMetadata:
    """Flat-batch metadata for requests in batch order. No loop over tokens."""
    if num_new and all(n == 1 for n in num_new):
        return decode_step_metadata(num_computed, block_ids, block_size)
    return general_step_metadata(num_computed, num_new, block_ids, block_size)


def decode_step_metadata(
    num_computed: Sequence[int], block_ids: Sequence[Sequence[int]], block_size: int
) -> StepMetadata:
    """build_step_metadata for a step of one new token a request (a decode step), with half
    the numpy calls: each costs microseconds, more right after a forward has cooled the
    caches, and a single-stream decode step builds its metadata between two forwards."""
    n = len(num_computed)
    seq_lens = [c + 1 for c in num_computed]
    pages = [-(-s // block_size) for s in seq_lens]
    flat = np.fromiter(
        chain.from_iterable(ids[:k] for ids, k in zip(block_ids, pages, strict=True)),
        dtype=np.int64,
        count=sum(pages),
    )
    table = np.zeros((n, max(max(pages), 1)), dtype=np.int64)
    table[np.arange(table.shape[1])[None, :] < np.asarray(pages)[:, None]] = flat
    slots = [
        ids[c // block_size] * block_size + c % block_size
        for ids, c in zip(block_ids, num_computed, strict=True)
    ]
    return StepMetadata(
        block_size=block_size,
        query_lens=np.ones(n, dtype=np.int64),
        seq_lens=np.array(seq_lens, dtype=np.int64),
        block_table=table,
        positions=np.array(num_computed, dtype=np.int64),
        slot_mapping=np.array(slots, dtype=np.int64),
        qo_indptr=np.arange(n + 1, dtype=np.int32),
        kv_indptr=np.array(list(accumulate(pages, initial=0)), dtype=np.int32),
        kv_indices=flat.astype(np.int32),
        kv_last_page_len=np.array(
            [s - (k - 1) * block_size for s, k in zip(seq_lens, pages, strict=True)],
            dtype=np.int32,
        ),
    )


def general_step_metadata(
    num_computed: Sequence[int],
    num_new: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    block_size: int,
) -> StepMetadata:
    """build_step_metadata for any step, vectorised over tokens."""
    computed = np.asarray(num_computed, dtype=np.int64)
    query_lens = np.asarray(num_new, dtype=np.int64)
    seq_lens = computed + query_lens
    num_pages = -(-seq_lens // block_size)
    table = pad_block_table(block_ids, num_pages)

    qo_indptr = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=qo_indptr[1:])
    num_tokens = int(qo_indptr[-1])
    req_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    # Position of token t of request r: computed[r] + (t - qo_indptr[r]).
    positions = np.arange(num_tokens) + np.repeat(computed - qo_indptr[:-1], query_lens)
    slots = table[req_of_token, positions // block_size] * block_size + positions % block_size

    kv_indptr = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(num_pages, out=kv_indptr[1:])
    kv_indices = table[np.arange(table.shape[1])[None, :] < num_pages[:, None]]
    last_page_len = seq_lens - (num_pages - 1) * block_size
    return StepMetadata(
        block_size=block_size,
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_table=table,
        positions=positions,
        slot_mapping=slots,
        qo_indptr=qo_indptr.astype(np.int32),
        kv_indptr=kv_indptr.astype(np.int32),
        kv_indices=kv_indices.astype(np.int32),
        kv_last_page_len=last_page_len.astype(np.int32),
    )


def host_tensors(host: StepMetadata) -> list[torch.Tensor]:
    """CPU tensors sharing memory with `host`'s device fields, in AttentionMetadata's order."""
    return [torch.from_numpy(np.ascontiguousarray(getattr(host, f))) for f in DEVICE_FIELDS]


def upload(host: StepMetadata, device: torch.device | str = "cpu") -> AttentionMetadata:
    """The device side of `host`: on the CPU, views of its arrays; elsewhere, plain copies
    (the model runner stages them through pinned buffers instead)."""
    tensors = host_tensors(host)
    if torch.device(device).type != "cpu":
        tensors = [t.to(device) for t in tensors]
    return device_metadata(host, tensors)


def device_metadata(host: StepMetadata, tensors: Sequence[torch.Tensor]) -> AttentionMetadata:
    """AttentionMetadata from `host` and its device fields, in DEVICE_FIELDS' order."""
    positions, slot_mapping, qo_indptr, kv_indptr, kv_indices, kv_last_page_len = tensors
    return AttentionMetadata(
        host, positions, slot_mapping, qo_indptr, kv_indptr, kv_indices, kv_last_page_len
    )


def build_attention_metadata(
    num_computed: Sequence[int],
    num_new: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """build_step_metadata, then upload (plain copies): for tests and one-off steps."""
    return upload(build_step_metadata(num_computed, num_new, block_ids, block_size), device)
