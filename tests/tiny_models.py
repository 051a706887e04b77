"""Tiny random-weight models built with transformers' own config classes, saved to disk."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 256


def save_word_tokenizer(path: Path) -> None:
    """A word-level tokenizer: <unk>, <s>, </s>, then words t3..t255 as ids 3..255.

    Special tokens must not be substrings of words: the tokenizer splits on them first.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    # Roles become marker tokens; message words that are not t3..t255 map to <unk>.
    fast.chat_template = (
        "{% for m in messages %}{{ 't3 ' if m['role'] == 'user' else 't4 ' }}"
        "{{ m['content'] }} t5 {% endfor %}{% if add_generation_prompt %}t6 {% endif %}"
    )
    fast.save_pretrained(path)


def make_config(kind: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    if kind == "llama":
        return LlamaConfig(**common)
    if kind == "llama3-rope":
        return LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if kind == "qwen2":
        return Qwen2Config(**common)
    if kind == "qwen3":
        return Qwen3Config(**common, head_dim=16)
    raise ValueError(kind)


def make_tiny_model(kind: str, path: Path, seed: int = 0, **overrides: object) -> Path:
    """Saves a random-weight model of `kind` (llama, llama3-rope, qwen2, qwen3) to `path`;
    `overrides` change its config (e.g. hidden_size=256, head_dim=64)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = make_config(kind)
    config.update(overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    save_word_tokenizer(path)
    return path


def make_cycle_model(path: Path, text: str) -> Path:
    """A byte-level model whose greedy output repeats `text` (UTF-8) forever.

    After a token that is one of text's bytes it emits the byte that follows it in `text`,
    cyclically, so each byte may occur in `text` once. Its layers are zeroed: the hidden
    state is the current token's embedding (a random unit vector), and the LM head row of
    each byte's successor is that embedding. Tokens are bytes 0-255 (byte fallback, as
    Llama's tokenizer has), then <unk>, <s>, </s>.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    data = text.encode()
    assert len(set(data)) == len(data), "every byte of `text` must be distinct"
    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"<unk>": 256, "<s>": 257, "</s>": 258}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)

    config = make_config("llama")
    config.vocab_size, config.bos_token_id, config.eos_token_id = 259, 257, 258
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = torch.nn.functional.normalize(torch.randn(259, config.hidden_size), dim=-1)
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.zero_()
        for i, byte in enumerate(data):
            model.lm_head.weight[data[(i + 1) % len(data)]] = embed[byte]
    model.save_pretrained(path)
    return path
