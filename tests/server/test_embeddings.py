"""POST /v1/embeddings through a real uvicorn server and the official openai SDK: the
vectors sentence-transformers computes, as floats and as base64, from text and from token
ids, with `dimensions`; OpenAI-shaped 400s; each server refuses the other task's routes;
the same vectors from an engine core in a process of its own."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
import openai
import pytest

from tests.server.conftest import tiny_engine
from tests.server.live import LiveServer
from tests.tiny_models import make_tiny_embedding_model

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

MODEL = "tiny-embed"
MAX_MODEL_LEN = 128
TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 8,  # 88 tokens: 3 chunks of 32
    "Ada",
    '{"name": "Ada", "age": 36}',
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("embed-server")
    return make_tiny_embedding_model(folder, matryoshka_dimensions=[16, 32])


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> SentenceTransformer:
    from sentence_transformers import SentenceTransformer  # slow to import: only here

    return SentenceTransformer(str(model_dir), device="cpu")


@pytest.fixture(scope="module")
def expected(reference: SentenceTransformer) -> np.ndarray:
    return reference.encode(TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))


@pytest.fixture(scope="module")
def embed_server(model_dir: Path) -> Iterator[LiveServer]:
    engine = tiny_engine(
        model_dir, task="embed", max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=32
    )
    with LiveServer(engine, served_model_name=MODEL) as server:
        yield server


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def cosine(got: Any, want: np.ndarray) -> float:
    vector = np.asarray(got, dtype=np.float64)
    return float(vector @ want / (np.linalg.norm(vector) * np.linalg.norm(want)))


def min_cosine(data: list[Any], expected: np.ndarray) -> float:
    return min(cosine(d.embedding, want) for d, want in zip(data, expected, strict=True))


def test_float_and_base64_as_sentence_transformers(
    embed_server: LiveServer, reference: SentenceTransformer, expected: np.ndarray
) -> None:
    sdk = client(embed_server)
    floats = sdk.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert floats.object == "list" and floats.model == MODEL
    assert [(d.object, d.index) for d in floats.data] == [("embedding", i) for i in range(3)]
    assert min_cosine(floats.data, expected) >= 0.9999
    num_tokens = sum(len(reference.tokenizer.encode(text)) for text in TEXTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == num_tokens

    raw = sdk.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    for packed, plain in zip(raw.data, floats.data, strict=True):
        assert isinstance(packed.embedding, str)
        decoded = np.frombuffer(base64.b64decode(packed.embedding), dtype="<f4")
        assert decoded.tolist() == np.asarray(plain.embedding, dtype=np.float32).tolist()
    # Without a format the SDK asks for base64 and decodes it itself.
    default = sdk.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.embedding for d in default.data] == [d.embedding for d in floats.data]


def test_token_ids_and_dimensions(
    embed_server: LiveServer, reference: SentenceTransformer, expected: np.ndarray
) -> None:
    sdk = client(embed_server)
    ids = [reference.tokenizer.encode(text) for text in TEXTS[1:]]
    one = sdk.embeddings.create(model=MODEL, input=ids[0], encoding_format="float", user="u1")
    many = sdk.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert min_cosine(one.data, expected[1:2]) >= 0.9999
    assert min_cosine(many.data, expected[1:]) >= 0.9999
    # Exactly max_model_len tokens: an embedding needs no room to generate.
    full = sdk.embeddings.create(model=MODEL, input=[5] * MAX_MODEL_LEN, encoding_format="float")
    assert full.usage.prompt_tokens == MAX_MODEL_LEN

    short = sdk.embeddings.create(model=MODEL, input="Ada", dimensions=16, encoding_format="float")
    vector = np.asarray(short.data[0].embedding)
    assert len(vector) == 16 and np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
    assert cosine(vector, expected[1][:16]) >= 0.9999  # the first 16, normalised again


def bad_request(server: LiveServer, **body: Any) -> dict[str, Any]:
    response = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["Ada", ""]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [1, 100000]}, "input"),
        ({"input": [5] * (MAX_MODEL_LEN + 1)}, "input"),
        ({"input": "Ada", "dimensions": 20}, "dimensions"),
        ({"input": "Ada", "dimensions": 0}, "dimensions"),
        ({"input": "Ada", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "Ada", "truncate": True}, "truncate"),
    ],
)
def test_bad_requests_are_openai_shaped_400s(
    embed_server: LiveServer, body: dict[str, Any], param: str
) -> None:
    assert bad_request(embed_server, **body)["param"] == param


def test_each_server_serves_its_own_task(embed_server: LiveServer, tiny_server: LiveServer):
    sdk = client(embed_server)
    with pytest.raises(openai.BadRequestError, match="serves embeddings only"):
        sdk.completions.create(model=MODEL, prompt="Ada", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="serves embeddings only"):
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Ada"}])
    for stream in (False, True):  # refused before a stream could start
        with pytest.raises(openai.BadRequestError, match="serves embeddings only"):
            sdk.responses.create(model=MODEL, input="Ada", stream=stream)
    generating = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="does not serve embeddings") as refused:
        generating.embeddings.create(model="tiny", input="t3 t4")
    assert refused.value.response.json()["error"]["param"] == "model"


def test_counted_under_vllm_metrics(embed_server: LiveServer) -> None:
    stops = embed_server.metric("vllm:request_success_total", finished_reason="stop")
    prompt_tokens = embed_server.metric("vllm:prompt_tokens_total")
    client(embed_server).embeddings.create(model=MODEL, input=[[5, 6, 7], [8, 9]])
    assert embed_server.metric("vllm:request_success_total", finished_reason="stop") == stops + 2
    assert embed_server.metric("vllm:prompt_tokens_total") == prompt_tokens + 5
    assert embed_server.wait_idle(5)


def test_the_engine_core_in_its_own_process(model_dir: Path, expected: np.ndarray) -> None:
    engine = tiny_engine(model_dir, task="embed", engine_in_process=False)
    with LiveServer(engine, served_model_name=MODEL) as server:
        sdk = client(server)
        got = sdk.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
        short = sdk.embeddings.create(model=MODEL, input=TEXTS[1], dimensions=32)
    assert min_cosine(got.data, expected) >= 0.9999
    assert cosine(short.data[0].embedding, expected[1][:32]) >= 0.9999  # crossed with the input
