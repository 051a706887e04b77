"""Speculative decoding with a draft model: a smaller model of the same tokenizer runs
beside the target and proposes each request's next tokens greedily.

Its KV cache has the target's block layout, and it uses the target's block tables: a
block holds the target's keys and values in the target's cache and the draft's in this
one. After each step's tokens are sampled, the draft's first pass runs over every row's
tokens of that step that hold (prompt chunks, decoded tokens, accepted drafts; not the
rejected ones), so every block the target has computed, prefix-cache hits included, holds
the draft's keys and values too; a request that can take drafts adds the token it just
sampled, whose logits give its first draft. Each further pass feeds each such request its
last draft, one position a pass: up to k passes in all, writing the slots the scheduler
holds past the step's tokens (SchedulerConfig.num_lookahead_tokens).

Drafts are the draft model's argmax, a point mass, so the target's verification
(sampler.py: greedy, or accept d with p(d) and else resample from p without d) keeps the
target's distribution exactly.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.attention import create_backend
from engine.attention.backend import AttentionBackend, allocate_kv_cache
from engine.attention.metadata import build_step_metadata, upload
from engine.config import CacheConfig, DeviceConfig
from engine.models.arch import ModelArch
from engine.models.llama import DecoderModel
from engine.spec_decode import can_draft
from engine.worker.input_batch import StepBatch
from engine.worker.sampler import argmax_rows


class DraftModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        arch: ModelArch,
        cache_config: CacheConfig,
        device_config: DeviceConfig,
        num_speculative_tokens: int,
        vocab_size: int,
    ) -> None:
        """`vocab_size`: the target's; drafts are drawn below it. The draft runs eagerly,
        never on a CUDA graph's padded batch, so its cache needs no scratch block."""
        self.model = model
        self.k = num_speculative_tokens
        self.vocab_size = vocab_size
        self.block_size = cache_config.block_size
        self.device = next(model.parameters()).device
        self.kv_cache, self.backend = paged_kv_cache(
            model, arch, cache_config, device_config.attention_backend, 0
        )

    def propose(
        self, batch: StepBatch, num_valid: list[int], sampled: dict[int, int]
    ) -> dict[str, list[int]]:
        """Mutates the draft's KV cache. `num_valid`: per batch row, how many of its step's
        tokens hold (all but its drafts, plus those it accepted); `sampled`: batch row ->
        the token this step sampled for it. Returns up to k drafts for each sampled row
        whose request can take drafts, by request id; each draft's KV goes within the
        slots the row's blocks hold."""
        drafting: dict[int, int] = {}  # row -> drafts it has room for
        chunks: list[np.ndarray] = []
        first = 0  # the row's first token in the step's input ids
        for row, state in enumerate(batch.requests):
            chunk = batch.input_ids[first : first + num_valid[row]]
            first += batch.num_new[row]
            position = batch.num_computed[row] + num_valid[row]  # the sampled token's
            room = min(self.k, len(state.block_ids) * self.block_size - position)
            if row in sampled and room > 0 and can_draft(state.request.sampling_params):
                drafting[row] = room
                chunk = np.append(chunk, sampled[row])
            chunks.append(chunk)
        new = [len(c) for c in chunks]
        ids = np.concatenate(chunks)
        last = np.cumsum(new)[list(drafting)] - 1  # each drafting row's sampled token
        tokens = self._pass(ids, batch.num_computed, new, batch.block_ids, last)
        rows = list(drafting)
        positions = [batch.num_computed[r] + num_valid[r] for r in rows]
        drafts = [[t] for t in tokens]
        for step in range(1, self.k):
            active = [i for i, r in enumerate(rows) if drafting[r] > step]
            if not active:
                break
            tokens = self._pass(
                np.array([drafts[i][-1] for i in active], dtype=np.int64),
                [positions[i] + step for i in active],
                [1] * len(active),
                [batch.requests[rows[i]].block_ids for i in active],
                np.arange(len(active)),
            )
            for i, token in zip(active, tokens, strict=True):
                drafts[i].append(token)
        return {batch.requests[r].request.request_id: d for r, d in zip(rows, drafts, strict=True)}

    def _pass(
        self,
        input_ids: np.ndarray,
        num_computed: list[int],
        num_new: list[int],
        block_ids: list[list[int]],
        logit_rows: np.ndarray,
    ) -> list[int]:
        """Mutates the draft's KV cache: one forward of the draft model; the argmax token
        at each of `logit_rows` (within the target's vocabulary)."""
        host = build_step_metadata(num_computed, num_new, block_ids, self.block_size)
        metadata = upload(host, self.device)
        self.backend.plan(metadata)
        ids = torch.from_numpy(input_ids).to(self.device)
        hidden = self.model(ids, metadata.positions, self.backend)
        if not len(logit_rows):
            return []
        rows = hidden[torch.from_numpy(logit_rows).to(self.device)]
        tokens = self.model.greedy_tokens(rows, self.vocab_size)
        if tokens is None:
            tokens = argmax_rows(self.model.compute_logits(rows)[:, : self.vocab_size])
        return tokens.tolist()


def paged_kv_cache(
    model: DecoderModel,
    arch: ModelArch,
    cache_config: CacheConfig,
    attention_backend: str,
    scratch_blocks: int,
) -> tuple[torch.Tensor, AttentionBackend]:
    """A model's paged KV cache, in the model's dtype and on its device, with
    `scratch_blocks` beyond cache_config.num_blocks, and the attention backend over it. A
    hybrid model's KV cache groups (cache_config.groups) hold one K/V pair a slot."""
    param = next(model.parameters())
    groups = cache_config.groups
    kv_cache = allocate_kv_cache(
        arch.num_layers if groups is None else groups.num_slots,
        cache_config.num_blocks + scratch_blocks,
        cache_config.block_size,
        arch.num_kv_heads,
        arch.head_dim,
        param.dtype,
        param.device,
    )
    backend = create_backend(
        attention_backend,
        kv_cache,
        arch.num_heads,
        arch.attention_scale,
        arch.layer_windows,
        model.layer_sinks(),
        groups,
    )
    return kv_cache, backend
