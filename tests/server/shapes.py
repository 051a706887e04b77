"""Exact checks of OpenAI response and chunk shapes (the SDK's own models are lenient)."""

from __future__ import annotations

from typing import Any

FINISH = {"stop", "length"}


def check_usage(usage: dict[str, Any]) -> None:
    assert set(usage) >= {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int)


def check_completion(body: dict[str, Any], n_choices: int, logprobs: bool = False) -> None:
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert isinstance(body["created"], int) and isinstance(body["model"], str)
    assert sorted(c["index"] for c in body["choices"]) == list(range(n_choices))
    for choice in body["choices"]:
        assert isinstance(choice["text"], str)
        assert choice["finish_reason"] in FINISH
        if logprobs:
            lp = choice["logprobs"]
            n = len(lp["tokens"])
            assert (
                n == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
            )
            assert all(v <= 0 for v in lp["token_logprobs"] if v is not None)
        else:
            assert choice["logprobs"] is None
    check_usage(body["usage"])


def check_chat(body: dict[str, Any], n_choices: int, logprobs: bool = False) -> None:
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert sorted(c["index"] for c in body["choices"]) == list(range(n_choices))
    for choice in body["choices"]:
        assert choice["message"]["role"] == "assistant"
        assert isinstance(choice["message"]["content"], str)
        assert choice["message"]["refusal"] is None
        assert choice["finish_reason"] in FINISH
        if logprobs:
            assert choice["logprobs"]["refusal"] is None
            for entry in choice["logprobs"]["content"]:
                assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
                assert entry["bytes"] == list(entry["token"].encode())
        else:
            assert choice["logprobs"] is None
    check_usage(body["usage"])


def check_stream(chunks: list[dict[str, Any]], kind: str, n_choices: int) -> dict[int, str]:
    """Validates a whole stream; returns the text of each choice."""
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    role_seen: set[int] = set()
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    for chunk in chunks:
        assert chunk["object"] == obj
        if not chunk["choices"]:
            check_usage(chunk["usage"])  # the include_usage chunk, last
            continue
        (choice,) = chunk["choices"]
        index = choice["index"]
        assert index not in finished, "a chunk arrived after the choice finished"
        if kind == "chat":
            delta = choice["delta"]
            if "role" in delta:
                assert delta == {"role": "assistant", "content": "", "refusal": None}
                assert index not in role_seen
                role_seen.add(index)
            assert index in role_seen, "the role must come in the first chunk"
            texts[index] = texts.get(index, "") + delta.get("content", "")
        else:
            texts[index] = texts.get(index, "") + choice["text"]
        if choice["finish_reason"] is not None:
            assert choice["finish_reason"] in FINISH
            finished[index] = choice["finish_reason"]
    assert sorted(finished) == list(range(n_choices)), "every choice ends with a finish_reason"
    return texts
