"""vLLM's render endpoints, which llm-d's endpoint picker calls to tokenize a request the
way the server will (its `token-producer` reads `token_ids`)."""

from __future__ import annotations

import httpx

from tests.server.live import LiveServer


def post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


def test_completions_render_gives_each_prompts_tokens(tiny_server: LiveServer) -> None:
    body = {"model": "tiny", "prompt": ["t10 t11 t12", "t20"], "max_tokens": 5, "stream": True}
    rendered = post(tiny_server, "/v1/completions/render", body)
    tokenized = [
        post(tiny_server, "/tokenize", {"prompt": text}).json()["tokens"] for text in body["prompt"]
    ]
    assert rendered.status_code == 200
    assert rendered.json() == [{"model": "tiny", "token_ids": ids} for ids in tokenized]
    ids = post(tiny_server, "/v1/completions/render", {"prompt": [5, 6, 7]}).json()
    assert ids == [{"model": "tiny", "token_ids": [5, 6, 7]}]


def test_chat_render_applies_the_template_as_generation_would(tiny_server: LiveServer) -> None:
    messages = [{"role": "user", "content": "t10 t11"}]
    rendered = post(tiny_server, "/v1/chat/completions/render", {"messages": messages}).json()
    expected = post(tiny_server, "/tokenize", {"messages": messages}).json()["tokens"]
    assert rendered == {"model": "tiny", "token_ids": expected}
    continued = post(
        tiny_server,
        "/v1/chat/completions/render",
        {"messages": messages, "continue_final_message": True, "add_generation_prompt": False},
    ).json()["token_ids"]
    assert continued != expected and expected[: len(continued)] == continued


def test_render_refuses_what_generation_refuses(tiny_server: LiveServer) -> None:
    bad = post(tiny_server, "/v1/completions/render", {"prompt": "t10", "max_tokens": "8"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    unknown = post(tiny_server, "/v1/chat/completions/render", {"messages": [], "model": "x"})
    assert unknown.status_code in (400, 404) and "error" in unknown.json()
    wrong_model = post(tiny_server, "/v1/completions/render", {"prompt": "t1", "model": "gpt"})
    assert wrong_model.status_code == 404
