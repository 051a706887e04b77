"""BlockPool: owns every KV block, the free queue and the prefix-cache map (pure Python)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.kv_cache.block import BlockHash, FreeBlockQueue, KVCacheBlock
from engine.kv_cache.events import KVEventListener, NoKVEvents


class BlockPool:
    """Allocation, reference counting and lazy eviction of KV blocks.

    A freed block that holds a cached full prefix keeps its hash, and so stays findable,
    until it is popped from the free queue for reuse (lazy eviction). `events` hears of
    every block that becomes findable and of every one that stops being so, in order.

    A hybrid model's KV cache groups (engine/kv_cache/groups.py) share the pool, each with
    a prefix cache of its own: the same prefix has a block in each group, holding different
    layers' K/V. Only group 0's are reported to `events`, so that a consumer sees each
    prefix once.
    """

    def __init__(self, num_blocks: int, events: KVEventListener | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.events: KVEventListener = events or NoKVEvents()
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes | tuple[int, bytes], KVCacheBlock] = {}
        # Blocks 0 .. num_ever_used - 1 have been allocated at least once, the rest never:
        # the queue starts in id order, hands out its front first, and only ever takes
        # back (or pulls out of its middle) blocks that were allocated before.
        self.num_ever_used = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        """Share of blocks held by requests (ref_cnt > 0); cached-free blocks count as free."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, block_hash: BlockHash, group: int = 0) -> KVCacheBlock | None:
        """The block `group` cached with exactly this digest and these token ids, if any."""
        block = self.cached.get(_cache_key(block_hash, group))
        if block is None or block.block_hash != block_hash:
            return None
        return block

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Pops `n` blocks from the front of the free queue, evicting their hashes."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks, {self.num_free_blocks} free")
        blocks = [self.free_queue.popleft() for _ in range(n)]
        self.num_ever_used = min(self.num_blocks, self.num_ever_used + n)
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on each block, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drops a reference on each block, in the order given.

        Blocks whose count reaches zero join the back of the queue in that order, so the
        caller passes a request's blocks tail-first to have its longest chains evicted first.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache(
        self,
        block: KVCacheBlock,
        block_hash: BlockHash,
        parent: BlockHash | None = None,
        group: int = 0,
    ) -> None:
        """Registers a full block of `group` under its hash; `parent` is the hash of the
        block before it in the chain (None for a first block), for the stored event.

        If an equal block is already registered (two requests computed the same prefix at
        once), the first one stays the cache entry and this block stays private.
        """
        if block.block_hash is not None:
            return
        key = _cache_key(block_hash, group)
        if key in self.cached:
            return
        block.block_hash, block.group = block_hash, group
        self.cached[key] = block
        if group == 0:
            self.events.block_stored(block_hash, parent)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block, if no request holds a block (their hashes are in
        use); returns whether it did."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached.values():
            block.block_hash, block.group = None, 0
        self.cached.clear()
        self.events.all_cleared()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        # Only registered blocks carry a hash: cache() leaves duplicates unhashed.
        if block.block_hash is None:
            return
        del self.cached[_cache_key(block.block_hash, block.group)]
        if block.group == 0:
            self.events.block_removed(block.block_hash)
        block.block_hash, block.group = None, 0

    def check_invariants(self, held: Sequence[Sequence[KVCacheBlock]] | None = None) -> None:
        """Raise AssertionError if the pool is inconsistent.

        Checks: free + in-use == total; ref_cnt == 0 exactly for blocks in the free queue;
        each queued block appears once; never-used blocks lead the queue, unhashed; every
        cache entry points at a block with that hash;
        and, given the block lists that requests hold, each block's ref_cnt equals the
        number of holders.
        """
        queued = list(self.free_queue)
        assert len(queued) == self.num_free_blocks, "free count disagrees with the queue"
        assert len({b.block_id for b in queued}) == len(queued), "a block is queued twice"
        in_use = [b for b in self.blocks if b.ref_cnt > 0]
        assert len(queued) + len(in_use) == self.num_blocks, "free + in use != total"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"{block} has a negative ref_cnt"
            assert (block.ref_cnt == 0) == self.free_queue.contains(block), (
                f"{block}: ref_cnt == 0 must hold exactly when it is in the free queue"
            )
        never_used = list(range(self.num_ever_used, self.num_blocks))
        assert [b.block_id for b in queued[: len(never_used)]] == never_used, (
            "never-used blocks must lead the free queue, in id order"
        )
        assert all(self.blocks[i].block_hash is None for i in never_used)
        for key, block in self.cached.items():
            assert block.block_hash is not None, f"cache entry for {block} has no hash"
            assert _cache_key(block.block_hash, block.group) == key, (
                f"cache entry for {block} does not match its hash"
            )
        if held is not None:
            holders = [0] * self.num_blocks
            for blocks in held:
                for block in blocks:
                    holders[block.block_id] += 1
            for block in self.blocks:
                assert block.ref_cnt == holders[block.block_id], (
                    f"{block} is held by {holders[block.block_id]} requests"
                )


def _cache_key(block_hash: BlockHash, group: int) -> bytes | tuple[int, bytes]:
    """The prefix-cache map's key: the digest for group 0, (group, digest) for the others."""
    return block_hash.digest if group == 0 else (group, block_hash.digest)
