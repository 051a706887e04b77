"""Applies constrained requests' grammars to the step's logits, before any sampling.

Each constrained row's matcher writes its allowed-token bitmask (one bit per token, in
32-bit words) into a host buffer; the buffer goes to the logits' device in one copy, where
it is unpacked and applied with tensor ops: no Python loop over the vocabulary. Greedy,
random, top-k/top-p and seeded sampling all see the masked logits, so none of them can draw
a token the grammar forbids.

    word w of row i, bit b  ->  token 32 * w + b allowed for that row
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from engine.request import Request


class Bitmask(Protocol):
    """What writes a row's allowed tokens (a GrammarMatcher, or a request's grammar state)."""

    def fill_bitmask(self, address: int, num_bytes: int) -> None: ...


_MASK = float("-inf")


class GrammarBitmask:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self.device = device
        self._host = self._allocate(8)
        # Bit b of a word as an int32 (bit 31 is the sign bit).
        bits = [1 << b if b < 31 else -(1 << 31) for b in range(32)]
        self._bits = torch.tensor(bits, dtype=torch.int32, device=device)

    def _allocate(self, rows: int) -> torch.Tensor:
        buffer = torch.zeros((rows, self.num_words), dtype=torch.int32)
        return buffer.pin_memory() if self.device.type == "cuda" else buffer

    def apply_to(self, logits: torch.Tensor, requests: list[Request]) -> None:
        """Mutates `logits` (one row per request): masks the constrained requests' rows."""
        rows: list[int] = []
        masks: list[Bitmask] = []
        for row, request in enumerate(requests):
            if request.structured is not None and request.structured.constrains_next():
                rows.append(row)
                masks.append(request.structured)
        self.apply(logits, rows, masks)

    def apply_to_drafts(self, logits: torch.Tensor, request: Request, drafts: list[int]) -> None:
        """Mutates `logits` (len(drafts) + 1, >= vocab), one request's verified positions
        (speculative decoding): each row masked by the grammar's state after the drafts
        before it."""
        structured = request.structured
        if structured is None or not structured.constrains_next():
            return
        rows = len(drafts) + 1
        # A buffer of its own: several requests verify drafts in one step, and on CUDA the
        # last one's copy may still be in flight.
        host = self._allocate(rows)
        addresses = [host[i].data_ptr() for i in range(rows)]
        structured.fill_draft_bitmasks(drafts, addresses, self.num_words * 4)
        self._mask(logits, host)

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: Sequence[Bitmask]) -> None:
        """Mutates `logits` (num_rows, >= vocab): in each listed row, tokens the row's matcher
        does not allow become -inf (columns past the vocabulary too)."""
        if not rows:
            return
        if len(rows) > self._host.shape[0]:
            self._host = self._allocate(max(len(rows), 2 * self._host.shape[0]))
        host = self._host[: len(rows)]
        num_bytes = self.num_words * 4
        for i, matcher in enumerate(matchers):
            matcher.fill_bitmask(host[i].data_ptr(), num_bytes)
        if rows == list(range(logits.shape[0])):  # every row is constrained: in place
            self._mask(logits, host)
            return
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        masked = logits[index]
        self._mask(masked, host)
        logits[index] = masked

    def _mask(self, logits: torch.Tensor, host: torch.Tensor) -> None:
        """Mutates `logits` (k, >= vocab): -inf wherever `host`'s (k, num_words) bitmask
        has no bit, and past the vocabulary."""
        words = host.to(self.device, non_blocking=True)  # (k, num_words) int32
        forbidden = (words[:, :, None] & self._bits) == 0  # (k, num_words, 32)
        forbidden = forbidden.view(len(host), -1)[:, : self.vocab_size]
        logits[:, : self.vocab_size].masked_fill_(forbidden, _MASK)
        logits[:, self.vocab_size :] = _MASK
