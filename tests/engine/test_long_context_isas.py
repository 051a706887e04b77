"""Long contexts through the whole engine on every instruction set of the native kernels
(`cpu_isa`), against transformers in float32.

Prompts of 600 to 3,000 tokens run batched, two of them on a shared 900-token prefix
(prefix-cache hits, and the kernels' shared-prefix pass), in prefill chunks of 512, with
long decodes split into parts; then once more with a KV cache too small for all of them
(preemption). The model has SmolLM2's attention shape (head_dim 64, 3 query heads per KV
head). float32 must give transformers' greedy tokens exactly. bfloat16 is checked teacher
forced: at every step, the engine's token must be within a small margin of the best logit
of transformers' float32 forward over the same tokens, which bf16 rounding passes and a
wrong attention does not (the test checks that the margin tells them apart).

A set this CPU cannot run is reported as skipped (tests/isas.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, EngineHooks, SamplingParams
from tests.engine.test_correctness import hf_greedy, make_prompts
from tests.isas import isa_params
from tests.tiny_models import make_tiny_model

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Logit margin for bfloat16 against float32: bf16 noise in this model stays well below it.
BF16_MARGIN = 0.5
CHECKED = EngineHooks(check_invariants=True)


@pytest.fixture(scope="module")
def long_case(tmp_path_factory: pytest.TempPathFactory):
    path = make_tiny_model(
        "llama", tmp_path_factory.mktemp("long"), seed=3, max_position_embeddings=4096,
        hidden_size=384, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
        intermediate_size=256, initializer_range=0.05,
    )  # fmt: skip
    alone = make_prompts(11, [600, 1100, 3000])
    prefix = make_prompts(12, [900])[0]
    shared = [prefix + tail for tail in make_prompts(13, [20, 45])]
    prompts = alone + shared
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


def long_llm(path: Path, isa: str, dtype: str, **kwargs: object) -> LLM:
    # Chunks of the whole budget (no --long-prefill-token-threshold): several long prompts
    # prefill at once, which the small cache's preemptions need.
    options: dict[str, object] = dict(
        dtype=dtype, device="cpu", cpu_isa=isa, block_size=16, num_kv_blocks=600,
        max_model_len=4096, max_num_batched_tokens=512, long_prefill_token_threshold=0,
        attention_backend="cpu-native",
    )  # fmt: skip
    options.update(kwargs)
    return LLM(str(path), hooks=CHECKED, **options)


def tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("isa", isa_params())
def test_float32_long_contexts_match_transformers(long_case, isa: str) -> None:
    path, prompts, reference = long_case
    llm = long_llm(path, isa, "float32")
    assert tokens(llm, prompts) == reference
    assert llm.core.scheduler.kv_cache.counters.hits > 0
    # 250 blocks hold any one request (the longest needs 189) but not all five at once.
    small = long_llm(path, isa, "float32", num_kv_blocks=250, max_model_len=3072)
    assert tokens(small, prompts) == reference
    assert small.core.scheduler.total_preemptions > 0


def worst_margins(path: Path, prompts: list[list[int]], outputs: list[list[int]]) -> list[float]:
    """Per request, the largest gap between the best float32 logit and the logit of the
    token the engine chose, over its generated tokens (teacher forced)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    margins = []
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs, strict=True):
            logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
            chosen = logits.gather(1, torch.tensor(out)[:, None])[:, 0]
            margins.append((logits.max(dim=1).values - chosen).max().item())
    return margins


@pytest.mark.parametrize("isa", isa_params())
def test_bfloat16_long_contexts_stay_within_a_margin_of_transformers(long_case, isa) -> None:
    path, prompts, reference = long_case
    outputs = tokens(long_llm(path, isa, "bfloat16"), prompts)
    margins = worst_margins(path, prompts, outputs)
    print(f"{isa}: worst bf16 margins {[round(m, 3) for m in margins]}")
    assert max(margins) < BF16_MARGIN
    # The margin tells a wrong attention apart: each request's tokens, scored against
    # another request's context, miss it.
    swapped = worst_margins(path, prompts, reference[1:] + reference[:1])
    assert min(swapped) > BF16_MARGIN, swapped
