"""Tiny random-weight mixture-of-experts models written as GGUF files the way llama.cpp's
convert_hf_to_gguf.py writes them, with the `gguf` package's writer:

- Qwen3-MoE as architecture `qwen3moe`, Mixtral as `llama` with `llama.expert_count`;
- per layer a router `ffn_gate_inp` (float32, as llama.cpp keeps it) and each projection of
  every expert stacked in one 3-D tensor, `ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`;
- `llama` files store Q and K with their rows permuted for llama.cpp's rotary layout;
- the tokenizer as metadata: byte-level BPE (`gpt2`) for Qwen3-MoE, sentencepiece (`llama`)
  for Mixtral, each of the models' 256 tokens.

Each model is also saved as a Hugging Face directory holding exactly the weights the file
holds, dequantized by gguf's own dequantizer: transformers' reference for the file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.tiny_models import VOCAB, make_config, save_word_tokenizer

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}


def make_tiny_gguf(
    kind: str, folder: Path, linear: str = "F32", experts: str = "F32", seed: int = 0
) -> tuple[Path, Path]:
    """(the GGUF file, its Hugging Face twin) of a random `kind` (qwen3_moe, mixtral) model:
    linear weights (attention, embeddings, head) in type `linear`, experts in `experts`
    (F32, F16, Q8_0, Q4_0, Q4_1); norms and routers in F32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = make_config(kind)
    config.rms_norm_eps = float(np.float32(config.rms_norm_eps))  # as the file holds it
    if kind == "qwen3_moe":
        config.norm_topk_prob = True  # llama.cpp's qwen3moe always renormalises
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    stored = _store(model, linear, experts)
    path = folder / "gguf" / f"tiny-{kind}.gguf"
    path.parent.mkdir(parents=True)
    write_gguf(path, config, stored)
    model.save_pretrained(folder / "hf")
    save_word_tokenizer(folder / "hf")
    return path, folder / "hf"


def _store(model: Any, linear: str, experts: str) -> dict[str, tuple[np.ndarray, str]]:
    """Each weight of `model` as the file stores it, (data, GGUF type) by its Hugging Face
    name; the model's weights become the stored ones, dequantized."""
    stored = {}
    with torch.no_grad():
        for name, param in model.state_dict().items():
            kind = experts if ".experts." in name else linear
            if param.dim() == 1 or name.endswith("mlp.gate.weight"):
                kind = "F32"
            data, dequantized = _encode(param.numpy(), kind)
            param.copy_(torch.from_numpy(dequantized))
            stored[name] = (data, kind)
    return stored


def _encode(weight: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(the stored data, what it dequantizes to) of a float32 weight in GGUF type `kind`."""
    import gguf

    if kind == "F32":
        return weight, weight
    if kind == "F16":
        half = weight.astype(np.float16)
        return half, half.astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(weight, qtype)
    return raw, gguf.quants.dequantize(raw, qtype).astype(np.float32)


def llama_cpp_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order for its `llama` graph: in each head, the first and second
    halves' rows interleaved (HF row j of half h goes to 2 j + h). Rows are independent, so
    a quantized type's raw rows permute the same way."""
    shape = rows.shape
    half = shape[0] // num_heads // 2
    return rows.reshape(num_heads, 2, half, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _tensors(
    stored: dict[str, tuple[np.ndarray, str]], config: Any, llama: bool
) -> Iterator[tuple[str, np.ndarray, str]]:
    """(GGUF name, data, type) of every tensor, as llama.cpp's converter names them."""
    yield "token_embd.weight", *stored["model.embed_tokens.weight"]
    yield "output_norm.weight", *stored["model.norm.weight"]
    yield "output.weight", *stored["lm_head.weight"]
    heads = {"q": config.num_attention_heads, "k": config.num_key_value_heads}
    for i in range(config.num_hidden_layers):

        def hf(name: str, i: int = i) -> tuple[np.ndarray, str]:
            return stored[f"model.layers.{i}.{name}"]

        blk = f"blk.{i}"
        yield f"{blk}.attn_norm.weight", *hf("input_layernorm.weight")
        for proj in "qkv":
            data, kind = hf(f"self_attn.{proj}_proj.weight")
            if llama and proj in heads:
                data = llama_cpp_permute(data, heads[proj])
            yield f"{blk}.attn_{proj}.weight", data, kind
        yield f"{blk}.attn_output.weight", *hf("self_attn.o_proj.weight")
        if not llama:
            yield f"{blk}.attn_q_norm.weight", *hf("self_attn.q_norm.weight")
            yield f"{blk}.attn_k_norm.weight", *hf("self_attn.k_norm.weight")
        yield f"{blk}.ffn_norm.weight", *hf("post_attention_layernorm.weight")
        yield f"{blk}.ffn_gate_inp.weight", *hf("mlp.gate.weight")
        # transformers stacks gate and up as one (experts, 2 * width, hidden) tensor.
        gate_up, kind = hf("mlp.experts.gate_up_proj")
        width = gate_up.shape[1] // 2
        yield f"{blk}.ffn_gate_exps.weight", gate_up[:, :width], kind
        yield f"{blk}.ffn_up_exps.weight", gate_up[:, width:], kind
        yield f"{blk}.ffn_down_exps.weight", *hf("mlp.experts.down_proj")


def write_gguf(path: Path, config: Any, stored: dict[str, tuple[np.ndarray, str]]) -> None:
    import gguf

    arch = GGUF_ARCH[config.model_type]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny-{config.model_type}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    # Mixtral's is each expert's width; Qwen3-MoE's a dense MLP's, its experts' below.
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    else:
        writer.add_expert_count(config.num_local_experts)
        head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
        writer.add_rope_dimension_count(head_dim)
        writer.add_vocab_size(config.vocab_size)
    _add_tokenizer(writer, sentencepiece=arch == "llama")
    for name, data, kind in _tensors(stored, config, arch == "llama"):
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, np.ascontiguousarray(data), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_tokenizer(writer: Any, sentencepiece: bool) -> None:
    """A VOCAB-token vocabulary as GGUF metadata: <unk>, <s>, </s>, then tests/tiny_models.py's
    words t3..t255 (sentencepiece), or byte-level tokens and one merge (BPE: llama.cpp's
    converter always writes merges, and a GGUF file cannot hold an empty list)."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    special = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.NORMAL] * (VOCAB - 3)
    if sentencepiece:
        tokens = special + [f"t{i}" for i in range(3, VOCAB)]
        writer.add_tokenizer_model("llama")
        writer.add_token_scores([0.0] * 3 + [-float(i) for i in range(3, VOCAB)])
    else:
        chars = sorted(bytes_to_unicode().values())[: VOCAB - 4]
        tokens = special + chars + [chars[0] + chars[1]]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_merges([f"{chars[0]} {chars[1]}"])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
