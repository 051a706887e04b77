"""Finding a local model and reading its Hugging Face config (no torch here).

Nothing is fetched from a hub: a model is a path on disk.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def resolve_model_path(model: str | Path) -> tuple[Path, str | None]:
    """(directory, gguf file name or None). Raises FileNotFoundError with a clear message."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir() and (path / "config.json").exists():
        return path, None
    raise FileNotFoundError(
        f"{model}: not a local Hugging Face model directory (with config.json) or a .gguf "
        "file; pagedserve never downloads weights"
    )


def find_gguf_weights(folder: Path, gguf_file: str | None) -> Path | None:
    """The GGUF file with the model's weights: the model file itself, else the directory's
    only *.gguf file (None when it has none, or several)."""
    if gguf_file is not None:
        return folder / gguf_file
    found = sorted(folder.glob("*.gguf"))
    return found[0] if len(found) == 1 else None


def import_config_machinery() -> None:
    """Imports what reading a model's config imports, before the model is known: transformers'
    config classes' shared base (torch.distributed's tensor ops among it), about 2 s of a
    2-core VM, which a prestarted core (engine/core_proc.py) pays while its frontend starts.
    Llama's config class stands for all: it imports that base in every transformers 5."""
    from transformers import AutoConfig, LlamaConfig  # noqa: F401


def load_hf_config(folder: Path, gguf_file: str | None) -> Any:
    from transformers import AutoConfig

    from engine.models.gguf_config import with_gguf_experts

    config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
    return config if gguf_file is None else with_gguf_experts(config, folder / gguf_file)


def eos_token_ids(folder: Path, hf_config: Any) -> tuple[int, ...]:
    """EOS ids from generation_config.json if present (Llama 3 lists several), else config."""
    ids = getattr(hf_config, "eos_token_id", None)
    gen = folder / "generation_config.json"
    if gen.exists():
        ids = json.loads(gen.read_text()).get("eos_token_id", ids)
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, list) else (int(ids),)
