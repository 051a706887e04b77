"""Incremental detokenization and stop strings on the default model's tokenizer."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from engine.detokenizer import IncrementalDetokenizer, StoppableText
from engine.sampling_params import SamplingParams

TEXTS = [
    " Hello, world! Multi-byte: naïve café, 日本語のテキスト, emoji 🚀🎉 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢.",
    "\n\n  leading spaces,\ttabs and   runs of spaces  ",
    "Paris is the capital of France.",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tokenizer, text: str) -> None:
    prompt = tokenizer.encode("Question: say something.")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def feed(tokenizer, text: str, params: SamplingParams) -> tuple[StoppableText, list[str]]:
    """Feeds `text`'s tokens until a stop string matches; the last take is the final one."""
    ids = tokenizer.encode(text)
    stoppable = StoppableText(tokenizer, tokenizer.encode("Hi"), params)
    deltas = []
    for i, token in enumerate(ids):
        stopped = stoppable.add(token)
        deltas.append(stoppable.take_new(finished=stopped or i == len(ids) - 1))
        if stopped:
            break
    return stoppable, deltas


def test_stop_string_never_leaks_into_the_stream(tokenizer) -> None:
    text = "The answer is 42. STOP here and never show this part."
    stoppable, deltas = feed(tokenizer, text, SamplingParams(stop=["STOP here"]))
    streamed = "".join(deltas)
    assert streamed == stoppable.text == "The answer is 42. "
    assert stoppable.matched_stop == "STOP here"
    # Nothing of the stop string was ever sent, even before the match.
    assert not any("ST" in d for d in deltas)


def test_include_stop_str_in_output(tokenizer) -> None:
    params = SamplingParams(stop=["42"], include_stop_str_in_output=True)
    stoppable, deltas = feed(tokenizer, "The answer is 42. More", params)
    assert "".join(deltas) == stoppable.text == "The answer is 42"


def test_earliest_of_several_stop_strings_wins(tokenizer) -> None:
    stoppable, _ = feed(tokenizer, "alpha beta gamma delta", SamplingParams(stop=["delta", "beta"]))
    assert stoppable.text == "alpha " and stoppable.matched_stop == "beta"


def test_held_back_text_is_flushed_when_no_stop_matches(tokenizer) -> None:
    text = "A partial ST at the very end ST"
    stoppable, deltas = feed(tokenizer, text, SamplingParams(stop=["STOP"]))
    assert "".join(deltas) == tokenizer.decode(tokenizer.encode(text))
    assert stoppable.matched_stop is None


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_direct_window_decoder_equals_the_tokenizers_decode(
    tokenizer, skip_special_tokens: bool
) -> None:
    """The default tokenizer takes the Rust decode directly; every window, special tokens
    and split multi-byte characters included, decodes as transformers' decode does."""
    from engine.detokenizer import _plain_tokenizers_backend, window_decoder

    assert _plain_tokenizers_backend(type(tokenizer))
    decode = window_decoder(tokenizer, skip_special_tokens)
    ids = [*tokenizer.encode(TEXTS[0]), tokenizer.eos_token_id, *tokenizer.encode(TEXTS[1])]
    for start in range(len(ids)):
        for end in range(start, min(len(ids), start + 8) + 1):
            window = ids[start:end]
            expected = tokenizer.decode(
                window, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
            )
            assert decode(window) == expected


def test_a_tokenizer_that_overrides_decode_keeps_its_own(tokenizer) -> None:
    from engine.detokenizer import window_decoder

    class Shouting(type(tokenizer)):  # type: ignore[misc]
        def decode(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            return super().decode(*args, **kwargs).upper()

    shouting = copy.copy(tokenizer)
    shouting.__class__ = Shouting
    ids = tokenizer.encode("Paris is the capital")
    assert window_decoder(shouting, True)(ids) == tokenizer.decode(ids).upper()
    detok = IncrementalDetokenizer(shouting, [], skip_special_tokens=True)
    assert "".join(detok.add(t) for t in ids) == tokenizer.decode(ids).upper()
