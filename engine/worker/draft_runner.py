"""Speculative decoding with a draft model: a smaller model of the same tokenizer runs
beside the target and proposes each request's next tokens greedily.

Its KV cache has the target's block layout, and it uses the target's block tables: a
block holds the target's keys and values in the target's cache and the draft's in this
one. Every step, the draft runs over exactly the tokens the target runs (prompt chunks,
decodes, verified drafts), so every block the target has computed, prefix-cache hits
included, holds the draft's keys and values too, and a rejected draft's slot is written
again by the next step like the target's. After the step's tokens are sampled, each
request that can take drafts feeds its new token and then its own drafts, one position a
pass, into the draft model: up to k passes, writing the slots the scheduler holds past the
step's tokens (SchedulerConfig.num_lookahead_tokens).

Drafts are the draft model's argmax, a point mass, so the target's verification
(sampler.py: greedy, or accept d with p(d) and else resample from p without d) keeps the
target's distribution exactly.
"""

from __future__ import annotations

import torch

from engine.attention import create_backend
from engine.attention.backend import AttentionBackend, allocate_kv_cache
from engine.attention.metadata import AttentionMetadata, build_step_metadata, upload
from engine.config import CacheConfig, DeviceConfig
from engine.models.arch import ModelArch
from engine.models.llama import DecoderModel
from engine.spec_decode import can_draft
from engine.worker.input_batch import StepBatch


class DraftModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        arch: ModelArch,
        cache_config: CacheConfig,
        device_config: DeviceConfig,
        num_speculative_tokens: int,
        vocab_size: int,
        scratch_blocks: int = 0,
    ) -> None:
        """`vocab_size`: the target's; drafts are drawn below it. `scratch_blocks`: the
        target's CUDA-graph scratch block, which padded rows write here too."""
        self.model = model
        self.k = num_speculative_tokens
        self.vocab_size = vocab_size
        self.block_size = cache_config.block_size
        self.device = next(model.parameters()).device
        self.kv_cache, self.backend = paged_kv_cache(
            model, arch, cache_config, device_config.attention_backend, scratch_blocks
        )

    def forward(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Mutates the draft's KV cache: runs the draft over the target's step (the same
        tokens, positions and slots); its hidden states are not needed."""
        self.backend.plan(metadata)
        self.model(input_ids, metadata.positions, self.backend)

    def propose(
        self,
        batch: StepBatch,
        sampled: dict[int, tuple[int, int]],
    ) -> dict[str, list[int]]:
        """Up to k drafts for each row of `sampled` (batch row -> (the token this step
        sampled for it, that token's position)) whose request can take drafts; each pass
        writes the draft's KV at the next position, within the slots its blocks hold."""
        rows, tokens, positions, rooms = [], [], [], []
        for row, (token, position) in sampled.items():
            state = batch.requests[row]
            if not can_draft(state.request.sampling_params):
                continue
            room = min(self.k, len(state.block_ids) * self.block_size - position)
            if room > 0:
                rows.append(row)
                tokens.append(token)
                positions.append(position)
                rooms.append(room)
        drafts: list[list[int]] = [[] for _ in rows]
        active = list(range(len(rows)))
        for step in range(self.k):
            active = [i for i in active if rooms[i] > step]
            if not active:
                break
            tables = [batch.requests[rows[i]].block_ids for i in active]
            host = build_step_metadata(
                [positions[i] + step for i in active], [1] * len(active), tables, self.block_size
            )
            metadata = upload(host, self.device)
            ids = torch.tensor([tokens[i] for i in active], dtype=torch.long, device=self.device)
            self.backend.plan(metadata)
            hidden = self.model(ids, metadata.positions, self.backend)
            logits = self.model.compute_logits(hidden)[:, : self.vocab_size]
            for i, token in zip(active, logits.argmax(dim=-1).tolist(), strict=True):
                drafts[i].append(token)
                tokens[i] = token
        requests = [batch.requests[row].request.request_id for row in rows]
        return dict(zip(requests, drafts, strict=True))


def paged_kv_cache(
    model: DecoderModel,
    arch: ModelArch,
    cache_config: CacheConfig,
    attention_backend: str,
    scratch_blocks: int,
) -> tuple[torch.Tensor, AttentionBackend]:
    """A model's paged KV cache, in the model's dtype and on its device, with
    `scratch_blocks` beyond cache_config.num_blocks, and the attention backend over it."""
    param = next(model.parameters())
    kv_cache = allocate_kv_cache(
        arch.num_layers,
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
    )
    return kv_cache, backend


def sampled_positions(batch: StepBatch, rows: list[int], accepted: list[int]) -> list[int]:
    """Where the token each of `rows` samples this step sits: after its step's tokens less
    the drafts it verified, and after the drafts it accepted."""
    return [
        batch.num_computed[r] + batch.num_new[r] - batch.num_drafts[r] + a
        for r, a in zip(rows, accepted, strict=True)
    ]
