"""Speculative decoding (pure Python): the configuration and the draft proposers.

A proposer guesses each running request's next tokens between steps; the scheduler gives
the request those drafts as extra positions of its next step (a draft model's drafts come
from the model runner, see draft_model.py), and the model runner keeps
the longest prefix the target model agrees with (engine/worker/sampler.py: greedy, or
rejection sampling), plus one token of its own.
"""

from engine.spec_decode.config import SpeculativeConfig, parse_speculative_config
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.ngram import NgramProposer, can_draft
from engine.spec_decode.suffix import SuffixProposer

__all__ = [
    "DraftModelProposer",
    "NgramProposer",
    "Proposer",
    "SpeculativeConfig",
    "SuffixProposer",
    "can_draft",
    "make_proposer",
    "parse_speculative_config",
]


Proposer = NgramProposer | SuffixProposer | DraftModelProposer


def make_proposer(config: SpeculativeConfig, max_model_len: int) -> Proposer:
    if config.method == "draft_model":
        return DraftModelProposer(config, max_model_len)
    if config.method == "suffix":
        return SuffixProposer(config, max_model_len)
    return NgramProposer(config, max_model_len)
