"""Multi-byte text through the server: characters split across byte tokens reach a stream
whole, and a `length` finish inside a character leaves no broken character behind.

The model greedily repeats TEXT one UTF-8 byte per token (tests/tiny_models.py), so every
non-ASCII character is split across two to four tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import tiny_engine
from tests.server.live import LiveServer
from tests.tiny_models import make_cycle_model

TEXT = "aé日🚀 "  # 1 + 2 + 3 + 4 + 1 bytes, all distinct


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = make_cycle_model(tmp_path_factory.mktemp("cycle"), TEXT)
    with LiveServer(tiny_engine(path), served_model_name="cycle") as live:
        yield live


def complete(server: LiveServer, max_tokens: int) -> dict:
    body = {"prompt": "a", "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()


def stream(server: LiveServer, max_tokens: int) -> list[dict]:
    body = {"prompt": "a", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        payloads = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p)["choices"][0] for p in payloads[:-1]]


def test_characters_split_across_tokens_stream_whole(server: LiveServer) -> None:
    full = complete(server, 22)
    assert full["choices"][0]["text"] == "é日🚀 aé日🚀 a"  # two turns of the cycle
    assert full["usage"]["completion_tokens"] == 22
    chunks = stream(server, 22)
    texts = [c["text"] for c in chunks if c["text"]]
    assert "".join(texts) == full["choices"][0]["text"]
    assert not any("\ufffd" in t for t in texts)
    # The bytes of one character arrive in one piece, never as several: each character is
    # inside one chunk (with its neighbours, where the stream merged tokens that came
    # faster than it was read), and the chunks are fewer than the byte tokens.
    assert all(any(ch in t for t in texts) for ch in "é日🚀") and len(texts) < 22
    assert chunks[-1]["finish_reason"] == "length"


@pytest.mark.parametrize(("max_tokens", "text"), [(4, "é"), (7, "é日"), (8, "é日"), (9, "é日🚀")])
def test_a_length_finish_inside_a_character_drops_its_partial_bytes(
    server: LiveServer, max_tokens: int, text: str
) -> None:
    full = complete(server, max_tokens)
    choice = full["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (text, "length")
    assert full["usage"]["completion_tokens"] == max_tokens
    chunks = stream(server, max_tokens)
    assert "".join(c["text"] for c in chunks) == text
    assert chunks[-1]["finish_reason"] == "length"
