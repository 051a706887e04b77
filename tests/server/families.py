"""Tiny random-weight models of real model families: the family's own chat template (from
tests/data/chat_templates, byte-exact upstream copies), its special tokens in a small
byte-level tokenizer, and a config of its architecture."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.tiny_models import BYTE_VOCAB, make_config, save_byte_tokenizer

TEMPLATES = Path(__file__).parent.parent / "data" / "chat_templates"


@dataclass(frozen=True)
class Family:
    name: str
    template: str  # file name under TEMPLATES
    arch: str  # a tests.tiny_models.make_config kind
    bos: str | None
    eos: str
    special: tuple[str, ...] = ()  # control tokens (special: dropped from text by default)
    added: tuple[str, ...] = ()  # marker tokens that stay in the text
    flags: dict[str, Any] = field(default_factory=dict)  # ServerSettings for the family

    def template_text(self) -> str:
        return (TEMPLATES / self.template).read_text()


_QWEN = ("<|im_start|>", "<|im_end|>")
_QWEN_MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                 "</tool_response>")  # fmt: skip
_LLAMA = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
          "<|eom_id|>", "<|python_tag|>")  # fmt: skip
_MISTRAL = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
            "[ARGS]", "[CALL_ID]", "[TOOL_CONTENT]")  # fmt: skip
_DEEPSEEK = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")
_GRANITE = ("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<|tool_call|>")

FAMILIES = {
    f.name: f
    for f in (
        Family("qwen3", "qwen3.jinja", "qwen3", None, "<|im_end|>", _QWEN, _QWEN_MARKERS,
               {"reasoning_parser": "qwen3"}),
        Family("qwen3_coder", "qwen3_coder.jinja", "qwen3", None, "<|im_end|>", _QWEN,
               ("<tool_call>", "</tool_call>")),
        Family("deepseek_r1", "deepseek_r1_distill_qwen.jinja", "qwen2", _DEEPSEEK[0],
               _DEEPSEEK[1], _DEEPSEEK, ("<think>", "</think>"),
               {"reasoning_parser": "deepseek_r1", "tool_call_parser": "hermes"}),
        Family("llama3_json", "llama3_2.jinja", "llama", "<|begin_of_text|>", "<|eot_id|>",
               _LLAMA),
        Family("pythonic", "llama3_2_pythonic.jinja", "llama", "<|begin_of_text|>",
               "<|eot_id|>", _LLAMA),
        Family("mistral_nemo", "mistral_nemo.jinja", "mistral", "<s>", "</s>", _MISTRAL),
        Family("mistral_small_3_2", "mistral_small_3_2.jinja", "mistral", "<s>", "</s>",
               _MISTRAL),
        Family("hermes3", "hermes3.jinja", "llama", "<|begin_of_text|>", "<|im_end|>", _QWEN,
               ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")),
        Family("granite", "granite_3_3.jinja", "llama", None, "<|end_of_text|>", _GRANITE,
               ("<think>", "</think>", "<response>", "</response>"),
               {"reasoning_parser": "granite"}),
    )
}  # fmt: skip


def make_family_model(family: Family, path: Path, seed: int = 0) -> Path:
    """Saves a random-weight model of the family's architecture with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    save_byte_tokenizer(path)
    config = make_config(family.arch, BYTE_VOCAB, 4096)
    # The architecture's tokenizer class (loaded by AutoTokenizer from the config) may add
    # tokens of its own: the vocabulary is counted once the tokenizer is as the server loads it.
    config.save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": list(family.special)})
    tokenizer.add_tokens(list(family.added))
    tokenizer.bos_token = family.bos
    tokenizer.eos_token = family.eos
    tokenizer.chat_template = family.template_text()
    tokenizer.save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)

    torch.manual_seed(seed)
    config.vocab_size = len(tokenizer)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path
