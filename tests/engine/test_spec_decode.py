"""Speculative decoding with n-gram drafts (--speculative-config): exact by construction.

Greedy output equals transformers token for token in float32 with drafts verified alone,
batched, chunked, from the prefix cache and after preemption; stops inside accepted drafts
end the output where a plain step would; penalised, biased and seeded requests give
exactly the plain engine's tokens; and rejection
sampling draws each token from the filtered softmax, over many draws with a fixed seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.request import Request, RequestStatus
from engine.spec_decode import SpeculativeConfig, parse_speculative_config
from engine.spec_decode.ngram import find_continuation
from engine.spec_decode.suffix import SuffixProposer, SuffixTrie
from engine.worker.sampler import Sampler, SamplingRow
from tests.engine.test_correctness import CHECKED, hf_greedy, make_prompts, tiny_llm
from tests.tiny_models import make_tiny_model

NGRAM = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
)
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"method": "ngram", "num_speculative_tokens": 3}', SpeculativeConfig("ngram", 3, 2, 5)),
        (
            '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}',
            SpeculativeConfig("ngram", 5, 2, 4),
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 7}',
            SpeculativeConfig("ngram", 2, 7, 7),
        ),
        (
            '{"method": "suffix", "num_speculative_tokens": 6, '
            '"suffix_decoding_min_token_prob": 0.2, "suffix_decoding_max_cached_requests": 0}',
            SpeculativeConfig("suffix", 6, suffix_min_token_prob=0.2, suffix_max_cached_requests=0),
        ),
        ("", None),
    ],
)
def test_parses_vllms_spelling(text: str, expected: SpeculativeConfig | None) -> None:
    assert parse_speculative_config(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ngram", "not JSON"),
        ("[1]", "JSON object"),
        ('{"method": "eagle3", "num_speculative_tokens": 3}', "not implemented yet"),
        ('{"method": "suffix", "num_speculative_tokens": 3, "prompt_lookup_min": 2}', "keys"),
        (
            '{"method": "suffix", "num_speculative_tokens": 3, '
            '"suffix_decoding_max_tree_depth": 1}',
            "2-64",
        ),
        ('{"method": "foo", "num_speculative_tokens": 3}', "not one of"),
        ('{"method": "ngram"}', "needs num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "1-16"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "integer"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4}', "keys"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 3}',
            "min <= max",
        ),
    ],
)
def test_refuses_what_it_does_not_run(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(text)


def test_finds_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    assert find_continuation([1, 2, 3, 9, 1, 2, 3, 4, 1, 2, 3], 1, 3, 2) == [4, 1]
    assert find_continuation([5, 6, 7, 8, 6, 7], 1, 3, 5) == [8, 6, 7]  # the 2-gram 6 7
    assert find_continuation([1, 2, 3], 1, 2, 3) == []
    assert find_continuation([4, 4, 4], 2, 2, 3) == [4]  # 4 4 at 0, followed by one token
    assert find_continuation([7, 1, 2], 2, 3, 3) == []  # below prompt_lookup_min
    # Token 256's bytes (00 01 00 00) end where token 1's (01 00 00 00) start: a byte match
    # across two tokens is not a token match.
    assert find_continuation([256, 0, 9, 1, 0], 2, 2, 2) == []


def test_suffix_trie_counts_runs_and_proposes_the_likeliest_continuation() -> None:
    trie = SuffixTrie(depth=4)
    trie.add([1, 2, 3, 1, 2, 4, 1, 2, 3])
    root = trie.root
    assert root.children[1].count == 3 and root.children[1].children[2].count == 3
    assert root.children[1].children[2].children[3].count == 2
    assert max(len(run) for run, _ in _paths(root)) == 4  # no run longer than the depth
    # After "... 1 2": 3 twice, 4 once. min_prob 0.5 keeps 3 (2/3), not what follows it.
    draft, score = trie.propose([9, 1, 2], k=5, factor=2.0, min_prob=0.5)
    assert draft == [3, 1] and score == pytest.approx(2 / 3 + 2 / 3)
    assert trie.propose([9, 1, 2], k=5, factor=2.0, min_prob=0.7) == ([], 0.0)
    assert trie.propose([9, 1, 2], k=5, factor=0.5, min_prob=0.1)[0] == [3]  # factor * 2
    # Counting in two calls is counting once; removing takes every count back.
    split, resumed = SuffixTrie(depth=4), SuffixTrie(depth=4)
    split.add([1, 2, 3, 1, 2], 0)
    split.add([1, 2, 3, 1, 2, 4, 1, 2, 3], 5)
    frontier = resumed.add([1, 2, 3, 1, 2])  # handed back: the runs ending at the last token
    resumed.add([1, 2, 3, 1, 2, 4, 1, 2, 3], 5, frontier)
    assert sorted(_paths(split.root)) == sorted(_paths(resumed.root)) == sorted(_paths(root))
    trie.remove([1, 2, 3, 1, 2, 4, 1, 2, 3])
    assert root.children == {}


def test_suffix_cache_keeps_the_latest_outputs() -> None:
    """With suffix_decoding_max_cached_requests 1, a finished request's output replaces the
    one before in the shared trie, also under the same request id."""
    proposer = SuffixProposer(SpeculativeConfig("suffix", 4, suffix_max_cached_requests=1), 64)
    for output in ([7, 8, 9], [4, 5, 6]):
        request = Request("same-id", [1, 2], SamplingParams(temperature=0.0, max_tokens=10))
        proposer.propose([request])  # tracked while it runs
        for token in output:
            request.append_output_token(token)
        request.status = RequestStatus.FINISHED_LENGTH
        proposer.propose([])  # gone from the running ones: its output is cached
    runs = {run for run, _ in _paths(proposer.shared.root)}
    assert (4, 5, 6) in runs and not any(7 in run for run in runs)


def _paths(node, prefix=()):
    """Every (run, count) under `node`."""
    for token, child in node.children.items():
        yield (*prefix, token), child.count
        yield from _paths(child, (*prefix, token))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    # Prompts that repeat themselves, so their n-grams recur.
    prompts = [p + p + p[:5] for p in make_prompts(1, [20, 30, 12, 17])]
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


def spec_llm(path: Path, **kwargs: object) -> LLM:
    llm = tiny_llm(path, speculative_config=NGRAM, **kwargs)
    assert llm.core.proposer is not None and not llm.core.async_scheduling
    return llm


def tokens_and_stats(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]):
    """Each request's output tokens and finish reason, and the speculation counters."""
    core = llm.core
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(Request(str(i), prompt, p))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    reasons: dict[str, str | None] = {}
    counts = [0, 0, 0]
    per_pos: list[int] = []
    while core.has_unfinished_requests():
        result = core.step()
        for o in result.outputs:
            out[o.request_id].extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        s = result.stats
        for j, v in enumerate((s.spec_num_drafts, s.spec_num_draft_tokens)):
            counts[j] += v
        counts[2] += s.spec_num_accepted_tokens
        per_pos.extend([0] * (len(s.spec_accepted_per_pos) - len(per_pos)))
        for j, v in enumerate(s.spec_accepted_per_pos):
            per_pos[j] += v
    assert core.scheduler.kv_cache.usage() == 0.0
    outputs = [(out[str(i)], reasons[str(i)]) for i in range(len(prompts))]
    return outputs, counts, per_pos


@pytest.mark.parametrize("mode", ["batched", "alone", "chunked", "prefix-hits", "preempted"])
def test_greedy_matches_transformers(model, mode: str) -> None:
    path, prompts, reference = model
    if mode == "preempted":
        llm = spec_llm(path, num_kv_blocks=9, max_model_len=128)
    else:
        llm = spec_llm(path, max_num_batched_tokens=16 if mode == "chunked" else None)
    counts = greedy_in_mode(llm, prompts, mode, reference)
    if counts is not None:
        drafts, drafted, accepted = counts
        assert 0 < accepted <= drafted and drafts > 0


def greedy_in_mode(
    llm: LLM, prompts: list[list[int]], mode: str, reference: list[list[int]]
) -> list[int] | None:
    """Runs `prompts` greedily as `mode` says (alone, twice for prefix hits, else in one
    batch), checks the outputs against `reference` (and that the mode happened), and
    returns a batch's speculation counters (see tokens_and_stats), None in other modes."""
    params = [GREEDY] * len(prompts)
    counts = None
    if mode == "alone":
        outputs = [tokens_and_stats(llm, [p], [GREEDY])[0][0] for p in prompts]
    elif mode == "prefix-hits":
        tokens_and_stats(llm, prompts, params)  # fills the cache
        outputs, *_ = tokens_and_stats(llm, prompts, params)
        assert llm.core.scheduler.kv_cache.counters.hits > 0
    else:
        outputs, counts, per_pos = tokens_and_stats(llm, prompts, params)
        assert sum(per_pos) == counts[2] and per_pos == sorted(per_pos, reverse=True)
    assert [tokens for tokens, _ in outputs] == reference
    if mode == "preempted":
        assert llm.core.scheduler.total_preemptions > 0
    return counts


def test_suffix_decoding_matches_transformers_and_drafts_from_other_requests(model) -> None:
    """Suffix decoding: greedy token for token, batched and preempted; a prompt that does
    not repeat itself gets drafts from an earlier request's output, through the shared
    trie, and none with that trie off."""
    path, prompts, reference = model
    suffix = {"method": "suffix", "num_speculative_tokens": 4}
    llm = tiny_llm(path, speculative_config=json.dumps(suffix))
    outputs, counts, _ = tokens_and_stats(llm, prompts, [GREEDY] * len(prompts))
    assert [tokens for tokens, _ in outputs] == reference and counts[2] > 0
    small = tiny_llm(
        path, speculative_config=json.dumps(suffix), num_kv_blocks=9, max_model_len=128
    )
    outputs, _, _ = tokens_and_stats(small, prompts, [GREEDY] * len(prompts))
    assert [tokens for tokens, _ in outputs] == reference
    assert small.core.scheduler.total_preemptions > 0

    fresh = make_prompts(9, [30])  # no repeats inside: its own trie proposes little
    expected = hf_greedy(path, fresh, MAX_TOKENS)
    accepted = []
    for cached in (10000, 0):
        config = dict(suffix, suffix_decoding_max_cached_requests=cached)
        llm = tiny_llm(path, speculative_config=json.dumps(config))
        first, *_ = tokens_and_stats(llm, fresh, [GREEDY])
        again, again_counts, _ = tokens_and_stats(llm, fresh, [GREEDY])
        assert first[0][0] == again[0][0] == expected[0]
        accepted.append(again_counts[2])
    assert accepted[0] >= MAX_TOKENS // 2 and accepted[1] < accepted[0]


def test_stops_inside_accepted_drafts(model) -> None:
    """A stop token, max_tokens or the model length reached inside a run of accepted
    drafts ends the output there, as in plain steps."""
    path, prompts, reference = model
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[reference[0][9]]),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[reference[2][13]]),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    ]
    plain, *_ = tokens_and_stats(tiny_llm(path, max_model_len=96), prompts, params)
    spec, counts, _ = tokens_and_stats(spec_llm(path, max_model_len=96), prompts, params)
    assert spec == plain and counts[2] > 0
    assert [reason for _, reason in spec] == ["stop", "length", "stop", "length"]
    assert len(prompts[1]) + len(spec[1][0]) == 96  # ended by the model length
    assert len(spec[3][0]) == 7


def test_logprobs_of_accepted_drafts(model) -> None:
    """A request with logprobs takes drafts, and gets an entry for every token, accepted
    draft or not: the chosen token's logprob, rank and the top alternatives of the raw
    distribution at its position, as without speculation."""
    path, prompts, _ = model
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True)

    def run(llm: LLM) -> list[list[tuple[int, float, int, list[int]]]]:
        return [
            [(lp.token_id, lp.logprob, lp.rank, [t for t, _ in lp.top]) for lp in c.logprobs]
            for c in (o.outputs[0] for o in llm.generate(prompts, params))
        ]

    plain, spec = run(tiny_llm(path)), run(spec_llm(path))
    assert [len(entries) for entries in spec] == [MAX_TOKENS] * len(prompts)
    for ours, theirs in zip(spec, plain, strict=True):
        assert [(t, r, top) for t, _, r, top in ours] == [(t, r, top) for t, _, r, top in theirs]
        assert [lp for _, lp, _, _ in ours] == pytest.approx(
            [lp for _, lp, _, _ in theirs], abs=1e-4
        )
    _, counts, _ = tokens_and_stats(spec_llm(path), prompts, [params] * len(prompts))
    assert counts[2] > 0  # drafts were accepted for them


def test_constrained_requests_verify_the_drafts_their_grammar_allows(tmp_path: Path) -> None:
    """A grammar cuts a request's drafts where it stops allowing them, masks each verified
    position by its state after the drafts before it, and advances through the accepted
    ones: the same valid text as without speculation, greedy and sampled, with drafts
    accepted (the output repeats itself, so n-grams find them)."""
    path = make_tiny_model("llama", tmp_path / "bytes", byte_level=True)
    schema = {
        "type": "array",
        "items": {"enum": ["abcd", "xy"]},
        "minItems": 6,
        "maxItems": 6,
    }
    constraint = StructuredOutputsParams(json=schema)
    greedy = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=constraint)
    sampled = SamplingParams(temperature=1.0, max_tokens=60, structured_outputs=constraint)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    options: dict[str, object] = dict(dtype="float32", num_kv_blocks=64, max_model_len=256)
    texts = []
    for spec_config in (None, NGRAM):
        llm = LLM(str(path), hooks=CHECKED, speculative_config=spec_config, **options)
        texts.append([o.outputs[0].text for o in llm.generate(prompts, greedy)])
        for text in [*texts[-1], *(o.outputs[0].text for o in llm.generate(prompts, sampled))]:
            value = json.loads(text)
            assert len(value) == 6 and set(value) <= {"abcd", "xy"}
    assert texts[0] == texts[1]
    llm = LLM(str(path), hooks=CHECKED, speculative_config=NGRAM, **options)
    _, counts, _ = tokens_and_stats(llm, prompts, [greedy] * len(prompts))
    assert counts[2] > 0


# Requests whose tokens depend on the output before them (penalties, min_tokens), biased or
# seeded: verification samples each position as a plain step would.
PER_POSITION = [
    SamplingParams(temperature=0.0, max_tokens=16, min_tokens=9),
    SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True),
    SamplingParams(
        temperature=0.0, max_tokens=16, frequency_penalty=0.5, presence_penalty=0.3, min_tokens=9
    ),
    SamplingParams(temperature=0.7, top_k=5, seed=11, max_tokens=16, logit_bias={7: 3.0}),
]


def test_penalised_biased_and_seeded_requests_give_the_plain_engines_tokens(model) -> None:
    """Penalties, min_tokens, a logit bias and seeds take drafts, and verification makes
    exactly the tokens of the plain engine (the seeded ones too: each position draws its
    output index's noise), with drafts accepted."""
    path, prompts, _ = model

    def run(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, PER_POSITION)]

    assert run(spec_llm(path)) == run(tiny_llm(path))
    _, counts, _ = tokens_and_stats(spec_llm(path), prompts, PER_POSITION)
    assert counts[2] > 0


def test_logprobs_with_penalties_are_the_raw_distributions(model) -> None:
    """A penalised request with logprobs takes drafts and reports each token's logprob of
    the raw distribution, as a plain step does."""
    path, prompts, _ = model
    params = SamplingParams(
        temperature=0.0, max_tokens=12, logprobs=2, repetition_penalty=1.3, ignore_eos=True
    )

    def run(llm: LLM) -> list:
        outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return [(c.token_ids, [lp.logprob for lp in c.logprobs or []]) for c in outputs]

    plain, spec = run(tiny_llm(path)), run(spec_llm(path))
    assert [t for t, _ in spec] == [t for t, _ in plain]
    for (_, ours), (_, theirs) in zip(spec, plain, strict=True):
        assert ours == pytest.approx(theirs, abs=1e-5) and len(ours) == 12


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.3, top_k=6),
        SamplingParams(temperature=1.0, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.1),
    ],
    ids=["temperature", "top_k", "top_p", "min_p"],
)
def test_rejection_sampling_keeps_the_distribution(params: SamplingParams) -> None:
    """Over 12000 verifications of two drafts (the first a likely token, the second not):
    the first output token is distributed as the filtered softmax at the first position,
    and the second, after an accepted first draft, as the one at the second position."""
    torch.manual_seed(0)
    vocab = 40
    logits = torch.randn(3, vocab) * 2
    sampler = Sampler(vocab)
    row = SamplingRow(params, [1, 2], [], ())
    probs = sampler.probabilities(logits, [row] * 3)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    drafts = [int(probs[0].argmax()), int(probs[1].argmin())]
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    draws = 12000
    for _ in range(draws):
        accepted, token = sampler.verify(logits, row, drafts)
        tokens = [*accepted, token]
        first[tokens[0]] += 1
        if tokens[0] == drafts[0]:
            second[tokens[1]] += 1
    assert (first / draws - probs[0]).abs().max() < 0.015
    assert (second / second.sum() - probs[1]).abs().max() < 0.02
    assert second[drafts[1]] / second.sum() == pytest.approx(probs[1, drafts[1]].item(), abs=0.01)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=1.0),
        SamplingParams(temperature=0.0, repetition_penalty=3.0),
        SamplingParams(temperature=0.0, min_tokens=3, logit_bias={4: 1.5}),
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=0.9, top_p=0.8, seed=3, presence_penalty=1.5),
    ],
    ids=["frequency", "repetition", "min_tokens", "seed", "seed-penalised"],
)
def test_per_position_verification_is_the_plain_steps_sampling(params: SamplingParams) -> None:
    """A processed or seeded row verifies as plain steps would sample, one after another,
    each seeing the tokens before it (penalties, min_tokens) and its own output index (the
    seed's noise): drafts equal to those tokens are all accepted, and a wrong one stops
    acceptance there with the plain step's token."""
    torch.manual_seed(0)
    vocab, num = 24, 4
    logits = torch.randn(num + 1, vocab)
    logits[:, 9] += 4.0  # a likely token, which the penalties push down once it is out
    sampler = Sampler(vocab)
    stops = (2,)  # the stop token, masked below min_tokens
    logits[:, 2] += 6.0
    outputs: list[int] = [5]
    plain: list[int] = []
    for i in range(num + 1):
        row = SamplingRow(params, [1, 9], [*outputs, *plain], stops)
        plain.append(int(sampler.sample(logits[i : i + 1], [row])[0]))
    row = SamplingRow(params, [1, 9], outputs, stops)
    assert sampler.verify(logits, row, plain[:num]) == (plain[:num], plain[num])
    wrong = (plain[2] + 1) % vocab
    drafts = [*plain[:2], wrong, *plain[3:num]]
    accepted, token = sampler.verify(logits, row, drafts)
    assert accepted == plain[:2]
    if params.seed is not None or params.greedy:
        assert token == plain[2]  # the plain step's own draw at that index


def test_refused_where_it_cannot_run(model) -> None:
    path = str(model[0])
    with pytest.raises(ValueError, match="async-scheduling"):
        LLM(path, dtype="float32", speculative_config=NGRAM, async_scheduling=True)
    with pytest.raises(ValueError, match="tensor-parallel"):
        LLM(path, dtype="float32", speculative_config=NGRAM, tensor_parallel_size=2)
