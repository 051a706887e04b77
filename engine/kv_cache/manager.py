"""KVCacheManager: per-request block tables on top of the BlockPool (pure Python)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine.kv_cache.block import KVCacheBlock
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.events import KVEventListener
from engine.kv_cache.hashing import extend_block_hashes
from engine.utils import cdiv

if TYPE_CHECKING:
    from engine.request import Request


@dataclass
class PrefixCacheCounters:
    """Running totals, in tokens, of prompt tokens looked up and found in the cache."""

    queries: int = 0
    hits: int = 0


class PrefixCache(Protocol):
    def update_hashes(self, request: Request) -> None: ...

    def find_hits(self, request: Request) -> list[KVCacheBlock]: ...

    def register(
        self, request: Request, blocks: Sequence[KVCacheBlock], start: int, num_tokens: int
    ) -> int: ...


class HashPrefixCache:
    """Automatic prefix caching over chained block hashes."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size

    def update_hashes(self, request: Request) -> None:
        """Mutates the request: extends `request.block_hashes` to all of its full blocks."""
        lora = request.lora
        extend_block_hashes(
            request.block_hashes,
            request.all_token_ids,
            self.block_size,
            request.cache_salt,
            None if lora is None else (lora.lora_int_id, lora.lora_name),
        )

    def find_hits(self, request: Request) -> list[KVCacheBlock]:
        """The cached blocks that form the longest prefix of the request's hashed blocks.
        A lookup: mutates nothing (hash the request with `update_hashes` first).

        The hit stops one token short of the end: the last token is always recomputed,
        because sampling needs its logits. A block-aligned full hit thus gives back its
        last block.
        """
        if request.sampling_params.prompt_logprobs is not None:
            return []  # prompt logprobs need the logits of every prompt position
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def register(
        self, request: Request, blocks: Sequence[KVCacheBlock], start: int, num_tokens: int
    ) -> int:
        """Mutates the pool (and the request's hashes): caches the request's full blocks
        from index `start` on.

        `num_tokens` counts the tokens whose KV will be in the cache once the scheduled
        step runs. Returns how many of the request's blocks are now registered.
        """
        self.update_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        hashes = request.block_hashes
        for i in range(start, num_full):
            self.pool.cache(blocks[i], hashes[i], hashes[i - 1] if i > 0 else None)
        return max(start, num_full)


class NoPrefixCache:
    """The null object used when prefix caching is off: never hashes, hits or registers."""

    def update_hashes(self, request: Request) -> None:
        return None

    def find_hits(self, request: Request) -> list[KVCacheBlock]:
        return []

    def register(
        self, request: Request, blocks: Sequence[KVCacheBlock], start: int, num_tokens: int
    ) -> int:
        return start


class KVCacheManager:
    """Maps requests to their blocks and decides whether new tokens fit.

    The scheduler calls `get_computed_blocks` for a waiting request, then `allocate_slots`
    for every request it schedules, and `free` when a request finishes or is preempted.

    With a `sliding_window` (a model whose every layer attends to the last `sliding_window`
    tokens only), `allocate_slots` gives back the leading blocks that no query of the
    request will see again, as vLLM's SlidingWindowManager does. A query at position p sees
    p - window + 1..p, so once the step's first query is at position c, the blocks wholly
    before c - window + 1 are freed (window 4, block size 4, c = 13):

        positions  0-3  4-7  8-11  12-15       c - window + 1 = 10
        blocks     b0   b1   b2    b3          b0 and b1 are freed, b2 on are kept

    A freed block stays in the request's table (`req_to_blocks`, and the runner's block
    table), so positions keep their page; the attention backends never read it, as it lies
    outside every window. It keeps its hash until it is reused (lazy eviction), so a prefix
    hit may still find it; a hit is a chain of blocks that are all still cached, so it
    never relies on one that was reused.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        events: KVEventListener | None = None,
        sliding_window: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, events)
        self.prefix_cache: PrefixCache = (
            HashPrefixCache(self.pool, block_size) if enable_caching else NoPrefixCache()
        )
        self.counters = PrefixCacheCounters()
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_registered: dict[str, int] = {}
        self.sliding_window = sliding_window
        # Leading blocks of each request given back for being out of its window.
        self._num_skipped: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Prefix-cache hit for a waiting request: (blocks, number of tokens they cover).

        Hashes the request's full blocks first (mutating `request.block_hashes`); the block
        pool is left as it is."""
        self.prefix_cache.update_hashes(request)
        hits = self.prefix_cache.find_hits(request)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Makes room for `num_new_tokens` more tokens of `request`, and for
        `num_lookahead_tokens` slots after them (a draft model writes its drafts there before
        the next step schedules them; they are never registered in the prefix cache).

        `new_computed_blocks` is the prefix-cache hit of a request being admitted (None for
        a request that is already running). Returns the newly allocated blocks, or None,
        changing nothing, when they do not fit. Cache hits sitting in the free queue do not
        count as free space: taking them removes them from the queue. The prefix-cache
        counters count each request once, at its first admission: a request resumed after
        preemption finds its own blocks again, which is no new traffic.
        """
        if new_computed_blocks is None:
            # Blocks out of the window go back first, so they count as free space here.
            self._free_out_of_window(request, request.num_computed_tokens)
            if self._fits_as_is(request, num_new_tokens, num_lookahead_tokens):
                return []
        hits = list(new_computed_blocks or ())
        held = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_new = max(0, num_required - len(held) - len(hits))
        num_hits_free = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new > self.pool.num_free_blocks - num_hits_free:
            return None

        self.pool.touch(hits)
        new_blocks = self.pool.allocate(num_new)
        blocks = self.req_to_blocks.setdefault(request.request_id, held)
        blocks.extend(hits)
        blocks.extend(new_blocks)
        if new_computed_blocks is not None:
            if request.num_preemptions == 0:
                self.counters.queries += request.num_tokens
                self.counters.hits += len(hits) * self.block_size
            self._num_registered[request.request_id] = len(hits)

        # Cache full blocks as soon as they are scheduled, so a request later in the same
        # batch can reuse them: each layer writes K/V before it attends.
        num_tokens = min(num_computed + num_new_tokens, request.num_tokens)
        start = self._num_registered.get(request.request_id, 0)
        self._num_registered[request.request_id] = self.prefix_cache.register(
            request, blocks, start, num_tokens
        )
        self._free_out_of_window(request, num_computed)
        return new_blocks

    def _free_out_of_window(self, request: Request, first_query: int) -> None:
        """Gives back the request's blocks wholly before the window of its query at position
        `first_query` (this step's first), and so of every later one; no-op without a window.
        They are registered already: a block is cached once it is full and scheduled."""
        if self.sliding_window is None:
            return
        rid = request.request_id
        skip = max(0, first_query - self.sliding_window + 1) // self.block_size
        done = self._num_skipped.get(rid, 0)
        blocks = self.req_to_blocks.get(rid)
        if blocks is None or skip <= done:
            return
        self.pool.free(reversed(blocks[done:skip]))
        self._num_skipped[rid] = skip

    def blocks_for_one_request(self, max_model_len: int, max_chunk: int) -> int:
        """The most blocks one request of up to max_model_len tokens, scheduled in chunks of
        up to max_chunk, holds at once: all of them, or with a sliding window, those of the
        window before a chunk and the chunk's (one more where the window starts mid-block)."""
        whole = cdiv(max_model_len, self.block_size)
        if self.sliding_window is None:
            return whole
        return min(whole, cdiv(self.sliding_window - 1 + max_chunk, self.block_size) + 1)

    def held_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The blocks the request holds a reference on: its table less the leading blocks
        given back for being out of its window."""
        blocks = self.req_to_blocks.get(request_id, [])
        return blocks[self._num_skipped.get(request_id, 0) :]

    def _fits_as_is(self, request: Request, num_new_tokens: int, num_lookahead: int = 0) -> bool:
        """Whether a running request's next tokens need nothing of allocate_slots: they
        fit its blocks, and no block of it fills up that was not registered yet. Most
        decode steps are so; this spares them the general path's work (a few microseconds
        a request and step, which a GPU step of a small model at 256 sequences feels)."""
        held = self.req_to_blocks.get(request.request_id)
        if held is None:
            return False
        end = request.num_computed_tokens + num_new_tokens
        if end + num_lookahead > len(held) * self.block_size:
            return False
        if not self.enable_caching:  # nothing is ever registered
            return True
        full = min(end, request.num_tokens) // self.block_size
        return full <= self._num_registered.get(request.request_id, 0)

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first, so long chains go first."""
        blocks = self.held_blocks(request.request_id)
        self.req_to_blocks.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        self._num_skipped.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix when no request holds blocks; returns whether it did."""
        return self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Raise AssertionError if block accounting is inconsistent (tests call this)."""
        self.pool.check_invariants(held=[self.held_blocks(rid) for rid in self.req_to_blocks])
