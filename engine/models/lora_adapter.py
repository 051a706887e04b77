"""Reading a PEFT LoRA adapter directory into per-layer (A, B) pairs.

PEFT saves `adapter_config.json` and `adapter_model.safetensors` (or `.bin`), with one
pair per targeted module:

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   (r, in_features)
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   (out_features, r)

and the module's output becomes W x + scaling * B A x, where scaling is lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora; rank_pattern and alpha_pattern override r and
alpha per module). Our layers fuse q/k/v and gate/up, so each PEFT module maps to a slice
of one of ours (TARGETS). What PEFT can express beyond that (DoRA, biases, extra trained
modules, embeddings or the LM head, expert parameters) is refused by name.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.lora.request import LoRAError, LoRARequest
from engine.models.arch import ModelArch

# PEFT module name -> (our layer, the slice of its outputs: None for all of them).
TARGETS: dict[str, tuple[str, int | None]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "qkv_proj": ("qkv_proj", None),
    "o_proj": ("o_proj", None),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "gate_up_proj": ("gate_up_proj", None),
    "down_proj": ("down_proj", None),
}
_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight"
)
# adapter_config.json settings that change what the adapter computes, and the value that
# keeps it a plain LoRA.
_PLAIN = {
    "use_dora": False,
    "bias": "none",
    "lora_bias": False,
    "modules_to_save": None,
    "trainable_token_indices": None,
    "target_parameters": None,
    "alora_invocation_tokens": None,
    "use_qalora": False,
    "layer_replication": None,
}


def layer_slices(arch: ModelArch) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Our adaptable layers: name -> (in_features, the output sizes of its slices)."""
    hidden, inter = arch.hidden_size, arch.intermediate_size
    return {
        "qkv_proj": (hidden, (arch.q_size, arch.kv_size, arch.kv_size)),
        "o_proj": (arch.q_size, (hidden,)),
        "gate_up_proj": (hidden, (inter, inter)),
        "down_proj": (inter, (hidden,)),
    }


@dataclass
class LoRAPart:
    """One PEFT module's pair: its slice of our layer (None: all of it), A (r, in) and
    B (out, r) with the scaling folded in, float32 on the host."""

    slice: int | None
    a: torch.Tensor
    b: torch.Tensor


@dataclass
class LoRAAdapter:
    request: LoRARequest
    rank: int
    # (layer index, our layer name) -> its parts.
    parts: dict[tuple[int, str], list[LoRAPart]]

    @property
    def name(self) -> str:
        return self.request.lora_name


def load_adapter(request: LoRARequest, arch: ModelArch, max_rank: int) -> LoRAAdapter:
    """Reads and checks the adapter; raises LoRAError saying what does not fit."""
    folder = Path(request.lora_path)
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise LoRAError(f"{where}: no adapter_config.json (a PEFT adapter directory)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoRAError(f"{where}: unreadable adapter_config.json ({exc})") from exc
    _check_config(config, where)
    tensors = _read_tensors(folder, where)
    pairs: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise LoRAError(f"{where}: tensor {key!r} is not a LoRA weight of a decoder layer")
        layer, module, ab = int(match[1]), match[3], match[4]
        pairs.setdefault((layer, match[2], module), {})[ab] = tensor
    slices = layer_slices(arch)
    parts: dict[tuple[int, str], list[LoRAPart]] = {}
    rank = 0
    for (layer, block, module), pair in sorted(pairs.items()):
        name = f"layers.{layer}.{block}.{module}"
        if module not in TARGETS:
            raise LoRAError(f"{where}: {name} is not a layer LoRA applies to here")
        if layer >= arch.num_layers:
            raise LoRAError(f"{where}: {name}, but the model has {arch.num_layers} layers")
        if block == "mlp" and layer in arch.moe_layers:
            raise LoRAError(f"{where}: {name} is a mixture-of-experts layer's (not supported)")
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"{where}: {name} has lora_{''.join(pair)} without its pair")
        ours, part = TARGETS[module]
        in_features, outs = slices[ours]
        out = sum(outs) if part is None else outs[part]
        a, b = pair["A"].float(), pair["B"].float()
        r = a.shape[0]
        if a.shape != (r, in_features) or b.shape != (out, r):
            raise LoRAError(
                f"{where}: {name} has A {tuple(a.shape)} and B {tuple(b.shape)}, expected "
                f"(r, {in_features}) and ({out}, r) for this model"
            )
        if r > max_rank:
            raise LoRAError(f"{where}: rank {r} exceeds --max-lora-rank {max_rank}")
        rank = max(rank, r)
        scaling = _scaling(config, f"model.layers.{layer}.{block}.{module}", r)
        entry = parts.setdefault((layer, ours), [])
        if any(p.slice is None or part is None or p.slice == part for p in entry):
            raise LoRAError(f"{where}: layer {layer} adapts {ours} twice")
        entry.append(LoRAPart(part, a, b * scaling))
    if not parts:
        raise LoRAError(f"{where}: no LoRA weights")
    return LoRAAdapter(request, rank, parts)


def _check_config(config: dict[str, Any], where: str) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{where}: peft_type {config.get('peft_type')!r}, only LORA is served")
    for key, plain in _PLAIN.items():
        value = config.get(key, plain)
        if value != plain and not (plain is None and not value):
            raise LoRAError(f"{where}: {key}={value!r} is not supported")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        return  # a regex: the tensors say which modules it matched
    for module in targets:
        if module not in TARGETS:
            raise LoRAError(
                f"{where}: target module {module!r} is not supported (supported: "
                f"{', '.join(TARGETS)})"
            )


def _scaling(config: dict[str, Any], module: str, rank: int) -> float:
    """PEFT's scaling for `module`: its alpha (alpha_pattern over lora_alpha) over its rank,
    or over the rank's square root with use_rslora."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            alpha = value
            break
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _read_tensors(folder: Path, where: str) -> dict[str, torch.Tensor]:
    safetensors_file = folder / "adapter_model.safetensors"
    try:
        if safetensors_file.is_file():
            from safetensors.torch import load_file

            return load_file(str(safetensors_file))
        bin_file = folder / "adapter_model.bin"
        if bin_file.is_file():
            return dict(torch.load(bin_file, map_location="cpu", weights_only=True))
    except Exception as exc:  # any reader's failure: the file is not an adapter we can read
        raise LoRAError(f"{where}: unreadable weights ({exc})") from exc
    raise LoRAError(f"{where}: no adapter_model.safetensors or adapter_model.bin")
