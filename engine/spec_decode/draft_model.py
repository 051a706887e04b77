"""Draft-model drafts, as the engine core takes them (pure Python): the model runner runs
the draft model (engine/worker/draft_runner.py) right after each step's sampling and hands
back up to k greedy drafts per request that sampled; here they are cut to what each
request can use, as the other proposers' drafts are."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from engine.request import Request
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import can_draft, draft_room, grammar_checked


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len

    def propose(self, requests: Iterable[Request], drafted: Mapping[str, list[int]]) -> None:
        """Mutates each request's `spec_token_ids`: the draft model's tokens for it this
        step (`drafted`, by request id), cut at its room and its grammar."""
        for request in requests:
            drafts = drafted.get(request.request_id)
            if not drafts or request.is_finished or not can_draft(request.sampling_params):
                request.spec_token_ids = []
                continue
            room = draft_room(request, self.max_model_len, self.k)
            request.spec_token_ids = grammar_checked(request, drafts[: max(room, 0)])
