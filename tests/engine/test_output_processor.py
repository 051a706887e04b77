"""Incremental detokenization and stop strings on the default model's tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.output_processor import IncrementalDetokenizer, RequestTracker
from engine.sampling_params import SamplingParams
from engine.scheduler.output import EngineCoreOutput

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


def feed(tokenizer, text: str, params: SamplingParams, finish: str = "length"):
    ids = tokenizer.encode(text)
    tracker = RequestTracker(tokenizer, tokenizer.encode("Hi"), params)
    deltas = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        delta = tracker.process(
            EngineCoreOutput("r", [token], finish_reason=finish if last else None)
        )
        deltas.append(delta.text)
        if tracker.finished:
            break
    return tracker, deltas


def test_stop_string_never_leaks_into_the_stream(tokenizer) -> None:
    text = "The answer is 42. STOP here and never show this part."
    tracker, deltas = feed(tokenizer, text, SamplingParams(stop=["STOP here"]))
    streamed = "".join(deltas)
    assert streamed == tracker.text == "The answer is 42. "
    assert (tracker.finish_reason, tracker.stop_reason) == ("stop", "STOP here")
    assert tracker.needs_abort


def test_include_stop_str_in_output(tokenizer) -> None:
    params = SamplingParams(stop=["42"], include_stop_str_in_output=True)
    tracker, deltas = feed(tokenizer, "The answer is 42. More", params)
    assert "".join(deltas) == tracker.text == "The answer is 42"


def test_earliest_of_several_stop_strings_wins(tokenizer) -> None:
    tracker, _ = feed(tokenizer, "alpha beta gamma delta", SamplingParams(stop=["delta", "beta"]))
    assert tracker.text == "alpha " and tracker.stop_reason == "beta"


def test_held_back_text_is_flushed_when_no_stop_matches(tokenizer) -> None:
    text = "A partial ST at the very end ST"
    tracker, deltas = feed(tokenizer, text, SamplingParams(stop=["STOP"]))
    assert "".join(deltas) == tokenizer.decode(tokenizer.encode(text))
    assert tracker.finish_reason == "length" and not tracker.needs_abort
