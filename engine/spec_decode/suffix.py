"""Suffix decoding drafts: the likeliest continuation of a request's latest tokens, from a
suffix trie over its own prompt and output and one over recent requests' outputs (pure
Python).

Each trie holds every run of up to `depth` consecutive tokens of its sequences, with how
often it occurs. A request's latest tokens are matched as deep as a trie allows (the
longest suffix with a recorded continuation); the draft then follows the most frequent
child, step by step, while the product of the children's shares stays at or above
`min_token_prob`, for at most `max_spec_factor` times the match's length tokens. The
request's own trie and the shared one each propose; the one expected to get more tokens
accepted (the sum of the products) wins. Finished requests' outputs go into the shared
trie; the oldest leave it, their counts taken back, beyond `max_cached_requests`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.request import Request
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import can_draft, draft_room, grammar_checked


@dataclass(eq=False)
class _Node:
    count: int = 0
    children: dict[int, _Node] = field(default_factory=dict)


class SuffixTrie:
    """Every run of up to `depth` consecutive tokens of the sequences added, counted."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()

    def add(
        self, tokens: Sequence[int], start: int = 0, frontier: list[_Node] | None = None
    ) -> list[_Node]:
        """Counts the runs that end at positions start.. of `tokens` (the earlier ones were
        counted by an earlier call): each new token extends the runs of up to depth - 1
        tokens that end before it. Returns their nodes after the last token, the frontier
        a later call from len(tokens) may pass back to skip finding them again."""
        if frontier is None:
            first = max(0, start - self.depth + 1)
            frontier = [self._walk(tokens[b:start]) for b in range(first, start)]
        for token in tokens[start:]:
            extended = []
            for node in [*frontier, self.root]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                extended.append(child)
            frontier = extended[-(self.depth - 1) :] if self.depth > 1 else []
        return frontier

    def remove(self, tokens: Sequence[int]) -> None:
        """Takes back the counts `add(tokens)` made; emptied nodes go."""
        for end in range(len(tokens)):
            for begin in range(max(0, end - self.depth + 1), end + 1):
                self._uncount(tokens[begin : end + 1])

    def _walk(self, run: Sequence[int]) -> _Node:
        node = self.root
        for token in run:
            node = node.children[token]
        return node

    def _uncount(self, run: Sequence[int]) -> None:
        """One occurrence fewer of `run` (its prefixes are taken back with the run's earlier
        ends); a run whose count reaches 0 goes with every longer one through it."""
        node = self.root
        for token in run[:-1]:
            found = node.children.get(token)
            if found is None:
                return  # a prefix already gone: so is this run
            node = found
        child = node.children.get(run[-1])
        if child is None:
            return
        child.count -= 1
        if child.count <= 0:
            del node.children[run[-1]]

    def propose(
        self, tokens: Sequence[int], k: int, factor: float, min_prob: float
    ) -> tuple[list[int], float]:
        """(draft, expected accepted tokens) continuing `tokens` from its longest suffix
        that has a recorded continuation."""
        for length in range(min(self.depth - 1, len(tokens)), 0, -1):
            node: _Node | None = self.root
            for token in tokens[len(tokens) - length :]:
                node = node.children.get(token) if node is not None else None
            if node is None or not node.children:
                continue
            room = min(k, max(1, int(factor * length)))
            draft: list[int] = []
            prob, score = 1.0, 0.0
            while node.children and len(draft) < room:
                total = sum(child.count for child in node.children.values())
                token, child = max(node.children.items(), key=lambda item: item[1].count)
                prob *= child.count / total
                if prob < min_prob:
                    break
                draft.append(token)
                score += prob
                node = child
            return draft, score
        return [], 0.0


class SuffixProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.depth = config.suffix_max_tree_depth
        self.factor = config.suffix_max_spec_factor
        self.min_prob = config.suffix_min_token_prob
        self.max_cached = config.suffix_max_cached_requests
        self.max_model_len = max_model_len
        self.shared = SuffixTrie(self.depth)
        # Finished requests' outputs in the shared trie, oldest first (by arrival in it: a
        # request id may come back).
        self._cached: OrderedDict[int, list[int]] = OrderedDict()
        self._num_cached = 0
        # Each tracked request: its own trie, how many of its tokens it has counted, and the
        # nodes of the runs that end at the last of them.
        self._own: dict[str, tuple[Request, SuffixTrie, int, list[_Node]]] = {}

    def propose(self, requests: Iterable[Request]) -> None:
        """Mutates each running request's `spec_token_ids`; takes the outputs of the
        tracked requests that have finished into the shared trie."""
        running = {r.request_id: r for r in requests}
        for request_id in [rid for rid in self._own if rid not in running]:
            request = self._own[request_id][0]
            if request.is_finished:
                del self._own[request_id]
                self._cache_output(request.output_token_ids)
        for request in running.values():
            request.spec_token_ids = self._drafts(request)

    def _drafts(self, request: Request) -> list[int]:
        if request.is_finished or not can_draft(request.sampling_params):
            return []
        tokens = request.all_token_ids
        entry = self._own.get(request.request_id)
        if entry is None:  # its prompt, counted once: about 30 us a token, in Python
            trie, counted, frontier = SuffixTrie(self.depth), 0, None
        else:
            _, trie, counted, frontier = entry
        frontier = trie.add(tokens, counted, frontier)
        self._own[request.request_id] = (request, trie, len(tokens), frontier)
        room = draft_room(request, self.max_model_len, self.k)
        if room <= 0:
            return []
        own = trie.propose(tokens, room, self.factor, self.min_prob)
        shared = self.shared.propose(tokens, room, self.factor, self.min_prob)
        return grammar_checked(request, (own if own[1] >= shared[1] else shared)[0])

    def _cache_output(self, output: list[int]) -> None:
        if self.max_cached == 0 or not output:
            return
        self.shared.add(output)
        self._num_cached += 1
        self._cached[self._num_cached] = list(output)
        while len(self._cached) > self.max_cached:
            _, oldest = self._cached.popitem(last=False)
            self.shared.remove(oldest)
