"""Model families end to end: each family's real chat template and special tokens, a tiny
random-weight model of its architecture, and the official openai SDK as the client.

A random model writes nothing sensible, so what a real model would choose is forced:
tool calls by `tool_choice: "required"` (the family's call grammar), the end of thinking by
a logit bias on its end marker. What is tested is everything around the model: the prompt
the template renders, the grammar, the parsers, the stream and the next turn's prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from engine import AsyncLLM, EngineArgs
from server.tool_parsers import detect
from tests.server.families import FAMILIES, Family, make_family_model
from tests.server.live import LiveServer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",  # Hermes 3's template requires one
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["answer"],
    "additionalProperties": False,
}
# How each family's template renders the tool result "sunny" in the next turn's prompt.
TOOL_RESULT = {
    "qwen3": "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>",
    "qwen3_coder": "<tool_response>\nsunny\n</tool_response>",
    "hermes3": "<|im_start|>tool\n<tool_response>\nsunny\n</tool_response><|im_end|>",
    "deepseek_r1": "<｜User｜><tool_response>\nsunny\n</tool_response>",  # built-in Hermes
    "llama3_json": '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny"<|eot_id|>',
    "pythonic": '<|start_header_id|>ipython<|end_header_id|>\n\n{"output": "sunny"}<|eot_id|>',
    "mistral_nemo": '[TOOL_RESULTS]{"content": sunny, "call_id": "{id}"}[/TOOL_RESULTS]',
    "mistral_small_3_2": "[TOOL_RESULTS]{id}[TOOL_CONTENT]sunny[/TOOL_RESULTS]",
    "granite": "<|start_of_role|>tool<|end_of_role|>sunny<|end_of_text|>",
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A server per family, started on first use and kept for the module."""
    started: dict[str, tuple[Family, LiveServer, Any]] = {}
    with ExitStack() as stack:

        def get(name: str) -> tuple[Family, LiveServer, Any]:
            if name not in started:
                spec = FAMILIES[name]
                path = make_family_model(spec, tmp_path_factory.mktemp(name))
                args = EngineArgs(
                    model=str(path), dtype="float32", num_kv_blocks=256, engine_in_process=True
                )
                live = stack.enter_context(
                    LiveServer(AsyncLLM.from_engine_args(args), **spec.flags)
                )
                started[name] = (spec, live, AutoTokenizer.from_pretrained(path))
            return started[name]

        yield get


def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def token_id(tokenizer: Any, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return int(ids[0])


def no_thinking(spec: Family, tokenizer: Any) -> dict[str, Any]:
    """Request fields that keep a family's reasoning out of a tool call test."""
    if spec.name == "qwen3":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if spec.name == "deepseek_r1":  # its template opens the thinking: end it at once
        return {"logit_bias": {token_id(tokenizer, "</think>"): 50.0}}
    return {}


def streamed(stream: Any) -> dict[str, Any]:
    """Rebuilds a streamed choice from its deltas, as SDK users do."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for chunk in stream:
        out["usage"] = chunk.usage or out.get("usage")
        for choice in chunk.choices:
            delta = choice.delta
            out["content"] += delta.content or ""
            out["reasoning"] += (delta.model_extra or {}).get("reasoning") or ""
            for call in delta.tool_calls or []:
                entry = out["calls"].setdefault(call.index, {"id": None, "name": "", "args": ""})
                entry["id"] = entry["id"] or call.id
                entry["name"] += call.function.name or ""
                entry["args"] += call.function.arguments or ""
            out["finish"] = choice.finish_reason or out["finish"]
    return out


@pytest.mark.parametrize("name", sorted(TOOL_RESULT))
def test_tool_round_trip(servers: Any, name: str) -> None:
    spec, live, tokenizer = servers(name)
    sdk = client(live)
    request: dict[str, Any] = dict(
        model=live.settings.served_model_name or sdk.models.list().data[0].id,
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=3,
        max_tokens=200,
        extra_body=no_thinking(spec, tokenizer),
    )
    first = sdk.chat.completions.create(**request)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])

    again = streamed(sdk.chat.completions.create(**request, stream=True))
    assert again["finish"] == "tool_calls" and list(again["calls"]) == [0]
    assert (again["calls"][0]["name"], again["calls"][0]["args"]) == (
        call.function.name,
        call.function.arguments,
    )

    # The next turn carries the call and its result back, as an agent loop does.
    assistant = choice.message.model_dump(exclude_none=True, exclude={"reasoning"})
    result = {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
    messages = [*USER, assistant, result]
    second = sdk.chat.completions.create(**(request | {"messages": messages, "max_tokens": 2}))
    assert second.choices[0].finish_reason in ("tool_calls", "length")
    body = {"messages": messages, "tools": TOOLS, **request["extra_body"]}
    rendered = httpx.post(f"{live.url}/v1/chat/completions/render", json=body).json()["token_ids"]
    assert second.usage.prompt_tokens == len(rendered)
    prompt = tokenizer.decode(rendered, skip_special_tokens=False)
    assert TOOL_RESULT[spec.name].replace("{id}", call.id) in prompt, prompt
    if spec.flags.get("tool_call_parser") != "hermes":  # the template renders the tools itself
        own = tokenizer.apply_chat_template(
            [*USER, _as_template_sees(assistant), result],
            tools=TOOLS,
            add_generation_prompt=True,
            tokenize=False,
            **request["extra_body"].get("chat_template_kwargs", {}),
        )
        assert prompt == own


def _as_template_sees(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn as transformers users pass it: arguments as objects."""
    calls = [
        c
        | {
            "function": {
                "name": c["function"]["name"],
                "arguments": json.loads(c["function"]["arguments"]),
            }
        }
        for c in message["tool_calls"]
    ]
    return {"role": "assistant", "content": message.get("content") or "", "tool_calls": calls}


def thinking_fields(spec: Family, tokenizer: Any) -> dict[str, Any]:
    """Bias the end of thinking (and its start, where the model opens it) so that a random
    model thinks a little and then answers."""
    bias = {token_id(tokenizer, "</think>"): 3.0, tokenizer.eos_token_id: -100.0}
    if spec.name != "deepseek_r1":
        bias[token_id(tokenizer, "<think>")] = 6.0
    fields: dict[str, Any] = {"logit_bias": bias}
    if spec.name == "granite":
        fields["chat_template_kwargs"] = {"thinking": True}
    return fields


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if "reasoning_parser" in f.flags])
def test_reasoning_then_a_valid_answer(servers: Any, name: str) -> None:
    spec, live, tokenizer = servers(name)
    sdk = client(live)
    request: dict[str, Any] = dict(
        model=sdk.models.list().data[0].id,
        messages=[{"role": "user", "content": "How much is 6 * 7?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}},
        temperature=1.0,
        seed=4,
        max_tokens=300,
        logprobs=True,
        extra_body=thinking_fields(spec, tokenizer),
    )
    whole = sdk.chat.completions.create(**request)
    message = whole.choices[0].message
    thinking = (message.model_extra or {}).get("reasoning")
    assert thinking, message
    jsonschema.validate(json.loads(message.content), ANSWER)
    tokens = [entry.token for entry in whole.choices[0].logprobs.content]
    assert "</think>" in tokens
    details = whole.usage.completion_tokens_details
    assert details.reasoning_tokens == tokens.index("</think>") + 1

    stream = sdk.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    )
    again = streamed(stream)
    assert (again["reasoning"], again["content"]) == (thinking, message.content)
    assert again["usage"].completion_tokens_details.reasoning_tokens == details.reasoning_tokens


def test_thinking_then_a_required_tool_call(servers: Any) -> None:
    """tool_choice "required" under a reasoning parser: free thinking, then the call."""
    spec, live, tokenizer = servers("qwen3")
    sdk = client(live)
    request: dict[str, Any] = dict(
        model=sdk.models.list().data[0].id,
        messages=USER,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0,
        seed=5,
        max_tokens=300,
        extra_body=thinking_fields(spec, tokenizer),
    )
    message = sdk.chat.completions.create(**request).choices[0].message
    assert (message.model_extra or {}).get("reasoning")
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    again = streamed(sdk.chat.completions.create(**request, stream=True))
    assert again["reasoning"] == message.model_extra["reasoning"]
    assert again["calls"][0]["args"] == call.function.arguments


def test_qwen3_without_thinking_answers_at_once(servers: Any) -> None:
    _, live, _ = servers("qwen3")
    sdk = client(live)
    response = sdk.chat.completions.create(
        model=sdk.models.list().data[0].id,
        messages=[{"role": "user", "content": "How much is 6 * 7?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}},
        max_tokens=60,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    message = response.choices[0].message
    assert (message.model_extra or {}).get("reasoning") is None
    jsonschema.validate(json.loads(message.content), ANSWER)
    assert response.usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_past_thinking_reaches_the_template(servers: Any, field: str) -> None:
    """An assistant turn's thinking, under either name, is the template's
    `reasoning_content` (Qwen3 renders it for the turns after the last question)."""
    _, live, tokenizer = servers("qwen3")
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    assistant = {
        "role": "assistant",
        "content": None,
        field: "Ask the clock.",
        "tool_calls": [call],
    }
    messages = [*USER, assistant, {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    body = {"messages": messages, "tools": TOOLS}
    ids = httpx.post(f"{live.url}/v1/chat/completions/render", json=body).json()["token_ids"]
    prompt = tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>assistant\n<think>\nAsk the clock.\n</think>\n\n<tool_call>" in prompt
    user_thinking = httpx.post(
        f"{live.url}/v1/chat/completions/render",
        json={"messages": [{"role": "user", "content": "x", field: "y"}]},
    )
    assert user_thinking.status_code == 400 and user_thinking.json()["error"]["param"].endswith(
        field
    )


# Docs table row -> the family the tests above run it as ("default": the default model's tests).
README_ROWS = {
    "Qwen3 (thinking on and off)": "qwen3",
    "Qwen3-Coder": "qwen3_coder",
    "Hermes 2 Pro, Hermes 3": "hermes3",
    "DeepSeek-R1 distills": "deepseek_r1",
    "Llama 3.1, 3.2, 3.3": "llama3_json",
    "Llama pythonic templates": "pythonic",
    "Mistral Nemo, Small 3.1": "mistral_nemo",
    "Mistral Small 3.2, Magistral, Devstral": "mistral_small_3_2",
    "Granite 3.2, 3.3": "granite",
    "SmolLM2 (the default model)": "default",
}


def readme_families() -> list[list[str]]:
    """The rows of the docs' model family table."""
    page = Path(__file__).parents[2] / "docs" / "structured-outputs-and-tools.md"
    section = page.read_text().split("## Model families", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    return [[cell.strip().strip("`") for cell in row.strip("|").split(" | ")] for row in rows[1:]]


def test_the_docs_family_table_is_what_the_tests_run() -> None:
    rows = readme_families()
    assert [row[0] for row in rows] == list(README_ROWS)
    for family, template, tool_flag, reasoning_flag in rows:
        name = README_ROWS[family]
        if name == "default":  # tests/server/test_structured_default_model.py
            assert tool_flag.startswith("hermes") and reasoning_flag == "none"
            continue
        spec = FAMILIES[name]
        assert template == spec.template
        assert spec.flags.get("reasoning_parser", "none") == reasoning_flag
        assert (name in TOOL_RESULT) == (not tool_flag.startswith("none"))
        found = detect(spec.template_text())
        if tool_flag.startswith("auto"):
            assert "tool_call_parser" not in spec.flags
            assert found is not None and tool_flag.endswith(f"→ `{found.name}")
        elif tool_flag.startswith("none"):
            assert found is None and "tool_call_parser" not in spec.flags
        else:
            assert tool_flag.startswith(spec.flags["tool_call_parser"])


def test_template_kwargs_cannot_set_what_the_server_sets(servers: Any) -> None:
    _, live, _ = servers("qwen3")
    body = {"messages": USER, "chat_template_kwargs": {"tools": [], "enable_thinking": False}}
    response = httpx.post(f"{live.url}/v1/chat/completions/render", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "chat_template_kwargs"
    assert "'tools'" in response.json()["error"]["message"]
