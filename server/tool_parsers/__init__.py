"""Tool-call formats: each model family's way of writing calls, read back the same way
whole or streamed (see base), and the grammar that makes a model write them.

`--tool-call-parser auto` (the default) picks the format from the chat template and logs
its choice; a template without tool support gets none, and a request with tools then gets
a 400 that names the flag to set.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from server.tool_parsers.base import (
    CallParser,
    Parsed,
    ParsedCall,
    ToolCallStream,
    ToolFormat,
    tool_call_dicts,
)
from server.tool_parsers.granite import Granite
from server.tool_parsers.hermes import Hermes
from server.tool_parsers.llama3_json import Llama3Json
from server.tool_parsers.mistral import Mistral
from server.tool_parsers.pythonic import Pythonic
from server.tool_parsers.qwen3_coder import Qwen3Coder

logger = logging.getLogger(__name__)

# In the order `auto` tries them: Qwen3-Coder's templates also contain <tool_call>.
FORMATS: dict[str, type[ToolFormat]] = {
    f.name: f for f in (Qwen3Coder, Hermes, Mistral, Granite, Pythonic, Llama3Json)
}
# vLLM's names for the same formats.
ALIASES = {"llama4_json": "llama3_json", "llama4_pythonic": "pythonic"}
CHOICES = ("auto", *sorted(FORMATS), *sorted(ALIASES), "none")


def template_supports_tools(template: str | None) -> bool:
    return template is not None and re.search(r"\btools\b", template) is not None


def detect(template: str | None) -> type[ToolFormat] | None:
    """The format a tool-aware chat template renders calls in, if one is known."""
    if template is None or not template_supports_tools(template):
        return None
    return next((f for f in FORMATS.values() if f.recognises(template)), None)


def resolve(setting: str, template: str | None, tokenizer: Any) -> ToolFormat | None:
    """The server's tool format for --tool-call-parser `setting` (None: tools are refused,
    see `refusal`)."""
    if setting == "none":
        return None
    if setting != "auto":
        return FORMATS[ALIASES.get(setting, setting)](tokenizer, template)
    found = detect(template)
    if found is None:
        logger.info("--tool-call-parser auto: %s", refusal(setting, template))
        return None
    logger.info("--tool-call-parser auto: the chat template writes %s tool calls", found.name)
    return found(tokenizer, template)


def refusal(setting: str, template: str | None) -> str:
    """Why a server with --tool-call-parser `setting` has no tool format, and what to do."""
    if setting == "none":
        return "tool calling is off on this server (--tool-call-parser none)"
    if not template_supports_tools(template):
        return (
            "this model's chat template has no tool support; start the server with "
            "--tool-call-parser hermes to describe the tools in the system prompt and read "
            "Hermes-style calls, or give a tool-aware template with --chat-template"
        )
    return (
        "the chat template's tool-call format is not one this server recognises; start "
        f"the server with --tool-call-parser set to the model's format ({', '.join(FORMATS)})"
    )


__all__ = [
    "ALIASES",
    "CHOICES",
    "FORMATS",
    "CallParser",
    "Granite",
    "Hermes",
    "Llama3Json",
    "Mistral",
    "Parsed",
    "ParsedCall",
    "Pythonic",
    "Qwen3Coder",
    "ToolCallStream",
    "ToolFormat",
    "detect",
    "refusal",
    "resolve",
    "template_supports_tools",
    "tool_call_dicts",
]
