"""Chained block hashes for automatic prefix caching (pure Python)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from engine.kv_cache.block import BlockHash


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()
) -> BlockHash:
    """sha256 over the parent's digest, the block's token ids and the extra keys.

    Chaining makes a block's identity cover its whole prefix, so equal digests mean equal
    prefixes. Extra keys (a tenant's `cache_salt`) separate otherwise identical prefixes.
    """
    h = hashlib.sha256(parent.digest if parent is not None else b"root")
    h.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        h.update(b"\x00" + key.encode())
    return BlockHash(h.digest(), tuple(token_ids), tuple(extra_keys))


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, cache_salt: str | None
) -> None:
    """Mutates `hashes`: appends the hash of every full block of `token_ids` not yet hashed.

    The salt goes into the first block only; the chain carries it to every later block.
    """
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i > 0 else None
        extra = (cache_salt,) if i == 0 and cache_salt is not None else ()
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra))
