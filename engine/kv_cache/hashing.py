"""Chained block hashes for automatic prefix caching (pure Python)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from engine.kv_cache.block import BlockHash


def hash_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[str, ...] = (),
    lora: tuple[int, str] | None = None,
) -> BlockHash:
    """sha256 over the parent's digest, the block's token ids, the extra keys and the LoRA
    adapter (id and name) whose KV the block holds.

    Chaining makes a block's identity cover its whole prefix, so equal digests mean equal
    prefixes. Extra keys (a tenant's `cache_salt`) separate otherwise identical prefixes;
    so does the adapter, in every block, so that no two adapters (or an adapter and the
    base model) share one. The id changes when a name is loaded again, so a reloaded
    adapter never meets the old one's blocks.
    """
    h = hashlib.sha256(parent.digest if parent is not None else b"root")
    h.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        h.update(b"\x00" + key.encode())
    if lora is not None:
        h.update(b"\x01" + f"{lora[0]}:{lora[1]}".encode())
    return BlockHash(h.digest(), tuple(token_ids), tuple(extra_keys), lora)


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
    lora: tuple[int, str] | None = None,
) -> None:
    """Mutates `hashes`: appends the hash of every full block of `token_ids` not yet hashed.

    The salt goes into the first block only; the chain carries it to every later block.
    The adapter (`lora`, id and name) goes into every block, as vLLM's extra keys do.
    """
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i > 0 else None
        extra = (cache_salt,) if i == 0 and cache_salt is not None else ()
        block = token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block(parent, block, extra, lora))
