"""Weight loading from a local Hugging Face directory (safetensors) or a GGUF file.

Nothing is fetched from a hub: a model is a path on disk.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from engine.models.arch import ModelArch
from engine.models.hf_config import eos_token_ids, load_hf_config, resolve_model_path
from engine.models.llama import DecoderModel

# GGUF tensor names (llama.cpp) -> Hugging Face names.
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
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
}
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def load_model(
    model: str | Path, dtype: torch.dtype, device: torch.device | str
) -> tuple[DecoderModel, ModelArch]:
    """Builds the decoder and fills every parameter; raises if any is left unfilled."""
    folder, gguf_file = resolve_model_path(model)
    hf_config = load_hf_config(folder, gguf_file)
    arch = ModelArch.from_hf_config(hf_config, eos_token_ids(folder, hf_config))
    decoder = DecoderModel(arch).to(dtype)
    tensors = (
        _iter_gguf(folder / gguf_file, arch) if gguf_file is not None else _iter_safetensors(folder)
    )
    WeightLoader(decoder, arch).load(tensors)
    decoder = decoder.to(device).eval()
    decoder.pack_weights()
    return decoder, arch


class WeightLoader:
    """Copies checkpoint tensors (Hugging Face names) into the fused parameters."""

    def __init__(self, model: DecoderModel, arch: ModelArch) -> None:
        self.params = dict(model.named_parameters())
        self.arch = arch
        self.filled: set[str] = set()

    def load(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in tensors:
            self._load_one(name, tensor)
        missing = sorted(set(self.params) - self.filled)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}")

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        if "rotary_emb" in name or (name == "lm_head.weight" and self.arch.tie_word_embeddings):
            return
        target, rows = self._target(name.removeprefix("model."))
        param = self.params.get(target)
        if param is None:
            raise ValueError(f"unexpected weight {name!r} in the checkpoint")
        dest = param.data if rows is None else param.data[rows[0] : rows[1]]
        if dest.shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        self.filled.add(target)

    def _target(self, name: str) -> tuple[str, tuple[int, int] | None]:
        """Our parameter name, and the rows of it this tensor fills (for fused ones)."""
        a = self.arch
        if name == "embed_tokens.weight":
            return "embed_tokens", None
        if name == "lm_head.weight":
            return "lm_head", None
        prefix, _, leaf = name.rpartition(".")
        shards = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, a.q_size),
            "self_attn.k_proj": ("self_attn.qkv_proj", a.q_size, a.q_size + a.kv_size),
            "self_attn.v_proj": (
                "self_attn.qkv_proj",
                a.q_size + a.kv_size,
                a.q_size + 2 * a.kv_size,
            ),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, a.intermediate_size),
            "mlp.up_proj": ("mlp.gate_up_proj", a.intermediate_size, 2 * a.intermediate_size),
        }
        layer, _, module = prefix.partition(".")
        layer_idx, _, module = module.partition(".")
        if layer == "layers" and module in shards:
            fused, start, end = shards[module]
            return f"layers.{layer_idx}.{fused}.{leaf}", (start, end)
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


def _unpermute_rope(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation (interleaved -> rotate-half rotary layout)."""
    half = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return w.swapaxes(1, 2).reshape(weights.shape)


def _iter_gguf(path: Path, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    reader = gguf.GGUFReader(path)
    gguf_arch = str(reader.fields["general.architecture"].contents())
    for tensor in tqdm(reader.tensors, desc="Loading GGUF weights", unit="tensor", leave=False):
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        name = _hf_name(tensor.name)
        if gguf_arch == "llama" and ".attn_q." in tensor.name:
            data = _unpermute_rope(data, arch.num_heads)
        elif gguf_arch == "llama" and ".attn_k." in tensor.name:
            data = _unpermute_rope(data, arch.num_kv_heads)
        # A copy: the reader hands out read-only views of the file.
        yield name, torch.from_numpy(np.array(data, dtype=np.float32))


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_NAMES:
        return _GGUF_NAMES[gguf_name]
    match = _GGUF_LAYER.fullmatch(gguf_name)
    if match is None or match.group(2) not in _GGUF_LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    layer, module, leaf = match.groups()
    return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[module]}.{leaf}"
