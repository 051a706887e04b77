"""The reference paged-attention backend, and the CPU path: block gathers plus batched matmuls.

Keys and values are gathered a whole block at a time (block_size * kv_heads * head_dim
contiguous elements per copy), never token by token.

Decodes (one query token) run as one padded batch. GQA never repeats K/V heads: each
request's queries form a block-diagonal matrix (num_heads, kv_heads * head_dim), so one
bmm against the gathered (kv_len, kv_heads * head_dim) keys scores every head at once,
and the diagonal blocks of the second bmm are the outputs:

    q_bd[h*G+g, h'*D:(h'+1)*D] = q[h*G+g] if h' == h else 0
    scores = q_bd @ K^T          (H, kv_len)        off-diagonal zeros add nothing
    out    = diag_h(P @ V)       (H, D)

Prefill chunks run one request at a time, with the `group` query heads of each KV head
folded into the query axis and a causal mask offset by the tokens already cached.

A layer with a sliding window of w tokens masks the keys more than w - 1 positions before
each query as well (w = 3, a query at position 5 of 6 keys):  keys 0 1 2 3 4 5  ->  - - - 3 4 5
Each step plans one mask per distinct window among the layers.

Attention sinks (gpt-oss) add a learned logit per head to each softmax's denominator: the
probabilities of the keys then sum to less than 1, the rest going to no value at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention.backend import write_kv
from engine.attention.metadata import AttentionMetadata, StepMetadata

# Above this many score elements per request, use the memory-efficient SDPA kernel.
_MAX_MATERIALISED_SCORES = 1 << 24


@dataclass(frozen=True)
class _DecodePlan:
    rows: torch.Tensor | None  # (n,) flat-batch rows; None when they are 0..n-1
    blocks: torch.Tensor  # (n * max_pages,) block ids, padded with block 0
    # per window (None: none): (n, 1, max_pages * block_size) float32, 0 visible, -inf not
    masks: dict[int | None, torch.Tensor]


@dataclass(frozen=True)
class _ExtendPlan:
    start: int
    end: int
    blocks: torch.Tensor | None  # (pages,); None when every key is in this step's K/V
    # per window (None: none): (q_len, kv_len) float32, causal with offset
    masks: dict[int | None, torch.Tensor]


def visible(q_pos: np.ndarray, kv_len: int, window: int | None) -> np.ndarray:
    """(len(q_pos), kv_len) bool: which keys each query position sees (causal, and within
    its sliding window of `window` tokens where there is one)."""
    keys = np.arange(kv_len)[None, :]
    seen = keys <= q_pos[:, None]
    if window is not None:
        seen &= keys > q_pos[:, None] - window
    return seen


def softmax(logits: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim, with a sink logit (broadcast to logits[..., :1]) in the
    denominator where there is one."""
    if sink is None:
        return torch.softmax(logits, dim=-1)
    top = torch.maximum(logits.amax(dim=-1, keepdim=True), sink)
    weights = torch.exp(logits - top)
    return weights / (weights.sum(dim=-1, keepdim=True) + torch.exp(sink - top))


def additive_mask(seen: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.where(seen, 0.0, -np.inf).astype(np.float32))


class TorchAttentionBackend:
    name = "torch"

    def __init__(
        self,
        kv_cache: torch.Tensor,
        num_heads: int,
        scale: float,
        windows: Sequence[int | None] = (),
        sinks: Sequence[torch.Tensor] = (),
    ) -> None:
        """`windows`: each layer's sliding window (None: none); empty: no layer has one.
        `sinks`: each layer's sink logits (num_heads,); empty: none."""
        self.kv_cache = kv_cache  # (layers, 2, blocks, block_size, kv_heads, head_dim)
        _, _, _, self.block_size, self.num_kv_heads, self.head_dim = kv_cache.shape
        self.windows = tuple(windows) or (None,) * kv_cache.shape[0]
        self.sinks: list[torch.Tensor | None] = [s.float() for s in sinks]
        self.sinks = self.sinks or [None] * kv_cache.shape[0]
        self.num_heads = num_heads
        self.group = num_heads // self.num_kv_heads
        self.scale = scale
        self._slot_mapping = torch.empty(0, dtype=torch.long)
        self._decode: _DecodePlan | None = None
        self._extends: list[_ExtendPlan] = []
        # (kv_heads, 1, kv_heads, 1): selects the diagonal blocks of the query matrix.
        eye = torch.eye(self.num_kv_heads, dtype=kv_cache.dtype, device=kv_cache.device)
        self._eye = eye[:, None, :, None]

    def plan(self, metadata: AttentionMetadata) -> None:
        self._slot_mapping = metadata.slot_mapping
        host = metadata.host
        starts = host.qo_indptr[:-1]
        is_decode = host.query_lens == 1
        self._decode = self._plan_decode(host, starts, is_decode) if is_decode.any() else None
        self._extends = [
            self._plan_extend(host, int(r), int(starts[r])) for r in np.flatnonzero(~is_decode)
        ]

    def _plan_decode(
        self, md: StepMetadata, starts: np.ndarray, is_decode: np.ndarray
    ) -> _DecodePlan:
        rows = np.flatnonzero(is_decode)
        seq_lens = md.seq_lens[rows]
        max_pages = int(-(-seq_lens.max() // self.block_size))
        blocks = md.block_table[rows, :max_pages]
        kv_len = max_pages * self.block_size
        # visible() of each decode's one query, at position seq_len - 1.
        masks = {w: additive_mask(visible(seq_lens - 1, kv_len, w)) for w in set(self.windows)}
        token_rows = starts[rows].astype(np.int64)
        contiguous = bool((token_rows == np.arange(len(rows))).all())
        device = self.kv_cache.device
        return _DecodePlan(
            rows=None if contiguous else torch.from_numpy(token_rows).to(device),
            blocks=torch.from_numpy(np.ascontiguousarray(blocks).reshape(-1)).to(device),
            masks={w: mask[:, None, :].to(device) for w, mask in masks.items()},
        )

    def _plan_extend(self, md: StepMetadata, r: int, start: int) -> _ExtendPlan:
        q_len, kv_len = int(md.query_lens[r]), int(md.seq_lens[r])
        computed = kv_len - q_len
        # Query i sits at position computed + i and sees keys 0..computed + i.
        q_pos = computed + np.arange(q_len)
        device = self.kv_cache.device
        masks = {w: additive_mask(visible(q_pos, kv_len, w)).to(device) for w in set(self.windows)}
        blocks = None
        if computed > 0:
            pages = -(-kv_len // self.block_size)
            blocks = torch.from_numpy(md.block_table[r, :pages].copy()).to(self.kv_cache.device)
        return _ExtendPlan(start, start + q_len, blocks, masks)

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k_cache, v_cache = write_kv(self.kv_cache, layer_idx, self._slot_mapping, k, v)
        out = torch.empty_like(q)  # (T, num_heads, head_dim)
        window, sinks = self.windows[layer_idx], self.sinks[layer_idx]
        if self._decode is not None:
            self._forward_decode(self._decode, window, sinks, q, k_cache, v_cache, out)
        for plan in self._extends:
            self._forward_extend(plan, window, sinks, q, k, v, k_cache, v_cache, out)
        return out

    def _forward_decode(
        self,
        plan: _DecodePlan,
        window: int | None,
        sinks: torch.Tensor | None,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        mask = plan.masks[window]
        n, kv_len = mask.shape[0], mask.shape[-1]
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        keys = k_cache.index_select(0, plan.blocks).view(n, kv_len, hkv * d)
        values = v_cache.index_select(0, plan.blocks).view(n, kv_len, hkv * d)
        q_dec = q[:n] if plan.rows is None else q[plan.rows]
        q_bd = (q_dec.view(n, hkv, g, 1, d) * self._eye).view(n, hkv * g, hkv * d)
        scores = torch.bmm(q_bd, keys.transpose(1, 2)).float()  # (n, heads, kv_len)
        sink = None if sinks is None else sinks.view(1, -1, 1)
        probs = softmax(scores * self.scale + mask, sink).to(q.dtype)
        o = torch.bmm(probs, values).view(n, hkv, g, hkv, d)  # (n, heads, kv_heads * d)
        o = torch.diagonal(o, dim1=1, dim2=3).permute(0, 3, 1, 2)  # (n, kv_heads, g, d)
        if plan.rows is None:
            out[:n] = o.reshape(n, self.num_heads, d)
        else:
            out[plan.rows] = o.reshape(n, self.num_heads, d)

    def _forward_extend(
        self,
        plan: _ExtendPlan,
        window: int | None,
        sinks: torch.Tensor | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        mask = plan.masks[window]
        q_len, kv_len = mask.shape
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        if plan.blocks is None:
            keys, values = k[plan.start : plan.end], v[plan.start : plan.end]
        else:
            keys = k_cache.index_select(0, plan.blocks).view(-1, hkv, d)[:kv_len]
            values = v_cache.index_select(0, plan.blocks).view(-1, hkv, d)[:kv_len]
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # (kv_heads, kv_len, d)
        # Rows of each KV head's query matrix are (g, i): group-major, then position.
        q_f = q[plan.start : plan.end].transpose(0, 1).reshape(hkv, g * q_len, d)
        # SDPA has no sinks: a model with them materialises its scores at any size.
        if sinks is not None or self.num_heads * q_len * kv_len <= _MAX_MATERIALISED_SCORES:
            scores = torch.matmul(q_f, keys.transpose(1, 2)).float().view(hkv, g, q_len, kv_len)
            sink = None if sinks is None else sinks.view(hkv, g, 1, 1)
            probs = softmax(scores * self.scale + mask, sink).to(q.dtype)
            o = torch.matmul(probs.view(hkv, g * q_len, kv_len), values)
        else:
            o = F.scaled_dot_product_attention(
                q_f, keys, values, attn_mask=mask.to(q.dtype).repeat(g, 1), scale=self.scale
            )
        # (kv_heads, g * q_len, d) -> (q_len, heads, d)
        out[plan.start : plan.end] = o.view(self.num_heads, q_len, d).transpose(0, 1)
