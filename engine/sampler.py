"""Vectorised sampling over a batch of requests with per-request parameters.

Order: raw logprobs -> logit bias, min_tokens mask, penalties -> temperature -> top_k,
top_p, min_p -> sample. Logprobs are those of the raw model distribution, as vLLM and
OpenAI report them. Seeded requests draw their noise from a generator seeded by
(seed, output index), so their tokens do not depend on the batch they run in, nor on
preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams
from engine.scheduler.output import Logprobs

_MASK = float("-inf")


@dataclass
class SamplingRow:
    """One request's sampling inputs for this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_token_ids: tuple[int, ...]  # EOS (unless ignore_eos) plus stop_token_ids


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Logprobs | None]


class Sampler:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits: (n, vocab) float32, one row per request. Does not mutate `logits`."""
        logits = logits[:, : self.vocab_size]
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        if any(_needs_processing(r) for r in rows):
            logits = self._process(logits.clone(), rows)
        greedy = torch.tensor([r.params.greedy for r in rows])
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            sampled = self._sample(logits, rows)
            tokens = torch.where(greedy, tokens, sampled)
        token_list = tokens.tolist()
        logprobs: list[Logprobs | None] = [None] * len(rows)
        if raw_logprobs is not None:
            logprobs = collect_logprobs(raw_logprobs, token_list, [r.params.logprobs for r in rows])
        return SamplerOutput(token_list, logprobs)

    def _process(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Mutates `logits`: bias, min_tokens and penalties, row by row where set."""
        for i, row in enumerate(rows):
            if not _needs_processing(row):
                continue
            params = row.params
            if params.logit_bias:
                ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
                bias = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype)
                logits[i].index_add_(0, ids, bias)
            if len(row.output_token_ids) < params.min_tokens and row.stop_token_ids:
                logits[i, list(row.stop_token_ids)] = _MASK
            if params.needs_penalties:
                apply_penalties(logits[i], row)
        return logits

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        temperature = torch.tensor(
            [1.0 if r.params.greedy else r.params.temperature for r in rows], dtype=logits.dtype
        )
        logits = logits / temperature[:, None]
        logits = filter_top_k_top_p(logits, rows)
        probs = torch.softmax(logits, dim=-1)
        min_p = torch.tensor([r.params.min_p for r in rows], dtype=probs.dtype)
        if bool((min_p > 0).any()):
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p.
        noise = torch.empty_like(probs).exponential_()
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                gen = torch.Generator().manual_seed(step_seed(row.params.seed, row))
                noise[i] = torch.empty_like(probs[i]).exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)


def _needs_processing(row: SamplingRow) -> bool:
    params = row.params
    masked = len(row.output_token_ids) < params.min_tokens and bool(row.stop_token_ids)
    return bool(params.logit_bias) or params.needs_penalties or masked


def step_seed(seed: int, row: SamplingRow) -> int:
    """A seed that depends only on the request's seed and how many tokens it has made."""
    mixed = (seed * 0x9E3779B97F4A7C15 + len(row.output_token_ids) * 0xBF58476D1CE4E5B9) % (2**63)
    return mixed


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    """Mutates one row of logits (vocab,).

    Repetition penalty (prompt and output tokens) divides positive logits and multiplies
    negative ones; frequency and presence penalties (output tokens only) subtract
    `frequency * count` and `presence * (count > 0)`, as in OpenAI's definition.
    """
    params = row.params
    vocab = logits.shape[0]
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(row.prompt_token_ids + row.output_token_ids, dtype=torch.long)] = True
        penalised = torch.where(
            logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty
        )
        logits.copy_(torch.where(seen, penalised, logits))
    if row.output_token_ids and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(row.output_token_ids), minlength=vocab)[:vocab]
        counts = counts.to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def filter_top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Masks tokens outside each row's top_k and top_p nucleus (at least one survives)."""
    vocab = logits.shape[-1]
    top_k = torch.tensor([r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows])
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=logits.dtype)
    use_k, use_p = bool((top_k < vocab).any()), bool((top_p < 1.0).any())
    if not (use_k or use_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab)[None, :]
    drop = ranks >= top_k[:, None]
    if use_p:
        probs = torch.softmax(sorted_logits.masked_fill(drop, _MASK), dim=-1)
        # Keep a token while the mass before it is below top_p; the first always stays.
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    mask = torch.zeros_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(mask, _MASK)


def collect_logprobs(
    logprobs: torch.Tensor, tokens: list[int], num_top: list[int | None]
) -> list[Logprobs | None]:
    """The chosen token's logprob and rank plus each row's top-n alternatives."""
    k = max((n for n in num_top if n is not None), default=0)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    chosen = logprobs.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    result: list[Logprobs | None] = []
    for i, n in enumerate(num_top):
        if n is None:
            result.append(None)
            continue
        top: list[tuple[int, float]] = []
        if n and top_ids is not None and top_values is not None:
            top = list(zip(top_ids[i, :n].tolist(), top_values[i, :n].tolist(), strict=True))
        result.append(Logprobs(tokens[i], float(chosen[i]), int(ranks[i]), top))
    return result
