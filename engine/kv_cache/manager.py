"""KVCacheManager: per-request block tables on top of the BlockPool (pure Python)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine.kv_cache.block import KVCacheBlock
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.events import KVEventListener
from engine.kv_cache.groups import blocks_for_one_request
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

    def max_hit_blocks(self, request: Request) -> int: ...

    def lookup(self, request: Request, index: int, group: int) -> KVCacheBlock | None: ...

    def register(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        start: int,
        num_tokens: int,
        group: int = 0,
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

    def max_hit_blocks(self, request: Request) -> int:
        """How many of the request's leading blocks a hit may cover (hash it first).

        A hit stops one token short of the end: the last token is always recomputed,
        because sampling needs its logits. A block-aligned full hit thus gives back its
        last block. Prompt logprobs need the logits of every prompt position: no hit.
        """
        if request.sampling_params.prompt_logprobs is not None:
            return 0
        return min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))

    def lookup(self, request: Request, index: int, group: int) -> KVCacheBlock | None:
        """The block `group` cached for the request's block `index`, if any (a lookup:
        mutates nothing)."""
        return self.pool.lookup(request.block_hashes[index], group)

    def register(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        start: int,
        num_tokens: int,
        group: int = 0,
    ) -> int:
        """Mutates the pool (and the request's hashes): caches the request's full blocks
        from index `start` on, in `group`'s prefix cache.

        `num_tokens` counts the tokens whose KV will be in the cache once the scheduled
        step runs. Returns how many of the request's blocks are now registered.
        """
        self.update_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        hashes = request.block_hashes
        for i in range(start, num_full):
            self.pool.cache(blocks[i], hashes[i], hashes[i - 1] if i > 0 else None, group)
        return max(start, num_full)


class NoPrefixCache:
    """The null object used when prefix caching is off: never hashes, hits or registers."""

    def update_hashes(self, request: Request) -> None:
        return None

    def max_hit_blocks(self, request: Request) -> int:
        return 0

    def lookup(self, request: Request, index: int, group: int) -> KVCacheBlock | None:
        return None

    def register(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        start: int,
        num_tokens: int,
        group: int = 0,
    ) -> int:
        return start


# What a sliding group's table holds for the positions of a prefix hit that lie before the
# window of its first query: no block of the pool (it is never held, freed or written), and
# page 0 for the runner, which attention never reads there, as no query's window reaches it.
SKIPPED = KVCacheBlock(0)


class GroupBlocks(list[KVCacheBlock]):
    """Blocks of every KV cache group of a hybrid model (engine/kv_cache/groups.py): the
    list itself is group 0's, `groups` has each group's, group 0's first. A one-group
    manager hands out plain lists."""

    def __init__(self, groups: Sequence[list[KVCacheBlock]]) -> None:
        super().__init__(groups[0])
        self.groups = tuple(groups)


def other_group_ids(blocks: Sequence[KVCacheBlock]) -> tuple[list[int], ...]:
    """The block ids of the groups after group 0 in what allocate_slots returned (none for
    a one-group manager, or where nothing was allocated)."""
    if not isinstance(blocks, GroupBlocks):
        return ()
    return tuple([b.block_id for b in group] for group in blocks.groups[1:])


class KVCacheManager:
    """Maps requests to their blocks and decides whether new tokens fit.

    The scheduler calls `get_computed_blocks` for a waiting request, then `allocate_slots`
    for every request it schedules, and `free` when a request finishes or is preempted.

    `groups` gives each KV cache group's sliding window (None: full attention); one group
    by default, `sliding_window` its window. Each group keeps a block table per request,
    from the one pool; all tables of a request have the same length (a page per position),
    and a step allocates the same number of blocks for each.

    In a group with a window (a model whose every layer attends to the last `window`
    tokens only, or a hybrid model's sliding layers), `allocate_slots` gives back the
    leading blocks that no query of the request will see again, as vLLM's
    SlidingWindowManager does. A query at position p sees p - window + 1..p, so once the
    step's first query is at position c, the blocks wholly before c - window + 1 are freed
    (window 4, block size 4, c = 13):

        positions  0-3  4-7  8-11  12-15       c - window + 1 = 10
        blocks     b0   b1   b2    b3          b0 and b1 are freed, b2 on are kept

    A freed block stays in the request's table (`req_to_blocks`, and the runner's block
    table), so positions keep their page; the attention backends never read it, as it lies
    outside every window. It keeps its hash until it is reused (lazy eviction), so a prefix
    hit may still find it. A hit in such a group needs only the blocks in the window of the
    request's first query after it: the rest of its table is SKIPPED. A hit is as long as
    every group can serve.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        events: KVEventListener | None = None,
        sliding_window: int | None = None,
        groups: Sequence[int | None] | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if groups is not None and sliding_window is not None:
            raise ValueError("give the windows in `groups`, or one in `sliding_window`")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, events)
        self.prefix_cache: PrefixCache = (
            HashPrefixCache(self.pool, block_size) if enable_caching else NoPrefixCache()
        )
        self.counters = PrefixCacheCounters()
        self.windows: tuple[int | None, ...] = (
            (sliding_window,) if groups is None else tuple(groups)
        )
        # Each group's tables; group 0's is `req_to_blocks`.
        self._tables: list[dict[str, list[KVCacheBlock]]] = [{} for _ in self.windows]
        self.req_to_blocks = self._tables[0]
        # Blocks of each request registered in the prefix cache: the same in every group.
        self._num_registered: dict[str, int] = {}
        # Per group, the leading blocks of each request's table it holds no more: given back
        # for being out of its window, or SKIPPED by a prefix hit.
        self._num_skipped: list[dict[str, int]] = [{} for _ in self.windows]

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        return [b.block_id for b in self._tables[group].get(request_id, ())]

    def other_group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's tables in the groups after group 0, as block ids."""
        return tuple(self.block_ids(request_id, g) for g in range(1, self.num_groups))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Prefix-cache hit for a waiting request: (blocks, number of tokens they cover);
        with several groups, a GroupBlocks.

        Hashes the request's full blocks first (mutating `request.block_hashes`); the block
        pool is left as it is."""
        self.prefix_cache.update_hashes(request)
        bound = self.prefix_cache.max_hit_blocks(request)
        found = [self._lookup(request, bound, g) for g in range(self.num_groups)]
        # The longest hit every group serves: a group may shorten it, and a shorter hit may
        # lack a block another group's longer one did not need; until none shortens it.
        num_hit, settled = bound, False
        while not settled:
            settled = True
            for group, window in enumerate(self.windows):
                served = self._longest_hit(found[group], window, num_hit)
                if served < num_hit:
                    num_hit, settled = served, False
        hits = []
        for group, window in enumerate(self.windows):
            skip = self._out_of_window(window, num_hit * self.block_size)
            blocks = [SKIPPED] * skip + found[group][skip:num_hit]
            hits.append([b for b in blocks if b is not None])
        return (hits[0] if self.num_groups == 1 else GroupBlocks(hits)), num_hit * self.block_size

    def _lookup(self, request: Request, bound: int, group: int) -> list[KVCacheBlock | None]:
        """`group`'s cached block for each of the request's first `bound` blocks (None where
        it has none). A full group's hit ends at its first miss: it looks no further."""
        found: list[KVCacheBlock | None] = []
        for i in range(bound):
            block = self.prefix_cache.lookup(request, i, group)
            if block is None and self.windows[group] is None:
                return found + [None] * (bound - i)
            found.append(block)
        return found

    def _longest_hit(self, found: list[KVCacheBlock | None], window: int | None, bound: int) -> int:
        """The most leading blocks, up to `bound`, that a group with `window` can serve from
        `found` (its cached block for each of the request's blocks, None where none): all of
        them, or with a window, those in the window of the first query after the hit."""
        if window is None:
            return next((i for i in range(bound) if found[i] is None), bound)
        for num_hit in range(bound, 0, -1):
            skip = self._out_of_window(window, num_hit * self.block_size)
            if all(b is not None for b in found[skip:num_hit]):
                return num_hit
        return 0

    def _out_of_window(self, window: int | None, first_query: int) -> int:
        """The leading blocks wholly before the window of a query at `first_query`."""
        if window is None:
            return 0
        return max(0, first_query - window + 1) // self.block_size

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
        a request that is already running). Returns the newly allocated blocks (with several
        groups, a GroupBlocks; an empty list when none were needed), or None, changing
        nothing, when they do not fit. Cache hits sitting in the free queue do not count as
        free space: taking them removes them from the queue. The prefix-cache counters count
        each request once, at its first admission: a request resumed after preemption finds
        its own blocks again, which is no new traffic.
        """
        rid = request.request_id
        if new_computed_blocks is None:
            # Blocks out of the window go back first, so they count as free space here.
            self._free_out_of_window(request, request.num_computed_tokens)
            if self._fits_as_is(request, num_new_tokens, num_lookahead_tokens):
                return []
        if isinstance(new_computed_blocks, GroupBlocks):
            hits = [list(group) for group in new_computed_blocks.groups]
        else:
            hits = [list(new_computed_blocks or ())] + [[] for _ in self.windows[1:]]
        held = [tables.get(rid, []) for tables in self._tables]
        num_computed = request.num_computed_tokens + len(hits[0]) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_new = max(0, num_required - len(held[0]) - len(hits[0]))
        taken = [b for group in hits for b in group if b is not SKIPPED]
        num_hits_free = sum(1 for b in taken if b.ref_cnt == 0)
        if num_new * self.num_groups > self.pool.num_free_blocks - num_hits_free:
            return None

        self.pool.touch(taken)
        new_blocks = []
        for group, tables in enumerate(self._tables):
            blocks = tables.setdefault(rid, held[group])
            if new_computed_blocks is not None:
                self._num_skipped[group][rid] = sum(1 for b in hits[group] if b is SKIPPED)
            blocks.extend(hits[group])
            new_blocks.append(self.pool.allocate(num_new))
            blocks.extend(new_blocks[-1])
        if new_computed_blocks is not None:
            if request.num_preemptions == 0:
                self.counters.queries += request.num_tokens
                self.counters.hits += len(hits[0]) * self.block_size
            self._num_registered[rid] = len(hits[0])

        # Cache full blocks as soon as they are scheduled, so a request later in the same
        # batch can reuse them: each layer writes K/V before it attends.
        num_tokens = min(num_computed + num_new_tokens, request.num_tokens)
        start = self._num_registered.get(rid, 0)
        for group, tables in enumerate(self._tables):
            registered = self.prefix_cache.register(request, tables[rid], start, num_tokens, group)
        self._num_registered[rid] = registered
        self._free_out_of_window(request, num_computed)
        return new_blocks[0] if self.num_groups == 1 else GroupBlocks(new_blocks)

    def _free_out_of_window(self, request: Request, first_query: int) -> None:
        """Gives back, in each group with a window, the request's blocks wholly before the
        window of its query at position `first_query` (this step's first), and so of every
        later one. They are registered already: a block is cached once it is full and
        scheduled."""
        rid = request.request_id
        for group, window in enumerate(self.windows):
            skip = self._out_of_window(window, first_query)
            done = self._num_skipped[group].get(rid, 0)
            blocks = self._tables[group].get(rid)
            if blocks is None or skip <= done:
                continue
            self.pool.free(reversed(blocks[done:skip]))
            self._num_skipped[group][rid] = skip

    def blocks_for_one_request(self, max_model_len: int, max_chunk: int) -> int:
        """groups.blocks_for_one_request over this manager's groups."""
        return blocks_for_one_request(self.windows, self.block_size, max_model_len, max_chunk)

    def held_blocks(self, request_id: str, group: int = 0) -> list[KVCacheBlock]:
        """The blocks the request holds a reference on in `group`: its table less the
        leading blocks given back for being out of its window (or skipped by its hit)."""
        blocks = self._tables[group].get(request_id, [])
        return blocks[self._num_skipped[group].get(request_id, 0) :]

    def _fits_as_is(self, request: Request, num_new_tokens: int, num_lookahead: int = 0) -> bool:
        """Whether a running request's next tokens need nothing of allocate_slots: they
        fit its blocks, and no block of it fills up that was not registered yet. Most
        decode steps are so; this spares them the general path's work (a few microseconds
        a request and step, which a GPU step of a small model at 256 sequences feels).
        Every group's table has group 0's length."""
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
        """Releases the request's blocks, group by group, each tail first, so long chains
        go first."""
        rid = request.request_id
        for group, tables in enumerate(self._tables):
            blocks = self.held_blocks(rid, group)
            tables.pop(rid, None)
            self._num_skipped[group].pop(rid, None)
            self.pool.free(reversed(blocks))
        self._num_registered.pop(rid, None)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix when no request holds blocks; returns whether it did."""
        return self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Raise AssertionError if block accounting is inconsistent (tests call this)."""
        held = [
            self.held_blocks(rid, group)
            for group, tables in enumerate(self._tables)
            for rid in tables
        ]
        for group, tables in enumerate(self._tables):
            for rid, blocks in tables.items():
                assert len(blocks) == len(self.req_to_blocks[rid]), (
                    f"{rid}: group {group}'s table is not as long as group 0's"
                )
        self.pool.check_invariants(held=held)
