"""The mixture-of-experts facts of a GGUF file's config, which transformers' reader drops.

transformers rebuilds a config from a GGUF file's metadata, but for the two MoE families we
serve it leaves out what llama.cpp's converter wrote:

    file (general.architecture)        transformers' config         restored here
    Mixtral ("llama", expert_count 8)  a dense LlamaConfig          MixtralConfig, 8 experts
    Qwen3-MoE ("qwen3moe")             moe_intermediate_size 768    expert_feed_forward_length
                                       (Qwen3MoeConfig's default)

No torch or numpy here: the engine's config layer reads this (the GGUF reader, which uses
numpy, is imported when called).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def with_gguf_experts(config: Any, path: Path) -> Any:
    """`config` (transformers' reading of the GGUF file at `path`) with the file's experts;
    any other config is returned as it is. Both families renormalise their top-k
    routing weights in llama.cpp (its qwen3moe and llama graphs always do), so the file is
    served that way whatever the original checkpoint said."""
    from engine.models.gguf_file import GGUFFile

    metadata = GGUFFile(path).metadata
    arch = str(metadata["general.architecture"])

    def field(key: str) -> Any:
        return metadata.get(f"{arch}.{key}")

    num_experts = int(field("expert_count") or 0)
    if num_experts == 0:
        return config
    if arch == "qwen3moe":
        config.update(dict(norm_topk_prob=True))
        width = field("expert_feed_forward_length")
        if width is not None:  # llama.cpp's converter writes it; without it, the default
            config.update(dict(moe_intermediate_size=int(width)))
        return config
    if arch == "llama":
        return _mixtral_config(config, num_experts, int(field("expert_used_count")))
    return config  # another family: ModelArch refuses its model type


def _mixtral_config(llama: Any, num_experts: int, top_k: int) -> Any:
    """A Mixtral config from transformers' dense reading of the same file: llama.cpp writes
    each expert's width as the feed-forward length, so intermediate_size is already it."""
    from transformers import MixtralConfig

    values = llama.to_dict()
    for key in ("model_type", "architectures", "transformers_version"):
        values.pop(key, None)
    # llama.cpp's llama graph attends over the whole context: no sliding window.
    values.update(num_local_experts=num_experts, num_experts_per_tok=top_k, sliding_window=None)
    return MixtralConfig(**values)
