"""N-gram (prompt lookup) drafts: the tokens that followed the latest earlier occurrence of
a request's last n tokens, in its own prompt and output (pure Python)."""

from __future__ import annotations

from array import array
from collections.abc import Iterable

from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.spec_decode.config import SpeculativeConfig


def can_draft(params: SamplingParams) -> bool:
    """Whether a request with these parameters takes drafts: all but those that want
    prompt logprobs. Verification samples each position from what a plain step would
    sample from: the filtered distribution (temperature, top-k, top-p, min-p), after the
    penalties, logit bias and min_tokens mask of the output as it would be with the drafts
    before it accepted; a seeded request draws at each position the noise of that output
    index, so it makes the plain engine's tokens (engine/worker/sampler.py). Logprobs are
    reported as a plain step reports them. A grammar keeps the drafts it allows
    (grammar_checked)."""
    return params.prompt_logprobs is None


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.low, self.high = config.prompt_lookup_min, config.prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, requests: Iterable[Request]) -> None:
        """Mutates each request's `spec_token_ids`: its drafts for the next step (none
        for a request that cannot take them, or whose output could not use them)."""
        for request in requests:
            request.spec_token_ids = self._drafts(request)

    def _drafts(self, request: Request) -> list[int]:
        if request.is_finished or not can_draft(request.sampling_params):
            return []
        room = draft_room(request, self.max_model_len, self.k)
        if room <= 0:
            return []
        drafts = find_continuation(request.all_token_ids, self.low, self.high, room)
        return grammar_checked(request, drafts)


def grammar_checked(request: Request, drafts: list[int]) -> list[int]:
    """A constrained request's drafts cut where its grammar stops allowing them."""
    if request.structured is None or not drafts:
        return drafts
    return request.structured.valid_drafts(drafts)


def draft_room(request: Request, max_model_len: int, k: int) -> int:
    """How many drafts `request` can use next step: none while it is still prefilling
    (drafts follow a prompt in the cache); else up to k, leaving room for the step's own
    token within max_tokens and the model's length."""
    if request.num_computed_tokens != request.num_tokens - 1:
        return 0
    room = min(k, max_model_len - request.num_tokens - 1)
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is not None:
        room = min(room, max_tokens - request.num_output_tokens - 1)
    return room


def find_continuation(tokens: list[int], low: int, high: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the last n tokens,
    for the largest n in [low, high] that occurs; [] if none does. The search runs over the
    tokens' bytes (4 per token), in C."""
    size = len(tokens)
    data = array("I", tokens).tobytes()
    for n in range(min(high, size - 1), low - 1, -1):
        pattern = data[(size - n) * 4 :]
        # An earlier occurrence ends at or before the last token, so one token follows it.
        end = (size - 1) * 4
        while (at := data.rfind(pattern, 0, end)) >= 0:
            if at % 4 == 0:  # token-aligned, not the bytes of two tokens straddled
                first = at // 4 + n
                return tokens[first : first + k]
            end = at + len(pattern) - 1  # the next candidate starts before this one
    return []
