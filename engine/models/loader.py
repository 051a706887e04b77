"""Weight loading from a local Hugging Face directory (safetensors) or a GGUF file.

Nothing is fetched from a hub: a model is a path on disk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from engine.config import QuantConfig
from engine.models.arch import ModelArch
from engine.models.gemma3 import Gemma3Model, is_gemma3_norm
from engine.models.gguf_weights import iter_gguf
from engine.models.gpt_oss import GptOssModel
from engine.models.hf_config import (
    eos_token_ids,
    find_gguf_weights,
    load_hf_config,
    resolve_model_path,
)
from engine.models.layers import Linear, rotate_half_order
from engine.models.llama import Attention, DecoderModel
from engine.models.moe import expert_tensors
from engine.models.quantized import QuantizedWeight, quantize_int4, quantize_int8

# int8 quantizes the LM head in groups of 32 (GGUF Q8_0's format) rather than per channel:
# on the default model, per channel cost 2 points of greedy top-1 agreement against float32
# (94.2% against 96.2% for the float head on the held-out text); groups of 32 cost nothing.
INT8_HEAD_GROUP = 32


def load_model(
    model: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    quant: QuantConfig | None = None,
    shard: Callable[[DecoderModel], DecoderModel] | None = None,
    lm_head: bool = True,
) -> tuple[DecoderModel, ModelArch]:
    """Builds the decoder and fills every parameter; raises if any is left unfilled.
    Without `lm_head` (an embedding model) it has none, and skips the checkpoint's.

    `shard` (tensor parallelism) turns the loaded float model into this rank's shard
    before it moves to `device`, so that only the shard reaches it.

    `quant` says how weights run: "gguf" keeps a GGUF file's Q4_0/Q4_1/Q8_0 tensors
    quantized (the file is the model itself or the one in its directory; a mixture of
    experts' too, one weight per expert); "int8"/"int4" quantize float weights after
    loading (not a mixture of experts'); "none" (the default) serves float weights, from
    safetensors when the directory has them, else from the dequantized GGUF file.
    """
    quant = quant or QuantConfig()
    folder, gguf_file = resolve_model_path(model)
    hf_config = load_hf_config(folder, gguf_file)
    arch = ModelArch.from_hf_config(hf_config, eos_token_ids(folder, hf_config))
    gguf = find_gguf_weights(folder, gguf_file)
    if quant.method == "gguf" and gguf is None:
        raise ValueError(f"{model}: no GGUF file to run as stored")
    use_gguf = gguf is not None and (
        quant.method == "gguf" or not any(folder.glob("*.safetensors"))
    )
    check_weights(arch, quant, use_gguf)
    model_class = _MODEL_CLASSES.get(arch.model_type, DecoderModel)
    decoder = model_class(arch, lm_head).to(dtype)
    tensors = (
        iter_gguf(gguf, arch, keep_quantized=quant.method == "gguf")
        if use_gguf and gguf is not None
        else _iter_safetensors(folder)
    )
    WeightLoader(decoder, arch).load(tensors)
    if shard is not None:
        decoder = shard(decoder)
    if quant.method in ("int8", "int4"):
        quantize_model(decoder, quant)
    decoder = decoder.to(device).eval()
    decoder.pack_weights(quant.dense_copy and quant.method != "none")
    return decoder, arch


# The model types whose decoder is not llama.py's own.
_MODEL_CLASSES: dict[str, type[DecoderModel]] = {
    "gemma3_text": Gemma3Model,
    "gpt_oss": GptOssModel,
}

# llama.cpp architectures whose GGUF tensors iter_gguf does not map: Phi-3's files fuse the
# attention's and the MLP's projections (attn_qkv, a double-height ffn_up) and hold longrope's
# factors as tensors; Gemma 3's have norms iter_gguf does not name, gpt-oss's MXFP4 experts.
_GGUF_UNMAPPED = ("phi3", "gemma3_text", "gpt_oss")


def check_weights(arch: ModelArch, quant: QuantConfig, use_gguf: bool) -> None:
    """Raises ValueError for weights `arch` cannot run on (README.md's table of
    architectures says which, checked against this by tests/test_readme_architectures.py)."""
    if arch.is_moe:
        _check_moe_quantization(arch, quant)
    if use_gguf and arch.model_type in _GGUF_UNMAPPED:
        raise ValueError(
            f"GGUF weights are not supported for {arch.model_type} models (their fused "
            "tensors have no mapping here); serve a Hugging Face safetensors directory"
        )


def _check_moe_quantization(arch: ModelArch, quant: QuantConfig) -> None:
    """Raises ValueError for a quantization a mixture-of-experts model cannot load: its
    experts run on float weights or on a GGUF file's own quantized ones, but are not
    quantized at load time."""
    if quant.method in ("int8", "int4"):
        raise ValueError(
            f"--quantization {quant.method} is not supported for mixture-of-experts models "
            f"({arch.model_type}); use --quantization none, or gguf with a GGUF file"
        )


def quantize_model(model: DecoderModel, quant: QuantConfig) -> None:
    """Replaces every float linear layer's weight (and, with quant.lm_head, the LM head's)
    by its int8/int4 quantization."""

    def quantize(weight: torch.Tensor) -> QuantizedWeight:
        if quant.method == "int8":
            return quantize_int8(weight)
        return quantize_int4(weight, quant.group_size)

    for module in model.modules():
        if isinstance(module, Linear) and module.weight is not None:
            module.quantize(quantize(module.weight))
    if quant.lm_head and model.has_lm_head and model.quantized_head is None:
        head = model.embed_tokens if model.lm_head is None else model.lm_head
        int8 = quant.method == "int8"
        model.quantize_head(quantize_int8(head, INT8_HEAD_GROUP) if int8 else quantize(head))


class WeightLoader:
    """Copies checkpoint tensors (Hugging Face names) into the fused parameters; quantized
    tensors (QuantizedWeight) replace their layer's weight, fused ones concatenated by rows."""

    def __init__(self, model: DecoderModel, arch: ModelArch) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.arch = arch
        self.filled: set[str] = set()
        self.shards: dict[str, list[tuple[int, QuantizedWeight]]] = {}

    def load(self, tensors: Iterator[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        # gpt-oss keeps its experts stacked, as transformers stores them.
        split_experts = self.arch.model_type != "gpt_oss"
        for checkpoint_name, checkpoint_tensor in tensors:
            if not split_experts:
                self._load_one(checkpoint_name, checkpoint_tensor)
                continue
            for name, tensor in expert_tensors(checkpoint_name, checkpoint_tensor):
                self._load_one(name, tensor)
        for target, shards in self.shards.items():
            self._install_quantized(target, [w for _, w in sorted(shards, key=lambda s: s[0])])
        missing = sorted(set(self.params) - self.filled)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}")
        if self.arch.rotary_dim is not None:
            self._reorder_rotary_dims(self.arch.rotary_dim)

    def _reorder_rotary_dims(self, rotary_dim: int) -> None:
        """Puts every query and key head's dims in layers.rotate_half_order, where the
        rotary embedding turns part of each head (the values keep their order)."""
        a = self.arch
        heads = torch.arange(a.num_heads + a.num_kv_heads)[:, None] * a.head_dim
        rows = (heads + rotate_half_order(a.head_dim, rotary_dim)).flatten()  # q and k rows
        for attention in self.model.modules():
            if not isinstance(attention, Attention):
                continue
            qkv = attention.qkv_proj
            if qkv.weight is None:
                raise ValueError("partial rotary embeddings need float query and key weights")
            for param in (qkv.weight, qkv.bias):
                if param is not None:
                    param.data[: len(rows)] = param.data[rows]

    def _load_one(self, name: str, tensor: torch.Tensor | QuantizedWeight) -> None:
        if "rotary_emb" in name or (name == "lm_head.weight" and self.model.lm_head is None):
            return  # tied to the embeddings, or an embedding model's
        target, rows = self._target(name.removeprefix("model."))
        param = self.params.get(target)
        if param is None:
            raise ValueError(f"unexpected weight {name!r} in the checkpoint")
        dest = param.data if rows is None else param.data[rows[0] : rows[1]]
        if dest.shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        if self.arch.model_type == "gemma3_text" and is_gemma3_norm(name):
            assert isinstance(tensor, torch.Tensor)
            tensor = tensor.float() + 1.0  # Gemma 3's norms scale by (1 + weight)
        if isinstance(tensor, QuantizedWeight):
            self.shards.setdefault(target, []).append((0 if rows is None else rows[0], tensor))
        else:
            dest.copy_(tensor)
        self.filled.add(target)

    def _install_quantized(self, target: str, parts: list[QuantizedWeight]) -> None:
        weight = parts[0] if len(parts) == 1 else QuantizedWeight.cat(parts)
        if weight.shape != tuple(self.params[target].shape):
            raise ValueError(f"{target}: the checkpoint's quantized shards do not fill it")
        if target == "embed_tokens":
            self.model.quantize_embedding(weight)
        elif target == "lm_head":
            self.model.quantize_head(weight)
        else:
            module = self.model.get_submodule(target.removesuffix(".weight"))
            assert isinstance(module, Linear), target
            module.quantize(weight)

    def _target(self, name: str) -> tuple[str, tuple[int, int] | None]:
        """Our parameter name, and the rows of it this tensor fills (for fused ones)."""
        a = self.arch
        if name == "embed_tokens.weight":
            return "embed_tokens", None
        if name == "lm_head.weight":
            return "lm_head", None
        prefix, _, leaf = name.rpartition(".")
        qkv = {
            "q_proj": (0, a.q_size),
            "k_proj": (a.q_size, a.q_size + a.kv_size),
            "v_proj": (a.q_size + a.kv_size, a.q_size + 2 * a.kv_size),
        }
        layer, _, module = prefix.partition(".")
        layer_idx, _, module = module.partition(".")
        parent, _, proj = module.rpartition(".")  # e.g. "mlp.experts.3", "gate_proj"
        if layer != "layers":
            return name, None
        if parent == "self_attn" and proj in qkv:
            return f"layers.{layer_idx}.self_attn.qkv_proj.{leaf}", qkv[proj]
        fused = f"layers.{layer_idx}.{parent}.gate_up_proj.{leaf}"
        if proj in ("gate_proj", "up_proj") and fused in self.params:
            # A dense MLP's or an expert's: their intermediate sizes differ (Qwen3-MoE).
            half = len(self.params[fused]) // 2
            return fused, (0, half) if proj == "gate_proj" else (half, 2 * half)
        return name, None


def _iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    names = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names += [(file, key) for key in f.keys()]  # noqa: SIM118 (safe_open has no __iter__)
    handles: dict[Path, Any] = {}
    for file, key in tqdm(names, desc="Loading weights", unit="tensor", leave=False):
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt")
        yield key, handles[file].get_tensor(key)
