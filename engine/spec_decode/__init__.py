"""Speculative decoding (pure Python): the configuration and the draft proposers.

A proposer guesses each running request's next tokens between steps; the scheduler gives
the request those drafts as extra positions of its next step, and the model runner keeps
the longest prefix the target model agrees with (engine/worker/sampler.py: greedy, or
rejection sampling), plus one token of its own.
"""

from engine.spec_decode.config import SpeculativeConfig, parse_speculative_config
from engine.spec_decode.ngram import NgramProposer, can_draft
from engine.spec_decode.suffix import SuffixProposer

__all__ = [
    "NgramProposer",
    "SpeculativeConfig",
    "SuffixProposer",
    "can_draft",
    "make_proposer",
    "parse_speculative_config",
]


def make_proposer(config: SpeculativeConfig, max_model_len: int) -> NgramProposer | SuffixProposer:
    if config.method == "suffix":
        return SuffixProposer(config, max_model_len)
    return NgramProposer(config, max_model_len)
