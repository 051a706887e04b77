"""Tiny random-weight models built with transformers' own config classes, saved to disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 256
# Byte-level BPE (save_byte_tokenizer): it can spell any text, JSON included.
BYTE_VOCAB = 512
_CORPUS = (
    '{"name": "Ada", "age": 36, "tags": ["math", "engine"], "ok": true, "none": null}\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    "The quick brown fox jumps over the lazy dog. 0123456789 -+.,:;!?()[]{}<>/\\'\"_=*&%$#@\n"
    "Structured outputs constrain what a model may write: objects, arrays, strings, numbers.\n"
)


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


def save_byte_tokenizer(path: Path) -> None:
    """A byte-level BPE of BYTE_VOCAB tokens trained on a small corpus: <unk>, <s>, </s>
    (EOS), the 256 byte tokens, merges, then plain filler tokens up to BYTE_VOCAB.

    Chat turns are "<s>ROLE\nCONTENT</s>\n"; the template has no tool support.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BYTE_VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.add_tokens([f"filler{i}" for i in range(BYTE_VOCAB - len(fast))])
    assert len(fast) == BYTE_VOCAB
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
    )
    fast.save_pretrained(path)


def make_config(kind: str, vocab_size: int = VOCAB, max_positions: int = 512):
    from transformers import (
        Gemma3TextConfig,
        GptOssConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
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
    if kind == "mistral":
        return MistralConfig(**common, sliding_window=None)
    # Sliding windows of 12 tokens, shorter than most test prompts: every layer's (Mistral),
    # from layer 1 on (Qwen2's max_window_layers).
    if kind == "mistral-swa":
        return MistralConfig(**common, sliding_window=12)
    if kind == "qwen2-swa":
        return Qwen2Config(
            **common, use_sliding_window=True, sliding_window=12, max_window_layers=1
        )
    if kind in ("gemma3", "gemma3_text"):
        # Local layers 0 and 1 (window 12, their own rope theta), global layer 2 (linear
        # rope scaling); a scale other than head_dim's, and a final logit cap.
        common.update(num_hidden_layers=3, tie_word_embeddings=True)
        return Gemma3TextConfig(
            **common,
            head_dim=16,
            sliding_window=12,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            final_logit_softcapping=5.0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            },
        )
    if kind == "qwen3":
        return Qwen3Config(**common, head_dim=16)
    if kind == "gpt_oss":
        # Layer 0 windowed (12 tokens), layer 1 full; 4 experts of 32, top-2; YaRN over an
        # original context of 64 (8 of the 16 dims interpolated or blended).
        common["intermediate_size"] = 32
        return GptOssConfig(
            **common,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=12,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        )
    # Mixture-of-experts: 8 experts of 32, top-2 (overrides set norm_topk_prob,
    # mlp_only_layers or decoder_sparse_step).
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(
            **common, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32
        )
    if kind == "mixtral":
        common["intermediate_size"] = 32  # each expert's
        return MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2)
    if kind == "phi3":
        return Phi3Config(**common, pad_token_id=0)
    if kind == "phi3-longrope":
        # Phi-4-mini's layout: longrope (its short factors, up to an original context of
        # 256 here) and rotary embeddings over 3/4 of each head (12 of 16 dims).
        return Phi3Config(
            **common,
            pad_token_id=0,
            original_max_position_embeddings=256,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.3, 1.9, 2.8, 4.0, 6.5],
                "long_factor": [2.0, 3.0, 5.0, 8.0, 13.0, 21.0],
            },
        )
    raise ValueError(kind)


def make_tiny_model(
    kind: str, path: Path, seed: int = 0, byte_level: bool = False, **overrides: object
) -> Path:
    """Saves a random-weight model of `kind` (llama, llama3-rope, qwen2, qwen3, qwen3_moe,
    mixtral, phi3, phi3-longrope, mistral-swa, qwen2-swa, gemma3, gpt_oss) to `path`, with the
    word-level tokenizer, or with the byte-level one when `byte_level`; `overrides` change
    its config (e.g. hidden_size=256, head_dim=64)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    # Byte-level prompts are long (a tool list is a few hundred tokens).
    config = make_config(kind, *((BYTE_VOCAB, 2048) if byte_level else (VOCAB, 512)))
    config.update(overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Gemma 3's norms start at 0 (a scale of 1), gpt-oss's sinks and biases may: make each
    # one count.
    starts_plain = ("norm.weight",) if kind.startswith("gemma3") else ("sinks", "bias")
    if kind.startswith(("gemma3", "gpt_oss")):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(starts_plain):
                    param.normal_(0.0, 0.5 if name.endswith("sinks") else 0.2)
    model.save_pretrained(path)
    (save_byte_tokenizer if byte_level else save_word_tokenizer)(path)
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


def make_tiny_embedding_model(path: Path, **config: object) -> Path:
    """A tiny random-weight Qwen3 (byte-level tokenizer) saved as a sentence-transformers
    model the way Qwen3-Embedding is: the decoder, last-token pooling, then Normalize.
    `config` adds keys to its config.json (e.g. matryoshka_dimensions)."""
    import json

    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    decoder = make_tiny_model("qwen3", path / "decoder", byte_level=True)
    # Sentence-transformers 6 renders text through a tokenizer's chat template, where it has
    # one; an embedding model has none, so texts are embedded as they are (as OpenAI does).
    (decoder / "chat_template.jinja").unlink()
    transformer = Transformer(str(decoder))
    transformer.tokenizer.pad_token = "<unk>"  # batches need one; last-token pooling skips it
    pooling = Pooling(transformer.get_embedding_dimension(), "lasttoken")
    model = SentenceTransformer(modules=[transformer, pooling, Normalize()], device="cpu")
    target = path / "embedding"
    model.save(str(target))
    hf_config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(hf_config | config, indent=2))
    return target


def make_lora_adapter(
    base: Path,
    path: Path,
    seed: int,
    rank: int,
    targets: list[str],
    alpha: float = 16.0,
    **config: object,
) -> Path:
    """Saves a PEFT LoRA adapter for the model at `base` to `path`, with random A and B
    (PEFT's init_lora_weights=False: neither is zero, so the adapter changes the output)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    lora = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **config
    )
    get_peft_model(model, lora).save_pretrained(path)
    return path


def peft_merged_greedy(
    base: Path, adapter: Path, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """Reference: PEFT's merged model (the adapter folded into the weights), transformers'
    greedy generate, one prompt at a time."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return greedy_tokens(merged, prompts, max_tokens)


def greedy_tokens(model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy generate of `model`, one unpadded prompt at a time, end tokens
    ignored: the new tokens of each."""
    outputs = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs
