"""Embeddings (--task embed) against sentence-transformers' own encode() in float32, through
the engine's scheduler: batched, chunked over several steps, and from the prefix cache.
Then the pooling configuration read from a sentence-transformers directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from engine import LLM, EngineArgs, EngineHooks, PoolingParams, RequestValidationError
from engine.config import resolve_model_config
from engine.pooling import PoolerConfig, read_pooler_config, resolve_task
from tests.tiny_models import make_tiny_embedding_model, make_tiny_model

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

BUDGET = 32  # tokens per step: the long text below takes several
LONG = "The quick brown fox jumps over the lazy dog. " * 12
TEXTS = ["Structured outputs constrain what a model may write.", LONG, "0123456789", "Ada"]
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_embedding_model(tmp_path_factory.mktemp("embed"), is_matryoshka=True)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> SentenceTransformer:
    from sentence_transformers import SentenceTransformer  # slow to import: only here

    return SentenceTransformer(str(model_dir), device="cpu")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(
        str(model_dir),
        EngineHooks(check_invariants=True),
        task="auto",
        dtype="float32",
        block_size=16,
        num_kv_blocks=64,
        max_model_len=512,
        max_num_batched_tokens=BUDGET,
    )


def want(reference: SentenceTransformer, texts: list[str]) -> np.ndarray:
    return reference.encode(texts, convert_to_numpy=True, batch_size=len(texts))


def assert_close(got: list[float], expected: np.ndarray) -> None:
    vector = np.asarray(got, dtype=np.float64)
    cosine = vector @ expected / (np.linalg.norm(vector) * np.linalg.norm(expected))
    print(f"cosine {cosine:.8f}, max abs diff {np.abs(vector - expected).max():.2e}")
    assert cosine >= MIN_COSINE
    assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)


def test_batched_and_chunked_as_sentence_transformers(llm: LLM, reference: SentenceTransformer):
    assert llm.config.model.task == "embed"  # auto: the directory has modules.json
    assert len(llm.tokenizer.encode(LONG)) > 3 * BUDGET
    outputs = llm.embed(TEXTS)
    expected = want(reference, TEXTS)
    assert [len(out.embedding or []) for out in outputs] == [64] * len(TEXTS)
    for out, vector in zip(outputs, expected, strict=True):
        assert out.finished and out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].token_ids == []
        assert_close(out.embedding or [], vector)


def test_a_single_input_and_token_ids(llm: LLM, reference: SentenceTransformer) -> None:
    (text_out,) = llm.embed("Ada")
    (ids_out,) = llm.embed([llm.tokenizer.encode("Ada")])
    assert_close(text_out.embedding or [], want(reference, ["Ada"])[0])
    assert ids_out.embedding == text_out.embedding


def test_prefix_cache_hits_still_compute_the_last_token(
    llm: LLM, reference: SentenceTransformer
) -> None:
    text = "Paged attention keeps each sequence's keys and values in fixed-size blocks."
    num_tokens = len(llm.tokenizer.encode(text))
    (first,) = llm.embed(text)
    (again,) = llm.embed(text)  # a full hit: every block but the one holding the last token
    (longer,) = llm.embed(text + " numbers")
    assert num_tokens > 32 and again.num_cached_tokens == (num_tokens - 1) // 16 * 16
    assert longer.num_cached_tokens >= again.num_cached_tokens
    expected = want(reference, [text, text + " numbers"])
    for out, vector in zip((first, again, longer), (*expected[:1], *expected), strict=True):
        assert_close(out.embedding or [], vector)


def test_dimensions_truncate_then_normalise(llm: LLM, reference: SentenceTransformer) -> None:
    (out,) = llm.embed("Ada", PoolingParams(dimensions=16))
    full = want(reference, ["Ada"])[0]
    assert len(out.embedding or []) == 16
    assert_close(out.embedding or [], full[:16] / np.linalg.norm(full[:16]))


def test_an_embedding_engine_generates_nothing(llm: LLM) -> None:
    with pytest.raises(RequestValidationError) as refused:
        llm.generate("Ada")
    assert refused.value.param == "model"


def test_the_pooling_the_directory_describes(model_dir: Path, tmp_path: Path) -> None:
    config = resolve_model_config(EngineArgs(model=str(model_dir), task="embed"))
    assert config.pooler == PoolerConfig(64, normalize=True, matryoshka=True)
    generate = resolve_model_config(EngineArgs(model=str(model_dir)))
    assert generate.task == "generate" and generate.pooler is None
    plain = make_tiny_model("qwen3", tmp_path / "plain")
    assert resolve_task("auto", plain) == "generate" and resolve_task("embed", plain) == "embed"
    # Without sentence-transformers files: Qwen3-Embedding's pooling, normalised.
    assert read_pooler_config(plain, object(), 64) == PoolerConfig(64)


def copy_config(model_dir: Path, target: Path) -> Path:
    """The directory's sentence-transformers files (no weights), to edit."""
    for name in ("modules.json", "1_Pooling/config.json", "config_sentence_transformers.json"):
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_text((model_dir / name).read_text())
    return target


def edit_json(path: Path, **changes: object) -> None:
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_last_token_pooling_only(model_dir: Path, tmp_path: Path) -> None:
    folder = copy_config(model_dir, tmp_path)
    pooling = folder / "1_Pooling" / "config.json"
    edit_json(pooling, pooling_mode="mean")
    with pytest.raises(ValueError, match=r"pooling \['mean'\] is not supported"):
        read_pooler_config(folder, object(), 64)
    # Sentence-transformers before 6 wrote a boolean per mode.
    legacy = {"pooling_mode_lasttoken": True, "pooling_mode_cls_token": False}
    pooling.write_text(json.dumps(legacy))
    assert read_pooler_config(folder, object(), 64).normalize
    edit_json(pooling, pooling_mode_cls_token=True)
    with pytest.raises(ValueError, match="cls_token"):
        read_pooler_config(folder, object(), 64)


def test_modules_other_than_pooling_and_normalize_are_refused(
    model_dir: Path, tmp_path: Path
) -> None:
    folder = copy_config(model_dir, tmp_path)
    modules = json.loads((folder / "modules.json").read_text())
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    (folder / "modules.json").write_text(json.dumps([*modules, dense]))
    with pytest.raises(ValueError, match="Dense"):
        read_pooler_config(folder, object(), 64)
    (folder / "modules.json").write_text(json.dumps(modules[:2]))  # no Normalize
    assert not read_pooler_config(folder, object(), 64).normalize


def test_dimensions_only_where_the_model_declares_them(model_dir: Path, tmp_path: Path) -> None:
    folder = copy_config(model_dir, tmp_path)
    with pytest.raises(RequestValidationError) as refused:
        read_pooler_config(folder, object(), 64).check(PoolingParams(dimensions=16))
    assert refused.value.param == "dimensions" and "Matryoshka" in str(refused.value)
    edit_json(folder / "config_sentence_transformers.json", matryoshka_dimensions=[16, 32])
    sizes = read_pooler_config(folder, object(), 64)
    sizes.check(PoolingParams(dimensions=32))
    with pytest.raises(RequestValidationError, match="one of 16, 32"):
        sizes.check(PoolingParams(dimensions=20))
    with pytest.raises(RequestValidationError, match="at least 1"):
        PoolingParams(dimensions=0)
