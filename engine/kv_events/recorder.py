"""Records the block pool's events of one step as vLLM's KV event structs.

The structs below reproduce vLLM's `vllm/distributed/kv_events.py` wire layout as of
v0.11-v0.23 (before vLLM PR #42892 switched events to maps): msgspec structs with
`array_like=True`, `omit_defaults=True` and `tag=True`, so each event is a positional
msgpack array whose first element is the class name, and trailing fields left at their
default are omitted. llm-d's KV-cache indexer (VLLMAdapter) reads exactly these positions:

    BlockStored       [tag, block_hashes, parent_block_hash, token_ids, block_size,
                       lora_id, medium, lora_name, extra_keys]
    BlockRemoved      [tag, block_hashes, medium]
    AllBlocksCleared  [tag]
    KVEventBatch      [ts, events, data_parallel_rank]

Block hashes go out as vLLM sends them by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES):
the last 8 bytes of the digest as a big-endian unsigned 64-bit integer.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from engine.kv_cache.block import BlockHash
from engine.kv_cache.salt import published_salt

# vLLM calls its primary KV tier "GPU" on every device; llm-d weights tiers by this name.
MEDIUM = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """The base of the three events; `tag=True` puts the class name first."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # One entry per block: the keys hashed beside its tokens, as a router can compute them
    # from a request (a salt's published part, on a chain's first block), or None.
    extra_keys: list[tuple[str, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_hash(block_hash: BlockHash) -> int:
    """The 64-bit block hash consumers see (vLLM's maybe_convert_block_hash)."""
    return int.from_bytes(block_hash.digest[-8:], "big")


def published_keys(block_hash: BlockHash) -> tuple[str, ...] | None:
    """The block's extra keys as events publish them: each salt's published part (a
    scoped salt without its scope, see engine/kv_cache/salt.py); None when none is left."""
    if not block_hash.extra_keys:  # every block but a salted chain's first
        return None
    keys = tuple(p for p in map(published_salt, block_hash.extra_keys) if p is not None)
    return keys or None


class KVEventRecorder:
    """A KVEventListener that turns the pool's calls into events, in order.

    A store that extends the chain of the event just before it joins that event, as vLLM
    sends one BlockStored per request's newly full blocks; consecutive removals share one
    BlockRemoved. Runs on the step thread, so it does no more than build small structs:
    encoding and sending happen on the publisher's thread.
    """

    def __init__(self, block_size: int, data_parallel_rank: int = 0) -> None:
        self.block_size = block_size
        self.data_parallel_rank = data_parallel_rank
        self._events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        self._last_stored: int | None = None

    def block_stored(self, block_hash: BlockHash, parent: BlockHash | None) -> None:
        this = external_hash(block_hash)
        extra = published_keys(block_hash)
        last = self._events[-1] if self._events else None
        if (
            isinstance(last, BlockStored)
            and parent is not None
            and (external_hash(parent) == self._last_stored)
        ):
            last.block_hashes.append(this)
            last.token_ids.extend(block_hash.token_ids)
            assert last.extra_keys is not None
            last.extra_keys.append(extra)
        else:
            parent_hash = None if parent is None else external_hash(parent)
            tokens = list(block_hash.token_ids)
            lora_id, lora_name = block_hash.lora or (None, None)
            event = BlockStored(
                [this], parent_hash, tokens, self.block_size, lora_id, MEDIUM, lora_name
            )
            event.extra_keys = [extra]
            self._events.append(event)
        self._last_stored = this

    def block_removed(self, block_hash: BlockHash) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(external_hash(block_hash))
        else:
            self._events.append(BlockRemoved([external_hash(block_hash)], MEDIUM))
        self._last_stored = None

    def all_cleared(self) -> None:
        self._events.append(AllBlocksCleared())
        self._last_stored = None

    def take_batch(self) -> KVEventBatch | None:
        """The events since the last call as one batch (None if there were none)."""
        if not self._events:
            return None
        events, self._events = self._events, []
        self._last_stored = None
        return KVEventBatch(time.time(), events, self.data_parallel_rank)
