"""Paged KV cache bookkeeping with automatic prefix caching. Pure Python: no torch here."""

from engine.kv_cache.block import BlockHash, FreeBlockQueue, KVCacheBlock
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.events import KVEventListener, NoKVEvents
from engine.kv_cache.groups import KVCacheGroups
from engine.kv_cache.manager import (
    SKIPPED,
    GroupBlocks,
    KVCacheManager,
    PrefixCacheCounters,
    other_group_ids,
)

__all__ = [
    "SKIPPED",
    "BlockHash",
    "BlockPool",
    "FreeBlockQueue",
    "GroupBlocks",
    "KVCacheBlock",
    "KVCacheGroups",
    "KVCacheManager",
    "KVEventListener",
    "NoKVEvents",
    "PrefixCacheCounters",
    "other_group_ids",
]
