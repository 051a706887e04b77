"""Multi-LoRA serving through the gateway and the engine core's own process, with the
openai SDK: an adapter named as the model answers as PEFT's merged model does, /v1/models
lists adapters under their parent, vLLM's load/unload endpoints work behind the API key
and refuse bad input with OpenAI-shaped errors, and vllm:lora_requests_info carries the
labels GIE reads."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import tiny_engine
from tests.server.live import LiveServer
from tests.tiny_models import make_lora_adapter, peft_merged_greedy

KEY = "lora-secret"
PROMPT = [17, 18, 19, 20, 21, 22, 23]
MAX_TOKENS = 8


@dataclass(frozen=True)
class Adapters:
    sql: Path
    chat: Path
    expected: dict[str, str]  # adapter -> the greedy text PEFT's merged model writes


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Adapters:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("adapters")
    sql = make_lora_adapter(tiny_model_dir, root / "sql", 1, 4, ["q_proj", "v_proj", "o_proj"])
    chat = make_lora_adapter(tiny_model_dir, root / "chat", 2, 8, ["gate_proj", "down_proj"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt_text = tokenizer.decode(PROMPT)
    expected = {}
    for name, path in (("sql", sql), ("chat", chat)):
        tokens = peft_merged_greedy(tiny_model_dir, path, [PROMPT], MAX_TOKENS)[0]
        expected[name] = tokenizer.decode(PROMPT + tokens)[len(prompt_text) :]
    return Adapters(sql, chat, expected)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, adapters: Adapters) -> Iterator[LiveServer]:
    engine = tiny_engine(
        tiny_model_dir,
        engine_in_process=False,
        enable_lora=True,
        lora_modules=[f"sql={adapters.sql}"],
        max_loras=2,
        max_lora_rank=8,
    )
    with LiveServer(engine, served_model_name="tiny", api_key=[KEY]) as live:
        yield live


def sdk(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def complete(server: LiveServer, model: str, **extra: object) -> openai.types.Completion:
    return sdk(server).completions.create(  # type: ignore[call-overload,no-any-return]
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, **extra
    )


def post(server: LiveServer, path: str, body: object, key: str | None = KEY) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def test_an_adapter_answers_as_the_merged_model(server: LiveServer, adapters: Adapters) -> None:
    got = complete(server, "sql")
    assert got.model == "sql"
    assert got.choices[0].text == adapters.expected["sql"]
    stream = complete(server, "sql", stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == adapters.expected["sql"]
    base = complete(server, "tiny")
    assert base.model == "tiny" and base.choices[0].text != adapters.expected["sql"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        complete(server, "no-such-adapter")


def test_models_list_adapters_under_their_parent(server: LiveServer, adapters: Adapters) -> None:
    cards = {m.id: m for m in sdk(server).models.list().data}
    assert set(cards) >= {"tiny", "sql"}
    assert cards["tiny"].model_extra["parent"] is None  # type: ignore[index]
    assert cards["sql"].model_extra["parent"] == "tiny"  # type: ignore[index]
    assert cards["sql"].model_extra["root"] == str(adapters.sql)  # type: ignore[index]


def test_load_and_unload_at_run_time(server: LiveServer, adapters: Adapters) -> None:
    body = {"lora_name": "chat", "lora_path": str(adapters.chat)}
    assert post(server, "/v1/load_lora_adapter", body, key=None).status_code == 401
    loaded = post(server, "/v1/load_lora_adapter", body)
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'chat' added successfully."
    assert complete(server, "chat").choices[0].text == adapters.expected["chat"]
    again = post(server, "/v1/load_lora_adapter", body)
    assert again.status_code == 400
    assert again.json()["error"]["message"] == "The lora adapter 'chat' has already been loaded."
    # Loaded in place under the same name: the other adapter's weights now answer.
    inplace = post(
        server,
        "/v1/load_lora_adapter",
        body | {"lora_path": str(adapters.sql), "load_inplace": True},
    )
    assert inplace.status_code == 200, inplace.text
    assert complete(server, "chat").choices[0].text == adapters.expected["sql"]
    bad = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"})
    assert bad.status_code == 400
    assert "no adapter_config.json" in bad.json()["error"]["message"]
    missing = post(server, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    removed = post(server, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert removed.status_code == 200, removed.text
    assert removed.text == "Success: LoRA adapter 'chat' removed successfully."
    with pytest.raises(openai.NotFoundError):
        complete(server, "chat")
    unknown = post(server, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["message"] == "The lora adapter 'chat' cannot be found."
    assert server.wait_idle(30)


def test_lora_requests_info_as_gie_reads_it(server: LiveServer) -> None:
    complete(server, "sql")
    text = httpx.get(f"{server.url}/metrics").text
    samples = [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:lora_requests_info"
    ]
    assert len(samples) == 1  # only the latest label set
    labels = samples[0].labels
    assert labels["max_lora"] == "2" and labels["model_name"] == "tiny"
    assert {"running_lora_adapters", "waiting_lora_adapters"} <= labels.keys()
    assert samples[0].value > 1.7e9  # a Unix time: GIE keeps the latest sample
