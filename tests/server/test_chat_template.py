"""--chat-template and --tool-call-parser, and how tools reach the prompt."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine import AsyncLLM, EngineArgs
from server.chat_template import conversation, load_chat_template
from server.cli import build_parser, configs_from_args
from server.errors import OpenAIError
from server.messages import ChatMessage
from server.tool_parsers import (
    CHOICES,
    Hermes,
    Llama3Json,
    Pythonic,
    refusal,
    resolve,
    template_supports_tools,
)
from server.tools import Tool, plan_tools
from tests.server.live import LiveServer
from tests.tiny_models import make_tiny_model

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# A template that renders tools itself, as tool-capable models' templates do.
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{{ tools | tojson }};{% endif %}"
    "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}CALL:{{ c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}{% endfor %}"
    "{% if m['role'] == 'tool' %}@{{ m['tool_call_id'] }}{% endif %};{% endfor %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}},
            {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "one"},
    {"role": "tool", "tool_call_id": "call_2", "content": "two"},
]


def test_chat_template_flag_takes_a_file_or_the_template_itself(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(TOOL_TEMPLATE)
    assert load_chat_template(str(path)) == TOOL_TEMPLATE
    assert load_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ValueError, match="neither a readable file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    args = build_parser().parse_args(
        ["serve", "--chat-template", str(path), "--tool-call-parser", "none"]
    )
    settings, _ = configs_from_args(args)
    assert settings.chat_template == TOOL_TEMPLATE and settings.tool_call_parser == "none"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "functionary"])


def test_every_format_and_alias_is_a_choice_of_the_flag() -> None:
    for choice in CHOICES:
        settings, _ = configs_from_args(
            build_parser().parse_args(["serve", "--tool-call-parser", choice])
        )
        assert settings.tool_call_parser == choice
    assert isinstance(resolve("llama4_pythonic", None, None), Pythonic)
    assert isinstance(resolve("llama4_json", None, None), Llama3Json)


@pytest.mark.parametrize(
    ("setting", "template", "says"),
    [
        ("none", TOOL_TEMPLATE, "--tool-call-parser none"),
        ("auto", "{{ messages }}", "--tool-call-parser hermes"),
        ("auto", TOOL_TEMPLATE, "--tool-call-parser set to the model's format"),
    ],
)
def test_servers_without_a_tool_format_refuse_tools_naming_the_flag(
    setting: str, template: str, says: str
) -> None:
    assert resolve(setting, template, None) is None
    with pytest.raises(OpenAIError) as err:
        plan_tools([Tool.model_validate(TOOL)], None, None, None, refusal(setting, template))
    assert err.value.status == 400 and err.value.param == "tools"
    assert says in err.value.message


def test_builtin_hermes_rendering_for_templates_without_tools() -> None:
    messages = [ChatMessage.model_validate(m) for m in MESSAGES]
    plan = plan_tools([Tool.model_validate(TOOL)], "auto", None, Hermes(), "")
    assert not template_supports_tools("{{ messages }}") and template_supports_tools(TOOL_TEMPLATE)
    turns = conversation(messages, plan, native_tools=False)
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    assert turns[0]["content"].startswith("Be brief.\n\n") and '"name": "f"' in turns[0]["content"]
    assert turns[2]["content"] == (
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    )
    assert turns[3]["content"] == (
        "<tool_response>\none\n</tool_response>\n<tool_response>\ntwo\n</tool_response>"
    )


@pytest.fixture(scope="module")
def template_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = make_tiny_model("llama", tmp_path_factory.mktemp("tpl"), byte_level=True)
    engine = AsyncLLM.from_engine_args(
        EngineArgs(
            model=str(path),
            dtype="float32",
            num_kv_blocks=128,
            max_model_len=1024,
            engine_in_process=True,
        )
    )
    with LiveServer(engine, chat_template=TOOL_TEMPLATE, tool_call_parser="hermes") as live:
        yield live


def test_a_tool_aware_template_gets_tools_and_calls_natively(template_server: LiveServer) -> None:
    url = template_server.url
    tokens = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    text = httpx.post(f"{url}/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text == (
        "system:Be brief.;user:Weather?;"
        'assistant:CALL:f{"a": 1}CALL:f{};tool:one@call_1;tool:two@call_2;'
    )
    # The tool list goes through the template's own `tools` (not the built-in prompt).
    plain = {"messages": MESSAGES[:2], "max_tokens": 1}
    without = httpx.post(f"{url}/v1/chat/completions", json=plain).json()["usage"]
    with_tools = httpx.post(f"{url}/v1/chat/completions", json=plain | {"tools": [TOOL]}).json()
    tools_text = 'TOOLS:[{"type": "function", "function": {"name": "f", "parameters": '
    expected = len(httpx.post(f"{url}/tokenize", json={"prompt": tools_text}).json()["tokens"])
    assert with_tools["usage"]["prompt_tokens"] > without["prompt_tokens"] + expected - 3


def test_auto_without_parallel_calls_stops_after_the_first_call() -> None:
    tools = [Tool.model_validate(TOOL)]
    auto_single = plan_tools(tools, "auto", False, Hermes(), "")
    assert auto_single is not None and auto_single.stop() == ("</tool_call>",)
    assert auto_single.constraint() is None  # auto is the model's own choice
    required = plan_tools(tools, "required", False, Hermes(), "")
    assert required is not None and required.stop() == ()  # the grammar allows one call
    assert required.constraint() is not None
    assert plan_tools(tools, "none", None, Hermes(), "") is None  # tools are not even shown
