"""LLM.generate's prompt forms, as vLLM's: text, token ids, and TextPrompt / TokensPrompt
dicts, alone or in a list; a dict with anything else is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = make_tiny_model("llama", tmp_path_factory.mktemp("prompts"))
    return LLM(model=str(Path(path)), dtype="float32", num_kv_blocks=64, max_model_len=128)


def test_dict_prompts_equal_their_plain_forms(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ids = llm.tokenizer.encode("t10 t11 t12")

    def tokens(prompts: object) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]  # type: ignore[arg-type]

    plain = tokens(["t10 t11 t12", ids])
    assert plain[0] == plain[1]
    assert tokens([{"prompt": "t10 t11 t12"}, {"prompt_token_ids": ids}]) == plain
    assert tokens({"prompt_token_ids": ids}) == plain[:1]
    assert tokens({"prompt": "t10 t11 t12"}) == plain[:1]
    outputs = llm.generate([{"prompt_token_ids": ids}], params)
    assert outputs[0].prompt_token_ids == ids


@pytest.mark.parametrize(
    ("prompt", "words"),
    [
        ({"prompt": "a", "multi_modal_data": {}}, "multi_modal_data"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "one of"),
        ({}, "one of"),
        ({"prompt_token_ids": "t10"}, "list of ints"),
        ({"prompt": [1, 2]}, "must be a string"),
    ],
)
def test_other_dicts_are_refused(llm: LLM, prompt: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        llm.generate([prompt], SamplingParams(max_tokens=1))
