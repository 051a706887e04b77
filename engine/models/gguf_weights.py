"""Reading a llama.cpp GGUF file's tensors under Hugging Face names.

Q4_0, Q4_1 and Q8_0 tensors can stay quantized (as QuantizedWeight, repacked exactly);
every other type is dequantized to float32 with gguf's own dequantizer, and a log line says
which tensors were.

A mixture-of-experts layer (Qwen3-MoE, Mixtral) stores its router as `ffn_gate_inp` and each
of its experts' three projections stacked in one 3-D tensor, (experts, N, K) in numpy's
order (GGUF lists the dimensions the other way round, (K, N, experts)):

    blk.3.ffn_gate_exps.weight  (8, 32, 64)  ->  model.layers.3.mlp.experts.0.gate_proj.weight
                                                 ... model.layers.3.mlp.experts.7.gate_proj.weight

Each expert's slice is its own weight, quantized or not: a Q4_0 stack becomes eight Q4_0
weights, each run by the quantized kernel.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from engine.models.arch import ModelArch
from engine.models.gguf_file import GGUFFile
from engine.models.quantized import GGUF_BLOCK_TYPES, QuantizedWeight, from_gguf

logger = logging.getLogger(__name__)

# GGUF tensor names (llama.cpp) -> Hugging Face names.
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the MoE router
}
# A layer's experts, stacked: one expert's slice of each is that expert's projection.
_EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_FLOAT_TYPES = ("F32", "F16", "BF16")


def hf_name(gguf_name: str) -> str:
    if gguf_name in _NAMES:
        return _NAMES[gguf_name]
    match = _LAYER.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    layer, module, leaf = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[module]}.{leaf}"


def split_experts(gguf_name: str, data: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """A stack of a layer's experts as one (Hugging Face name, slice) per expert, in expert
    order; any other tensor as (its name, data). `data` is the tensor as the reader holds
    it: floats, or a quantized type's raw blocks, (experts, N, bytes per row)."""
    match = _LAYER.fullmatch(gguf_name)
    if match is None or match.group(2) not in _EXPERT_NAMES:
        yield hf_name(gguf_name), data
        return
    layer, module, leaf = match.groups()
    if data.ndim != 3:
        raise ValueError(f"{gguf_name}: shape {data.shape}, expected (experts, rows, columns)")
    for expert, part in enumerate(data):
        yield f"model.layers.{layer}.mlp.experts.{expert}.{_EXPERT_NAMES[module]}.{leaf}", part


def rope_row_order(num_rows: int, num_heads: int) -> np.ndarray:
    """The row permutation that undoes llama.cpp's Q/K layout (interleaved -> rotate-half
    rotary): row i of the Hugging Face weight is row order[i] of the GGUF one."""
    half = num_rows // num_heads // 2
    rows = np.arange(num_rows).reshape(num_heads, half, 2)
    return rows.swapaxes(1, 2).reshape(num_rows)


def iter_gguf(
    path: Path, arch: ModelArch, keep_quantized: bool
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(Hugging Face name, float32 tensor or QuantizedWeight) for every tensor of the file."""
    import gguf

    reader = GGUFFile(path)
    llama_layout = reader.metadata.get("general.architecture") == "llama"
    dequantized: Counter[str] = Counter()
    for tensor in tqdm(reader.tensors, desc="Loading GGUF weights", unit="tensor", leave=False):
        type_name = tensor.tensor_type.name
        heads = None
        if llama_layout and ".attn_q." in tensor.name:
            heads = arch.num_heads
        elif llama_layout and ".attn_k." in tensor.name:
            heads = arch.num_kv_heads
        if keep_quantized and type_name in GGUF_BLOCK_TYPES:
            shape = (tensor.shape[1], tensor.shape[0])  # GGUF lists (K, N, ...)
            for name, raw in split_experts(tensor.name, tensor.data):
                weight = from_gguf(type_name, raw, shape)
                if heads is not None:
                    weight = weight.rows(rope_row_order(shape[0], heads))
                yield name, weight
            continue
        if type_name not in _FLOAT_TYPES:
            dequantized[type_name] += 1
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if heads is not None:
            data = data[rope_row_order(data.shape[0], heads)]
        for name, part in split_experts(tensor.name, data):
            # A copy: the reader hands out read-only views of the file.
            yield name, torch.from_numpy(np.array(part, dtype=np.float32))
    if dequantized:
        kept = "kept quantized: Q4_0, Q4_1, Q8_0" if keep_quantized else "quantization off"
        logger.info(
            "dequantized GGUF tensors to float32 on load (%s): %s",
            kept,
            ", ".join(f"{count} {kind}" for kind, count in sorted(dequantized.items())),
        )
