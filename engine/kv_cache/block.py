"""KV cache blocks and the intrusive free list that orders their eviction (pure Python)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockHash:
    """Identity of a full block: a chained digest plus the token ids it covers.

    The digest is the dictionary key; the token ids are compared on a hit, so even a
    digest collision can never serve the wrong KV. `extra_keys` are the keys hashed in
    beside the tokens (a request's salt, on a chain's first block), kept so that KV events
    can tell consumers the part of it they can compute (engine/kv_cache/salt.py). `lora`
    is the (id, name) of the LoRA adapter whose KV the block holds, hashed into every
    block of its requests' chains.
    """

    digest: bytes
    token_ids: tuple[int, ...]
    extra_keys: tuple[str, ...] = ()
    lora: tuple[int, str] | None = None


class KVCacheBlock:
    """One page of KV cache. `prev_free`/`next_free` link it into the FreeBlockQueue."""

    __slots__ = ("block_hash", "block_id", "group", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # The KV cache group whose prefix cache holds it (engine/kv_cache/groups.py).
        self.group = 0
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "plain"
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, {cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves.

    The front is evicted first. `remove` is O(1), which is what lets a prefix-cache hit
    take a block back out of the middle of the queue.

        head <-> b3 <-> b7 <-> b1 <-> tail     (sentinels never leave the list)
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Detaches and returns the front block."""
        first = self._head.next_free
        if first is None or first is self._tail:
            raise ValueError("no free blocks left")
        self.remove(first)
        return first

    def remove(self, block: KVCacheBlock) -> None:
        """Detaches `block` from wherever it sits in the queue, in O(1)."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Puts `block` at the back, to be evicted last."""
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def __reversed__(self) -> Iterator[KVCacheBlock]:
        """From the back (evicted last) to the front."""
        block = self._tail.prev_free
        while block is not None and block is not self._head:
            yield block
            block = block.prev_free

    def contains(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None
