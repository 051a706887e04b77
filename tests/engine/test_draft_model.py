"""Speculative decoding with a draft model ({"method": "draft_model", "model": path}).

The draft runs over every step's tokens into its own paged KV cache (the target's block
tables), then proposes greedily. Greedy output equals transformers token for token in
float32 batched, alone, chunked, from the prefix cache and after preemption, with a draft
that agrees with the target only in part. A draft identical to the target has every draft
accepted, which holds only if its KV cache is right in each of those modes (prefix hits
included: those blocks were written by another request's step). Penalised and seeded
requests make the plain engine's tokens, and a draft model that cannot serve beside the
target is refused with its reason.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.spec_decode import SpeculativeConfig, parse_speculative_config
from tests.engine.test_correctness import hf_greedy, make_prompts, tiny_llm
from tests.engine.test_spec_decode import GREEDY, MAX_TOKENS, greedy_in_mode, tokens_and_stats
from tests.tiny_models import make_tiny_model


def draft_spec(draft: Path, k: int = 3, **extra: object) -> str:
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
    return json.dumps(config | extra)


def perturbed_copy(source: Path, dest: Path, scale: float, seed: int = 1) -> Path:
    """`source`'s model with noise of `scale` times each matrix's deviation added: a draft
    whose greedy tokens agree with the target's often, not always."""
    shutil.copytree(source, dest)
    generator = torch.Generator().manual_seed(seed)
    for file in dest.glob("*.safetensors"):
        tensors = load_file(file)
        for name, value in tensors.items():
            if value.dim() == 2:
                noise = torch.randn(value.shape, generator=generator)
                tensors[name] = value + scale * value.std() * noise
        save_file(tensors, file, metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_model("llama", root / "target")
    draft = perturbed_copy(target, root / "draft", 0.06)
    prompts = make_prompts(1, [20, 30, 12, 17])
    return target, draft, prompts, hf_greedy(target, prompts, MAX_TOKENS)


def test_parses_vllms_spelling() -> None:
    assert parse_speculative_config(draft_spec(Path("/m"), 4)) == SpeculativeConfig(
        "draft_model", 4, draft_model="/m"
    )
    parsed = parse_speculative_config(draft_spec(Path("/m"), 2, quantization="int8"))
    assert parsed is not None and parsed.draft_quantization == "int8"
    for text, message in [
        ('{"method": "draft_model", "num_speculative_tokens": 3}', 'needs "model"'),
        (draft_spec(Path("/m"), draft_tensor_parallel_size=2), "unsupported keys"),
        (draft_spec(Path("/m"), quantization="fp8"), "not one of"),
        (draft_spec(Path("/m"), 0), "1-16"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_speculative_config(text)


@pytest.mark.parametrize("mode", ["batched", "alone", "chunked", "prefix-hits", "preempted"])
def test_greedy_matches_transformers(models, mode: str) -> None:
    target, draft, prompts, reference = models
    options: dict[str, object] = {"speculative_config": draft_spec(draft)}
    if mode == "preempted":
        options.update(num_kv_blocks=9, max_model_len=128)
    if mode == "chunked":
        options.update(max_num_batched_tokens=16)
    llm = tiny_llm(target, **options)
    counts = greedy_in_mode(llm, prompts, mode, reference)
    if counts is not None:  # the draft agrees in part: some drafts accepted, some rejected
        drafts, drafted, accepted = counts
        assert drafts > 0 and 0 < accepted < drafted


def test_a_draft_equal_to_the_target_has_every_draft_accepted(models) -> None:
    """The target as its own draft proposes exactly the target's greedy tokens, provided
    the draft's KV cache holds the right keys and values: in a batch, in chunks, for
    prefix-cache hits (blocks another request's step wrote) and after preemption."""
    target, _, prompts, reference = models
    params = [GREEDY] * len(prompts)
    for options in (
        {"max_num_batched_tokens": 16},
        {"num_kv_blocks": 9, "max_model_len": 128},
    ):
        llm = tiny_llm(target, speculative_config=draft_spec(target, 4), **options)
        runs = [tokens_and_stats(llm, prompts, params) for _ in range(2)]  # the second hits
        for outputs, (drafts, drafted, accepted), _ in runs:
            assert [tokens for tokens, _ in outputs] == reference
            assert drafts > 0 and accepted == drafted
        if "num_kv_blocks" in options:
            assert llm.core.scheduler.total_preemptions > 0
        else:
            assert llm.core.scheduler.kv_cache.counters.hits > 0


def test_penalised_and_seeded_requests_give_the_plain_engines_tokens(models) -> None:
    """Requests with logprobs, penalties or a seed take the draft model's drafts beside a
    sampled one: the deterministic outputs (the seeded one too) are the plain engine's, and
    the sampled one runs to its length."""
    target, draft, prompts, _ = models
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.4, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True),
    ]

    def run(llm: LLM) -> list:
        outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return [(c.token_ids, [lp.logprob for lp in c.logprobs or []]) for c in outputs]

    plain, spec = run(tiny_llm(target)), run(tiny_llm(target, speculative_config=draft_spec(draft)))
    assert [t for t, _ in spec[:3]] == [t for t, _ in plain[:3]]
    assert spec[0][1] == pytest.approx(plain[0][1], abs=1e-5) and len(spec[0][1]) == 12
    assert len(spec[3][0]) == 12


def test_refuses_a_draft_that_cannot_serve_beside_the_target(models, tmp_path: Path) -> None:
    target = str(models[0])
    other_tokenizer = make_tiny_model("llama", tmp_path / "bytes", byte_level=True)
    short = make_tiny_model("llama", tmp_path / "short", max_position_embeddings=64)
    windowed = make_tiny_model("mistral-swa", tmp_path / "swa")
    options: dict[str, object] = dict(dtype="float32", num_kv_blocks=64, max_model_len=128)
    for model, draft, message in [
        (target, other_tokenizer, "another tokenizer"),
        (target, short, "holds 64 tokens, fewer than max_model_len=128"),
        (str(windowed), windowed, "sliding-window"),
        (target, tmp_path / "missing", "missing"),
    ]:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            LLM(model, speculative_config=draft_spec(draft), **options)
    with pytest.raises(ValueError, match="needs a GGUF file"):
        LLM(target, speculative_config=draft_spec(Path(target), quantization="gguf"), **options)
