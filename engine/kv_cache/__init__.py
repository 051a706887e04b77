"""Paged KV cache bookkeeping with automatic prefix caching. Pure Python: no torch here."""

from engine.kv_cache.block import BlockHash, FreeBlockQueue, KVCacheBlock
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.events import KVEventListener, NoKVEvents
from engine.kv_cache.manager import KVCacheManager, PrefixCacheCounters

__all__ = [
    "BlockHash",
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "KVEventListener",
    "NoKVEvents",
    "PrefixCacheCounters",
]
