"""What the block pool tells the outside about its prefix cache (pure Python).

The pool calls a KVEventListener at its three emission points: a full block registered in
the prefix cache, a registered block evicted for reuse, and the whole cache reset. The
listener that publishes them (engine/kv_events) lives outside this package, so the block
pool never imports a transport; with events off it talks to the null listener below.
"""

from __future__ import annotations

from typing import Protocol

from engine.kv_cache.block import BlockHash


class KVEventListener(Protocol):
    def block_stored(self, block_hash: BlockHash, parent: BlockHash | None) -> None:
        """A full block became findable under `block_hash`; `parent` is the block before
        it in its request's chain (None for a first block)."""
        ...

    def block_removed(self, block_hash: BlockHash) -> None:
        """A block stored earlier under `block_hash` was evicted: it is findable no more."""
        ...

    def all_cleared(self) -> None:
        """Every stored block was dropped at once (a prefix-cache reset)."""
        ...


class NoKVEvents:
    """The listener when KV events are off: hears everything, keeps nothing."""

    def block_stored(self, block_hash: BlockHash, parent: BlockHash | None) -> None:
        return None

    def block_removed(self, block_hash: BlockHash) -> None:
        return None

    def all_cleared(self) -> None:
        return None
