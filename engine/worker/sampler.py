"""Vectorised sampling over a batch of requests with per-request parameters.

Order: raw logprobs -> logit bias, min_tokens mask, penalties -> temperature -> top_k,
top_p, min_p -> sample. Logprobs are those of the raw model distribution, as vLLM and
OpenAI report them. Seeded requests draw their noise from a generator seeded by
(seed, output index), so their tokens do not depend on the batch they run in, nor on
preemption, nor on the device: that noise is drawn on the CPU and moved to the logits'
device. Every other tensor is made on the logits' device; only the final `tolist()`
comes back to the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy
import torch

from engine.outputs import Logprobs
from engine.sampling_params import SamplingParams

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


@dataclass(frozen=True)
class LogprobTensors:
    """Device tensors behind a batch's Logprobs: (n,) chosen and ranks, (n, k) top."""

    chosen: torch.Tensor
    ranks: torch.Tensor
    top_values: torch.Tensor | None
    top_ids: torch.Tensor | None

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> LogprobTensors:
        """The same fields, each passed through `fn`."""
        values, ids = self.top_values, self.top_ids
        return LogprobTensors(
            fn(self.chosen),
            fn(self.ranks),
            None if values is None else fn(values),
            None if ids is None else fn(ids),
        )


class Sampler:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits: (n, vocab) float32, one row per request. Does not mutate `logits`."""
        tokens, tensors = self.sample_on_device(logits, rows)
        token_list = tokens.tolist()
        logprobs: list[Logprobs | None] = [None] * len(rows)
        if tensors is not None:
            logprobs = to_logprobs(tensors, token_list, [r.params.logprobs for r in rows])
        return SamplerOutput(token_list, logprobs)

    def sample_on_device(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[torch.Tensor, LogprobTensors | None]:
        """(n,) sampled token ids and, where a row asked for logprobs, their tensors, all
        on the logits' device: nothing waits for the device."""
        logits = logits[:, : self.vocab_size]
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        tokens = self.sample(logits, rows)
        if raw_logprobs is None:
            return tokens, None
        return tokens, logprob_tensors(raw_logprobs, tokens, [r.params.logprobs for r in rows])

    @staticmethod
    def lowered_tokens(rows: list[SamplingRow]) -> list[set[int]] | None:
        """Where every row is greedy, wants no logprobs, and has its logits at most lowered
        (a logit_bias of at most 0; stop tokens masked to -inf under min_tokens; no
        penalties): each row's lowered tokens. The argmax of a row's raw logits is then its
        token unless it is one of those (a lowered logit cannot overtake it, nor tie it
        from a lower index), so the model may give the tokens without the logits; else None."""
        lowered: list[set[int]] = []
        for row in rows:
            params = row.params
            bias = params.logit_bias or {}
            if (
                not params.greedy
                or params.logprobs is not None
                or params.needs_penalties
                or any(b > 0 for b in bias.values())
            ):
                return None
            tokens = set(bias)
            if len(row.output_token_ids) < params.min_tokens:
                tokens.update(row.stop_token_ids)
            lowered.append(tokens)
        return lowered

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """(n,) sampled token ids on the logits' device. Does not mutate `logits`."""
        if any(_needs_processing(r) for r in rows):
            logits = self._process(logits.clone(), rows)
        tokens = argmax_rows(logits)
        if not all(r.params.greedy for r in rows):
            greedy = device_tensor([r.params.greedy for r in rows], logits.device)
            sampled = self._sample(logits, rows)
            tokens = torch.where(greedy, tokens, sampled)
        return tokens

    def _process(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Mutates `logits`: bias, min_tokens and penalties, row by row where set."""
        device = logits.device
        for i, row in enumerate(rows):
            if not _needs_processing(row):
                continue
            params = row.params
            if params.logit_bias:
                ids = device_tensor(list(params.logit_bias), device, torch.long)
                bias = device_tensor(list(params.logit_bias.values()), device, logits.dtype)
                logits[i].index_add_(0, ids, bias)
            if len(row.output_token_ids) < params.min_tokens and row.stop_token_ids:
                stops = device_tensor(row.stop_token_ids, device, torch.long)
                logits[i].index_fill_(0, stops, _MASK)
            if params.needs_penalties:
                apply_penalties(logits[i], row)
        return logits

    def probabilities(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """(n, vocab): the distribution each row draws from (temperature, top-k, top-p,
        min-p; greedy rows at temperature 1). Does not mutate `logits`."""
        return self._probabilities(logits, rows)[0]

    def _probabilities(
        self, logits: torch.Tensor, rows: list[SamplingRow], greedy_top1: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """probabilities(), and the support filter_top_k_top_p found (or None); with
        `greedy_top1`, greedy rows keep their top token alone."""
        device = logits.device
        temperature = device_tensor(
            [1.0 if r.params.greedy else r.params.temperature for r in rows], device, logits.dtype
        )
        logits = logits / temperature[:, None]
        logits, support = filter_top_k_top_p(logits, rows, greedy_top1)
        probs = torch.softmax(logits, dim=-1)
        if any(r.params.min_p > 0 for r in rows):
            min_p = device_tensor([r.params.min_p for r in rows], device, probs.dtype)
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs, support

    @torch.inference_mode()
    def verify(
        self, logits: torch.Tensor, row: SamplingRow, drafts: Sequence[int]
    ) -> tuple[list[int], int]:
        """Speculative decoding for one request: `logits` (len(drafts) + 1, vocab) are the
        target model's at the position before each draft and after the last. Returns the
        drafts accepted and the token that follows them.

        Greedy: drafts are accepted while each is the argmax, and the token after is the
        argmax where they stop. Random: an n-gram draft is a point mass q = 1 at d, so the
        rejection rule of speculative sampling (accept with min(1, p(d) / q(d))) accepts d
        with probability p(d); a rejection draws from the residual max(0, p - q), which is
        p without d, renormalised; all accepted, the next token is drawn from p at the
        last position. Each output token is thereby distributed as p, exactly as in a
        plain step.

        A row whose logits depend on its output so far (penalties, min_tokens), with a
        logit bias, or seeded, samples each position as a plain step would with the drafts
        before it accepted (their penalties, the seeded noise of that output index), and
        accepts drafts while each is the token sampled: each token is drawn from its
        position's distribution given the tokens before it, and a seeded request makes
        the plain engine's tokens."""
        if _needs_processing(row) or row.params.seed is not None:
            return self._verify_per_position(logits, row, drafts)
        logits = logits[:, : self.vocab_size]
        num = len(drafts)
        if row.params.greedy:
            best = argmax_rows(logits.float()).tolist()
            accepted = next((i for i in range(num) if best[i] != drafts[i]), num)
            return list(drafts[:accepted]), best[accepted]
        probs = self.probabilities(logits, [row] * (num + 1))
        probs = probs / probs.sum(dim=-1, keepdim=True)  # min-p leaves them unnormalised
        drafted = torch.tensor(drafts, dtype=torch.long, device=probs.device)
        p_draft = probs[torch.arange(num, device=probs.device), drafted]
        keep = (torch.rand(num, dtype=probs.dtype, device=probs.device) < p_draft).tolist()
        accepted = next((i for i in range(num) if not keep[i]), num)
        final = probs[accepted]
        if accepted < num:  # the residual: p without the rejected draft
            final = final.clone()
            final[drafts[accepted]] = 0.0
        noise = torch.rand(final.shape, dtype=final.dtype, device=final.device).log_().neg_()
        return list(drafts[:accepted]), int(argmax_rows((final / noise)[None])[0])

    def _verify_per_position(
        self, logits: torch.Tensor, row: SamplingRow, drafts: Sequence[int]
    ) -> tuple[list[int], int]:
        """verify() by sampling each position as its own plain step (see there)."""
        outputs = row.output_token_ids
        rows = [
            SamplingRow(
                row.params, row.prompt_token_ids, [*outputs, *drafts[:i]], row.stop_token_ids
            )
            for i in range(len(drafts) + 1)
        ]
        tokens = self.sample(logits[:, : self.vocab_size], rows).tolist()
        accepted = next((i for i, d in enumerate(drafts) if tokens[i] != d), len(drafts))
        return list(drafts[:accepted]), tokens[accepted]

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        device = logits.device
        # A greedy row's draw is discarded (sample() takes its argmax): where every other
        # row filters by top-k or top-p, greedy rows keep their top token alone, so that
        # the batch can race over candidates rather than the whole vocabulary.
        vocab = logits.shape[-1]
        top1 = all(r.params.greedy or _filters(r.params, vocab) for r in rows)
        probs, support = self._probabilities(logits, rows, greedy_top1=top1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, and a tiny change
        # of p (another batch's rounding) rarely changes the winner. E = -log(U): torch's
        # exponential_() costs 4x as much on a CPU (8.8 against 2.1 ms for 8 rows of 49k;
        # seeded, 64 rows of 49k, 44.7 against 6.0). U = 0 gives E = inf, which only takes
        # that token out of one draw. Where every row's tokens lie in `support` (top-k,
        # top-p), only those race: a row's draw is the same (a token outside has p = 0).
        if support is not None:
            probs = probs.gather(1, support)
        noise = torch.rand(probs.shape, dtype=probs.dtype, device=device).log_().neg_()
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                # The noise of each token id, from (seed, output index) alone: the same
                # draw whatever the batch, and whichever tokens race.
                gen = torch.Generator().manual_seed(step_seed(row.params.seed, row))
                seeded = torch.rand(logits.shape[1], generator=gen).log_().neg_()
                seeded = seeded.to(probs.dtype)
                if device.type == "cuda":  # without waiting for the device's queue
                    seeded = seeded.pin_memory().to(device, non_blocking=True)
                noise[i] = seeded if support is None else seeded[support[i]]
        winners = argmax_rows(probs / noise)
        if support is None:
            return winners
        return support.gather(1, winners.to(device)[:, None]).squeeze(1)


def device_tensor(
    data: Sequence[Any], device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A host list as a tensor on `device`. On CUDA it goes through pinned memory without
    blocking: a blocking copy would wait for everything queued on the device, the next
    step's forward among it under async scheduling."""
    tensor = torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """(n,) int64: each row's argmax, the first one on ties or NaN, as torch's. On the CPU
    numpy's vectorized argmax does a 49k-token row in 5 us, where torch's took 55 (one
    thread) to 120 (two)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(x.numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


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
    vocab, device = logits.shape[0], logits.device
    if params.repetition_penalty != 1.0:
        seen_ids = device_tensor(row.prompt_token_ids + row.output_token_ids, device, torch.long)
        seen = torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, seen_ids, True)
        penalised = torch.where(
            logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty
        )
        logits.copy_(torch.where(seen, penalised, logits))
    if row.output_token_ids and (params.frequency_penalty or params.presence_penalty):
        out_ids = device_tensor(row.output_token_ids, device, torch.long)
        counts = torch.zeros(vocab, dtype=logits.dtype, device=device)
        counts.index_add_(0, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


# On the CPU, top-k and top-p first look at each row's CANDIDATES largest logits
# (torch.topk, a partial selection); a row whose nucleus reaches past them has its whole
# row's values sorted (numpy's vectorised sort, without the indices), and keeps the tokens
# at or above the last one its nucleus takes. 64 rows of 49k logits took 94 ms for torch to
# sort with their indices, 4.1 for the top 256, 6.8 for numpy to sort the values.
CANDIDATES = 256


def _filters(params: SamplingParams, vocab: int) -> bool:
    """Whether top-k or top-p drops tokens for `params`."""
    return 0 < params.top_k < vocab or params.top_p < 1.0


def _top_k(params: SamplingParams, vocab: int, greedy_top1: bool) -> int:
    """The row's top_k as filter_top_k_top_p applies it (vocab: none)."""
    if greedy_top1 and params.greedy:
        return 1
    return params.top_k if 0 < params.top_k < vocab else vocab


def filter_top_k_top_p(
    logits: torch.Tensor, rows: list[SamplingRow], greedy_top1: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Masks tokens outside each row's top_k and top_p nucleus (at least one survives;
    with `greedy_top1`, a greedy row's top token alone). Returns the masked logits and,
    where every row is filtered so, its nucleus fits the candidates and the logits are on
    the CPU, each row's candidates (n, c): token ids that hold every token it kept."""
    vocab = logits.shape[-1]
    k_values = [_top_k(r.params, vocab, greedy_top1) for r in rows]
    p_values = [r.params.top_p for r in rows]
    use_k, use_p = any(k < vocab for k in k_values), any(p < 1.0 for p in p_values)
    if not (use_k or use_p):
        return logits, None
    if logits.device.type != "cpu":  # no data-dependent choices away from the CPU
        return logits.masked_fill(_top_k_top_p_drop(logits, k_values, p_values), _MASK), None
    count = min(vocab, max([CANDIDATES, *(k for k in k_values if k < vocab)]))
    values, ids = logits.topk(count, dim=-1)
    drop, mass = _ranked_drop(values, logits, k_values, p_values)
    keep = torch.zeros(logits.shape, dtype=torch.bool).scatter_(1, ids, ~drop)
    # A row is settled when its kept tokens end before the candidates do: its top_k fits
    # them, or their mass (past what it keeps) reaches its top_p.
    unsettled = [
        not (k <= count or (p < 1.0 and m >= p))
        for k, p, m in zip(k_values, p_values, mass.tolist(), strict=True)
    ]
    if any(unsettled):
        index = torch.tensor(unsettled).nonzero().squeeze(1)
        part = logits[index]
        ascending = torch.from_numpy(numpy.sort(part.numpy(), axis=-1))
        ranked = ascending.flip(-1)
        sub_k = [k_values[i] for i in index.tolist()]
        sub_drop, _ = _ranked_drop(ranked, part, sub_k, [p_values[i] for i in index.tolist()])
        last = (~sub_drop).sum(dim=-1) - 1  # the last kept rank
        keep[index] = part >= ranked.gather(1, last[:, None])
    filtered = [k < vocab or p < 1.0 for k, p in zip(k_values, p_values, strict=True)]
    if not all(filtered):
        keep[~torch.tensor(filtered)] = True
    support = ids if all(filtered) and not any(unsettled) else None
    return logits.masked_fill(~keep, _MASK), support


def _ranked_drop(
    values: torch.Tensor, logits: torch.Tensor, k_values: list[int], p_values: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row's largest logits `values` (n, c), in descending order: which top_k and
    top_p drop (n, c), and the mass of all c under the distribution top_p reads (n,): the
    softmax over the row's top_k tokens (all of them, where the candidates hold fewer)."""
    vocab, device = logits.shape[-1], logits.device
    count = values.shape[-1]
    top_k = device_tensor(k_values, device)
    ranks = torch.arange(count, device=device)[None, :]
    drop = ranks >= top_k[:, None]
    top_p = device_tensor(_nucleus_thresholds(p_values), device, logits.dtype)
    # log of the normaliser: over the candidates where top_k keeps no more of them, else
    # over the whole row (a row without top_k, whose candidates are not the whole row).
    within = torch.logsumexp(values.masked_fill(drop, _MASK), dim=-1)
    whole = torch.tensor([k >= vocab and count < vocab for k in k_values], device=device)
    if bool(whole.any()):
        within = torch.where(whole, torch.logsumexp(logits, dim=-1), within)
    probs = torch.exp(values - within[:, None]).masked_fill(drop, 0.0)
    # Keep a token while the mass before it is below top_p; the first always stays.
    cumulative = probs.cumsum(dim=-1)
    drop |= (cumulative - probs) >= top_p[:, None]
    drop[:, 0] = False
    return drop, cumulative[:, -1]


def _nucleus_thresholds(p_values: list[float]) -> list[float]:
    """The mass before a token from which top_p drops it: top_p, or infinity where top_p is
    1 (a row without top_p, batched beside one with it). A float32 running sum can reach 1
    before the last token of a peaked row, which would drop the rest of that row."""
    return [p if p < 1.0 else float("inf") for p in p_values]


def _top_k_top_p_drop(
    logits: torch.Tensor, k_values: list[int], p_values: list[float]
) -> torch.Tensor:
    """filter_top_k_top_p's mask by a sort of the whole vocabulary (on any device)."""
    device = logits.device
    top_k = device_tensor(k_values, device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=device)[None, :]
    drop = ranks >= top_k[:, None]
    if any(p < 1.0 for p in p_values):
        top_p = device_tensor(_nucleus_thresholds(p_values), device, logits.dtype)
        probs = torch.softmax(sorted_logits.masked_fill(drop, _MASK), dim=-1)
        # Keep a token while the mass before it is below top_p; the first always stays.
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    return torch.zeros_like(drop).scatter_(1, order, drop)


def logprob_tensors(
    logprobs: torch.Tensor, tokens: torch.Tensor, num_top: list[int | None]
) -> LogprobTensors:
    """On the logprobs' device: each row's chosen-token logprob and rank, and the top-k
    alternatives for the largest k asked for."""
    k = max((n for n in num_top if n is not None), default=0)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    return LogprobTensors(chosen, ranks, top_values, top_ids)


def to_logprobs(
    tensors: LogprobTensors, tokens: list[int], num_top: list[int | None]
) -> list[Logprobs | None]:
    """Host Logprobs from LogprobTensors (None where a row asked for none)."""
    chosen, ranks = tensors.chosen.tolist(), tensors.ranks.tolist()
    top_ids = tensors.top_ids.tolist() if tensors.top_ids is not None else None
    top_values = tensors.top_values.tolist() if tensors.top_values is not None else None
    result: list[Logprobs | None] = []
    for i, n in enumerate(num_top):
        if n is None:
            result.append(None)
            continue
        top: list[tuple[int, float]] = []
        if n and top_ids is not None and top_values is not None:
            top = list(zip(top_ids[i][:n], top_values[i][:n], strict=True))
        result.append(Logprobs(tokens[i], float(chosen[i]), int(ranks[i]), top))
    return result


def collect_logprobs(
    logprobs: torch.Tensor, tokens: list[int], num_top: list[int | None]
) -> list[Logprobs | None]:
    """The chosen tokens' logprobs and ranks plus each row's top-n alternatives."""
    token_tensor = device_tensor(tokens, logprobs.device, torch.long)
    return to_logprobs(logprob_tensors(logprobs, token_tensor, num_top), tokens, num_top)
