"""Sampler: seeds, filters, penalties, logprobs and finish reasons."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine import LLM, EngineHooks, SamplingParams
from engine.worker.sampler import (
    Sampler,
    SamplingRow,
    _top_k_top_p_drop,
    argmax_rows,
    filter_top_k_top_p,
    logprob_tensors,
)
from tests.isas import CPU_LACKS
from tests.tiny_models import make_tiny_model


def row(params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None):
    return SamplingRow(params, prompt or [0], output or [], ())


def empirical(logits: list[float], params: SamplingParams, n: int = 40000) -> torch.Tensor:
    torch.manual_seed(0)
    batch = torch.tensor([logits] * n)
    tokens = Sampler(len(logits))(batch, [row(params)] * n).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=len(logits)).double() / n


def assert_close_dist(observed: torch.Tensor, expected: list[float]) -> None:
    expected_t = torch.tensor(expected, dtype=torch.float64)
    diff = (observed - expected_t).abs().max().item()
    print(f"observed {observed.tolist()} expected {expected} max diff {diff:.4f}")
    assert diff < 0.012


LOGITS = [2.0, 1.0, 0.5, 0.0, -1.0]


def softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


def test_temperature_sampling_matches_softmax() -> None:
    for temperature in (0.5, 1.0, 2.0):
        expected = softmax([x / temperature for x in LOGITS])
        assert_close_dist(empirical(LOGITS, SamplingParams(temperature=temperature)), expected)


def test_top_p_keeps_the_nucleus() -> None:
    p = softmax(LOGITS)  # ~[0.55, 0.20, 0.12, 0.07, 0.03]
    # top_p=0.7: the first two tokens hold 0.75 >= 0.7, so only they survive.
    kept = [p[0], p[1], 0, 0, 0]
    expected = [v / sum(kept) for v in kept]
    assert_close_dist(empirical(LOGITS, SamplingParams(top_p=0.7)), expected)


def test_top_k_and_min_p() -> None:
    p = softmax(LOGITS)
    kept = [p[0], p[1], p[2], 0, 0]
    assert_close_dist(empirical(LOGITS, SamplingParams(top_k=3)), [v / sum(kept) for v in kept])
    # min_p=0.2 keeps tokens with p >= 0.2 * p_max ~ 0.11: the first three.
    assert_close_dist(empirical(LOGITS, SamplingParams(min_p=0.2)), [v / sum(kept) for v in kept])


def test_penalties_and_logit_bias_by_hand() -> None:
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.4, 3.0]])
    params = SamplingParams(
        temperature=0.0,
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logit_bias={4: -10.0},
    )
    r = SamplingRow(params, prompt_token_ids=[0], output_token_ids=[1, 1, 2], stop_token_ids=())
    processed = Sampler(5)._process(logits.clone(), [r])
    expected = [
        1.0 / 2.0,  # in the prompt: positive logit divided by the repetition penalty
        -1.0 * 2.0 - 0.5 * 2 - 0.25,  # twice in the output: negative logit multiplied
        2.0 / 2.0 - 0.5 * 1 - 0.25,
        0.4,
        3.0 - 10.0,  # bias only
    ]
    assert processed[0].tolist() == pytest.approx(expected)
    # Greedy picks the argmax of the processed logits.
    assert Sampler(5)(logits, [r]).token_ids == [0]


def test_min_tokens_masks_stop_tokens() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2)
    early = SamplingRow(params, [0], [2], stop_token_ids=(1,))
    late = SamplingRow(params, [0], [2, 2], stop_token_ids=(1,))
    assert Sampler(3)(logits, [early]).token_ids == [2]
    assert Sampler(3)(logits, [late]).token_ids == [1]


def test_logprobs_are_raw_log_softmax_with_rank() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = Sampler(4)(logits, [row(SamplingParams(temperature=0.0, logprobs=2))])
    reference = torch.log_softmax(logits, dim=-1)[0]
    lp = out.logprobs[0]
    assert lp is not None and lp.token_id == 1 and lp.rank == 1
    assert lp.logprob == pytest.approx(reference[1].item())
    assert [t for t, _ in lp.top] == [1, 2]
    assert [v for _, v in lp.top] == pytest.approx([reference[1].item(), reference[2].item()])


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, Path]:
    path = make_tiny_model("llama", tmp_path_factory.mktemp("sampling"))
    llm = LLM(
        str(path),
        hooks=EngineHooks(check_invariants=True),
        dtype="float32",
        num_kv_blocks=256,
        max_model_len=256,
    )
    return llm, path


PROMPTS = [[5 + (i * 13 + j * 7) % 240 for j in range(6 + 3 * i)] for i in range(8)]


def test_seed_gives_same_tokens_alone_and_in_a_batch(tiny_llm: tuple[LLM, Path]) -> None:
    llm, _ = tiny_llm
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[3]], seeded)[0].outputs[0].token_ids
    params = [unseeded] * 8
    params[3] = seeded
    batched = llm.generate(PROMPTS, params)[3].outputs[0].token_ids
    assert alone == batched
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True)
    assert llm.generate([PROMPTS[3]], other_seed)[0].outputs[0].token_ids != alone


def test_n_samples_differ_but_are_reproducible(tiny_llm: tuple[LLM, Path]) -> None:
    llm, _ = tiny_llm
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    first = [c.token_ids for c in llm.generate([PROMPTS[0]], params)[0].outputs]
    again = [c.token_ids for c in llm.generate([PROMPTS[0]], params)[0].outputs]
    assert first == again
    assert len({tuple(t) for t in first}) == 3


def test_top_k_1_equals_greedy(tiny_llm: tuple[LLM, Path]) -> None:
    llm, _ = tiny_llm
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    top1 = SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)] == [
        o.outputs[0].token_ids for o in llm.generate(PROMPTS, top1)
    ]


def test_engine_logprobs_match_transformers(tiny_llm: tuple[LLM, Path]) -> None:
    from transformers import AutoModelForCausalLM

    llm, path = tiny_llm
    params = SamplingParams(temperature=0.8, seed=3, logprobs=3, max_tokens=6, ignore_eos=True)
    out = llm.generate([PROMPTS[2]], params)[0].outputs[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([PROMPTS[2] + out.token_ids])
    with torch.no_grad():
        reference = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    assert out.logprobs is not None
    start = len(PROMPTS[2]) - 1
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        ref = reference[start + i]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(ref[token].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()
        assert lp.rank == int((ref > ref[token]).sum()) + 1


def test_prompt_logprobs_match_transformers(tiny_llm: tuple[LLM, Path]) -> None:
    from transformers import AutoModelForCausalLM

    llm, path = tiny_llm
    prompt = PROMPTS[7]
    params = SamplingParams(temperature=0.0, prompt_logprobs=1, max_tokens=1)
    result = llm.generate([prompt], params)[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert result.prompt_logprobs is not None and len(result.prompt_logprobs) == len(prompt) - 1
    for j, lp in enumerate(result.prompt_logprobs):
        assert lp.token_id == prompt[j + 1]
        assert lp.logprob == pytest.approx(reference[j, prompt[j + 1]].item(), abs=1e-4)


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(max_num_batched_tokens=16, num_kv_blocks=256, max_model_len=256),
        dict(max_num_batched_tokens=16, num_kv_blocks=12, max_model_len=128),
    ],
    ids=["chunked", "chunked-and-preempted"],
)
def test_prompt_logprobs_across_chunks_and_preemption(
    tiny_llm: tuple[LLM, Path], engine_args: dict
) -> None:
    """Every prompt position once, equal to transformers, when the prompt is prefilled in
    16-token chunks and when a request is preempted and recomputed."""
    from transformers import AutoModelForCausalLM

    _, path = tiny_llm
    prompts = [[3 + (i * 31 + j * 17) % 250 for j in range(40 + 9 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, prompt_logprobs=2, max_tokens=8, ignore_eos=True)
    llm = LLM(str(path), hooks=EngineHooks(check_invariants=True), dtype="float32", **engine_args)
    results = llm.generate(prompts, params)
    if engine_args["num_kv_blocks"] < 20:
        assert llm.core.scheduler.total_preemptions > 0
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for prompt, result in zip(prompts, results, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0].float()
        reference = torch.log_softmax(logits, dim=-1)
        assert result.prompt_logprobs is not None
        assert [lp.token_id for lp in result.prompt_logprobs] == prompt[1:]
        for j, lp in enumerate(result.prompt_logprobs):
            assert lp.logprob == pytest.approx(reference[j, prompt[j + 1]].item(), abs=1e-4)
            assert [t for t, _ in lp.top] == reference[j].topk(2).indices.tolist()


def test_finish_reasons(tiny_llm: tuple[LLM, Path]) -> None:
    llm, _ = tiny_llm
    eos = llm.config.model.arch.eos_token_ids[0]
    cases = [
        (SamplingParams(temperature=0.0, max_tokens=10, logit_bias={eos: 100.0}), "stop", None, 1),
        (
            SamplingParams(
                temperature=0.0, max_tokens=10, stop_token_ids=[77], logit_bias={77: 100.0}
            ),
            "stop",
            77,
            1,
        ),
        (SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), "length", None, 4),
        (
            SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3, logit_bias={eos: 100.0}),
            "stop",
            None,
            4,
        ),
    ]
    for params, reason, stop_reason, length in cases:
        out = llm.generate([PROMPTS[0]], params)[0].outputs[0]
        assert (out.finish_reason, out.stop_reason, len(out.token_ids)) == (
            reason,
            stop_reason,
            length,
        )


def test_masked_tokens_are_never_drawn_and_rare_ones_are() -> None:
    """A token outside top_k is never drawn, wherever it sits (first, last, between the
    kept ones), and a token of probability 1/100 in a 49k vocabulary is drawn about as
    often as it should be."""
    torch.manual_seed(1)
    vocab = 4096
    logits = torch.full((vocab,), -30.0)
    logits[[1, 7, vocab - 2]] = torch.tensor([3.0, 3.0, 2.5])
    logits[[0, 5, vocab - 1]] = 2.4  # just below the third kept one: dropped by top_k=3
    rows = [row(SamplingParams(top_k=3))] * 4000
    drawn = Sampler(vocab)(logits.expand(len(rows), vocab), rows).token_ids
    assert set(drawn) == {1, 7, vocab - 2}

    vocab, batches, batch = 49152, 5, 1000
    rare = torch.zeros(vocab)
    rare[4] = math.log(vocab)  # about half the mass; the rest spread almost evenly
    rare[3] = math.log(2 * vocab / 100)  # about 1/100
    probs = torch.softmax(rare, dim=0)
    rows = [row(SamplingParams())] * batch
    drawn = [
        t for _ in range(batches) for t in Sampler(vocab)(rare.expand(batch, vocab), rows).token_ids
    ]
    counts = torch.bincount(torch.tensor(drawn), minlength=vocab).double() / len(drawn)
    for token in (3, 4):
        expected = probs[token].item()
        sigma = math.sqrt(expected * (1 - expected) / len(drawn))
        print(f"token {token}: drawn {counts[token].item():.5f}, p {expected:.5f}")
        assert abs(counts[token].item() - expected) < 5 * sigma


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, logit_bias={2: 5.0, 3: -100.0}),
        SamplingParams(temperature=1.0, min_tokens=4, logprobs=3),
    ],
    ids=lambda p: ",".join(
        f"{k}={v}"
        for k, v in vars(p).items()
        if v not in (None, 1, 1.0, 0, 0.0, (), True, False) and k != "output_kind"
    ),
)
def test_every_tensor_lives_on_the_logits_device(params: SamplingParams) -> None:
    """On the meta device, mixing in a CPU tensor raises: every sampling feature, and the
    logprobs gathering, must build its tensors where the logits are (CUDA in production)."""
    rows = [
        SamplingRow(params, [1, 2, 3], [2, 2, 4], (0, 5)),
        SamplingRow(SamplingParams(temperature=0.0), [1], [], (0,)),
    ]
    logits = torch.empty(2, 50, device="meta")
    sampler = Sampler(50)
    tokens = sampler.sample(logits, rows)
    assert tokens.device.type == "meta" and tokens.shape == (2,)
    tensors = logprob_tensors(torch.log_softmax(logits, -1), tokens, [3, None])
    for tensor in (tensors.chosen, tensors.ranks, tensors.top_values, tensors.top_ids):
        assert tensor is not None and tensor.device.type == "meta"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_argmax_rows_is_torchs_argmax(dtype: torch.dtype) -> None:
    """Ties and NaNs pick the first, as torch's argmax does, also on a strided slice (the
    sampler cuts padded vocab rows to the real vocabulary)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 50, (9, 1000), generator=gen).to(dtype)  # many ties
    x[3, [10, 500, 700]] = float("nan")
    x[5] = float("-inf")
    x[6, 999] = float("inf")
    view = x[:, :997]
    assert not view.is_contiguous()
    for rows in (x, view, x[:1]):
        got = argmax_rows(rows)
        assert got.dtype == torch.int64 and torch.equal(got, rows.argmax(dim=-1))
    assert argmax_rows(x)[3] == 10


def test_greedy_rows_skip_the_logits_where_the_bf16_head_gives_tokens(tmp_path: Path) -> None:
    """In bfloat16 with the native head kernel, a step whose rows are all plain greedy takes
    its tokens from the head's own argmax (DecoderModel.greedy_tokens): no logits. A row
    that needs them (logprobs, logit_bias, sampling) sends its step through compute_logits,
    and greedy rows there get the same tokens as without them."""
    from engine.models.layers import TILED_BF16_ISAS
    from engine.ops.loader import native_kernels

    if native_kernels().isa not in TILED_BF16_ISAS:
        pytest.skip(CPU_LACKS + "a bfloat16 tile kernel's instruction set (AVX2, AVX512_BF16)")
    path = make_tiny_model("llama", tmp_path / "m", vocab_size=300)
    llm = LLM(model=str(path), dtype="bfloat16", num_kv_blocks=64, max_model_len=128)
    model = llm.core.runner.model
    assert model.dense_head is not None and model.dense_head.tiled is not None
    calls = []
    compute_logits = model.compute_logits
    model.compute_logits = lambda hidden: calls.append(len(hidden)) or compute_logits(hidden)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17], [30, 31]]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert calls == []
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    mixed = llm.generate(prompts, [greedy, with_logprobs, greedy, greedy])
    assert calls and max(calls) == 4  # every step of the batch went through the logits
    assert [o.outputs[0].token_ids for o in mixed] == plain
    calls.clear()
    biased = SamplingParams(temperature=0.0, max_tokens=1, logit_bias={299: 100.0})
    assert llm.generate(prompts[:1], biased)[0].outputs[0].token_ids == [299]
    assert calls == [1]  # a raised logit may overtake any other: the logits


def test_a_lowered_token_is_recomputed_only_where_it_was_the_argmax(tmp_path: Path) -> None:
    """logit_bias of at most 0 (and min_tokens' masked stop tokens) only lower logits: the
    head's argmax stands unless it is a lowered token, and then that row alone is
    computed with its logits."""
    from engine.models.layers import TILED_BF16_ISAS
    from engine.ops.loader import native_kernels

    if native_kernels().isa not in TILED_BF16_ISAS:
        pytest.skip(CPU_LACKS + "a bfloat16 tile kernel's instruction set (AVX2, AVX512_BF16)")
    path = make_tiny_model("llama", tmp_path / "m", vocab_size=300)
    llm = LLM(model=str(path), dtype="bfloat16", num_kv_blocks=64, max_model_len=128)
    model = llm.core.runner.model
    calls = []
    compute_logits = model.compute_logits
    model.compute_logits = lambda hidden: calls.append(len(hidden)) or compute_logits(hidden)
    prompts = [[5, 6, 7, 8], [9, 10]]
    first = SamplingParams(temperature=0.0, max_tokens=1)
    plain = [o.outputs[0].token_ids[0] for o in llm.generate(prompts, first)]
    other = next(t for t in range(3, 300) if t not in plain)

    def run(bias: dict[int, float]) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=1, logit_bias=bias)
        return [o.outputs[0].token_ids[0] for o in llm.generate(prompts, [params, first])]

    calls.clear()
    assert run({other: -100.0, plain[1]: -100.0}) == plain  # row 1's bias is not its own
    assert calls == []
    banned = run({plain[0]: -100.0})
    assert banned[0] != plain[0] and banned[1] == plain[1]
    assert calls == [1]  # row 0 alone
    # The same ban through the logits of the whole step (a logprobs row beside it).
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0)
    banned_params = SamplingParams(temperature=0.0, max_tokens=1, logit_bias={plain[0]: -100.0})
    full = llm.generate(prompts, [banned_params, with_logprobs])
    assert [o.outputs[0].token_ids[0] for o in full] == banned


@pytest.mark.parametrize("spread", [0.05, 1.0, 30.0])  # flat (a wide nucleus) to peaked
def test_the_candidates_keep_what_a_whole_sort_keeps(spread: float) -> None:
    """On the CPU top-k and top-p read each row's largest logits first, and sort a row's
    values only where its nucleus reaches past them: the tokens kept are those a sort of
    the whole vocabulary with indices keeps, and the candidates returned hold them all."""
    vocab = 20000
    g = torch.Generator().manual_seed(int(spread * 100))
    # Distinct values: a tie at the nucleus' edge may fall either way in either order.
    logits = torch.stack([torch.randperm(vocab, generator=g) for _ in range(6)]).float()
    logits = logits * (spread / vocab) * 10
    params = [
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.999),
        SamplingParams(top_k=40),
        SamplingParams(top_k=1000, top_p=0.95),
        SamplingParams(top_k=5000),
        SamplingParams(top_p=0.5),
    ]
    rows = [row(p) for p in params]
    k_values = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    expected = logits.masked_fill(
        _top_k_top_p_drop(logits, k_values, [p.top_p for p in params]), float("-inf")
    )
    filtered, support = filter_top_k_top_p(logits, rows)
    # The two sum the probabilities in different orders: a token whose mass before it lies
    # within float32's rounding of its row's top_p may fall either way (one did, on an
    # AVX2 CPU). Nowhere else may they differ.
    edge = nucleus_edge(logits, k_values, [p.top_p for p in params])
    assert int(edge.sum()) <= 2 * len(params)
    assert torch.equal(filtered.masked_fill(edge, 0.0), expected.masked_fill(edge, 0.0))
    # Candidates come back where every nucleus fitted them (the peaked rows' do).
    assert (support is not None) == (spread == 30.0)
    if support is not None:
        kept = torch.isfinite(filtered)
        held = torch.zeros_like(kept).scatter_(1, support, True)
        assert bool((held | ~kept).all())
    # One unfiltered row: no candidates, and that row untouched.
    mixed, none = filter_top_k_top_p(logits[:2], [rows[0], row(SamplingParams())])
    assert none is None and torch.equal(mixed[1], logits[1])
    assert torch.equal(mixed[0], expected[0])


def test_greedy_rows_keep_a_filtered_batch_on_the_candidates() -> None:
    """Beside top-k / top-p rows, a greedy row races over its top token alone (its draw is
    discarded for its argmax anyway), so the batch keeps its candidates; a row that filters
    nothing sends the batch over the whole vocabulary. Tokens: each greedy row its argmax,
    a seeded top-k row the same token alone as batched."""
    vocab = 5000
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, vocab, generator=g) * 4
    greedy, top_k = SamplingParams(temperature=0.0), SamplingParams(top_k=20, seed=17)
    rows = [row(greedy), row(top_k), row(greedy)]
    assert filter_top_k_top_p(logits, rows)[1] is None
    assert filter_top_k_top_p(logits, rows, greedy_top1=True)[1] is not None
    unfiltered = [row(greedy), row(top_k), row(SamplingParams(temperature=0.9))]
    assert filter_top_k_top_p(logits, unfiltered, greedy_top1=True)[1] is None
    sampler = Sampler(vocab)
    tokens = sampler.sample(logits, rows).tolist()
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    assert tokens[1] in logits[1].topk(20).indices.tolist()
    assert sampler.sample(logits[1:2], [row(top_k)]).tolist() == [tokens[1]]


def nucleus_edge(logits: torch.Tensor, k_values: list[int], p_values: list[float]) -> torch.Tensor:
    """The tokens whose mass before them, summed in float64, lies within 1e-6 of their
    row's top_p (rows with top_p < 1 only)."""
    ordered, order = logits.double().sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1])[None, :]
    probs = torch.softmax(ordered.masked_fill(ranks >= torch.tensor(k_values)[:, None], -1e300), -1)
    before = probs.cumsum(dim=-1) - probs
    top_p = torch.tensor([p if p < 1.0 else float("inf") for p in p_values], dtype=torch.float64)
    edge = (before - top_p[:, None]).abs() <= 1e-6
    return torch.zeros_like(edge).scatter_(1, order, edge)


def test_top_k_alone_beside_top_p_keeps_its_k_tokens() -> None:
    """A peaked row whose float32 running sum reaches 1 after its first token, with top_k
    and no top_p, batched beside a row with top_p: it keeps its k tokens, on the CPU's
    candidates and in the whole sort the other devices run (which had read its top_p of 1
    as a threshold the running sum reached, and kept 1)."""
    vocab = 1000
    logits = torch.zeros(2, vocab)
    logits[:, 0] = 30.0  # exp(-30) per other token: the sum after it rounds to 1
    logits[:, 1:] = torch.linspace(0, -1, vocab - 1)
    params = [SamplingParams(top_k=100), SamplingParams(top_p=0.5)]
    filtered, _ = filter_top_k_top_p(logits, [row(p) for p in params])
    assert filtered[0].isfinite().sum() == 100 and filtered[1].isfinite().sum() == 1
    drop = _top_k_top_p_drop(logits, [100, vocab], [1.0, 0.5])
    assert (~drop[0]).sum() == 100 and (~drop[1]).sum() == 1
