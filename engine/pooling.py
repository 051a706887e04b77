"""Embedding models: what the engine serves (--task), how it pools, and per-request
pooling parameters (pure Python).

An embedding engine runs each request's prompt through the same scheduler as a generation
(chunked prefill, batching, prefix caching) and ends it after its prefill: its embedding
is the final hidden state (after the final norm) at the prompt's last token, L2-normalised
when the model says so. That is Qwen3-Embedding's pooling. A sentence-transformers
directory describes it in its own files, which the engine reads:

    modules.json           [Transformer at "", Pooling at "1_Pooling", Normalize]
    1_Pooling/config.json  {"pooling_mode": "lasttoken"}: the one mode we run

A directory without modules.json pools the last token and normalises, as Qwen3-Embedding
does. Inputs are embedded as given, as OpenAI's API and vLLM do: sentence-transformers 6
renders texts through the tokenizer's chat template where it has one, which we never do.
`dimensions` (Matryoshka truncation) is allowed only where the model declares it,
with vLLM's hints in config.json or config_sentence_transformers.json: `is_matryoshka`
(any size) or `matryoshka_dimensions` (these sizes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import RequestValidationError

TASKS = ("generate", "embed", "auto")
# The sentence-transformers modules an embedding engine runs, by class name.
_TRANSFORMER, _POOLING, _NORMALIZE = "Transformer", "Pooling", "Normalize"


@dataclass(frozen=True)
class PoolingParams:
    """What one embedding request asks for: `dimensions` keeps the embedding's first that
    many values (then normalises again, when the model normalises); None keeps them all."""

    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise RequestValidationError(
                f"dimensions must be at least 1, got {self.dimensions}", "dimensions"
            )


@dataclass(frozen=True)
class PoolerConfig:
    """How an embedding model pools: always the last token; `normalize` says whether the
    embedding is L2-normalised. `dimensions` is the embedding's size."""

    dimensions: int
    normalize: bool = True
    # Matryoshka: whether a request may ask for fewer dimensions, and which (empty: any).
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()

    def check(self, params: PoolingParams) -> None:
        """Raises RequestValidationError for `dimensions` this model cannot give."""
        size = params.dimensions
        if size is None:
            return
        if not self.matryoshka:
            raise RequestValidationError(
                "this model does not support `dimensions`: its config declares no Matryoshka "
                "embeddings (is_matryoshka or matryoshka_dimensions)",
                "dimensions",
            )
        allowed = self.matryoshka_dimensions
        if size > self.dimensions or (allowed and size not in allowed):
            sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {self.dimensions}"
            raise RequestValidationError(
                f"dimensions must be one of {sizes}, got {size}", "dimensions"
            )


def check_task(pooler: PoolerConfig | None, params: PoolingParams | None) -> None:
    """Raises RequestValidationError for a request the engine's task does not serve: an
    embedding engine (`pooler`) takes embedding requests (`params`) only, and checks them;
    a generation engine takes none."""
    if pooler is None and params is not None:
        raise RequestValidationError(
            "this model does not serve embeddings: that needs --task embed", "model"
        )
    if pooler is not None and params is None:
        raise RequestValidationError(
            "this model serves embeddings (--task embed): it generates nothing", "model"
        )
    if pooler is not None and params is not None:
        pooler.check(params)


def resolve_task(task: str, folder: Path) -> str:
    """The task the engine serves, generate or embed: `task` itself, or for auto embed when
    the directory is a sentence-transformers model (it has modules.json)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    if task == "auto":
        return "embed" if (folder / "modules.json").exists() else "generate"
    return task


def read_pooler_config(folder: Path, hf_config: Any, hidden_size: int) -> PoolerConfig:
    """The pooling of the embedding model in `folder` (see the module docstring). Raises
    ValueError, naming the file, for a pipeline we do not run."""
    modules = _read_json(folder / "modules.json")
    normalize = True
    if modules is not None:
        normalize = _check_modules(folder, modules)
    st_config = _read_json(folder / "config_sentence_transformers.json") or {}

    def hint(name: str) -> Any:
        return getattr(hf_config, name, None) or st_config.get(name)

    dims, flag = hint("matryoshka_dimensions"), hint("is_matryoshka")
    return PoolerConfig(
        hidden_size,
        normalize,
        matryoshka=bool(flag or dims),
        matryoshka_dimensions=tuple(int(d) for d in dims or ()),
    )


def _check_modules(folder: Path, modules: list[dict[str, Any]]) -> bool:
    """Whether the pipeline normalises; raises ValueError unless it is Transformer (the
    directory itself), last-token Pooling, then optionally Normalize."""
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    if kinds not in ([_TRANSFORMER, _POOLING], [_TRANSFORMER, _POOLING, _NORMALIZE]):
        raise ValueError(
            f"{folder / 'modules.json'}: modules {kinds} are not supported; an embedding "
            "model runs Transformer, Pooling and optionally Normalize"
        )
    if modules[0].get("path", "") != "":
        raise ValueError(f"{folder / 'modules.json'}: the Transformer must be the directory itself")
    _check_transformer(folder)
    _check_pooling(folder / modules[1].get("path", "") / "config.json")
    return len(kinds) == 3


def _check_transformer(folder: Path) -> None:
    config = _read_json(folder / "sentence_bert_config.json") or {}
    if config.get("do_lower_case"):
        raise ValueError(
            f"{folder / 'sentence_bert_config.json'}: do_lower_case is not supported "
            "(the gateway tokenizes text as it comes)"
        )


def _check_pooling(path: Path) -> None:
    """Sentence-transformers 6 writes "pooling_mode": "lasttoken" (or a list of modes);
    earlier versions a boolean per mode, "pooling_mode_lasttoken": true."""
    config = _read_json(path)
    if config is None:
        raise ValueError(f"{path}: missing; the Pooling module's config says how to pool")
    named = config.get("pooling_mode", [])
    modes = {named} if isinstance(named, str) else set(named)
    modes |= {
        key.removeprefix("pooling_mode_")
        for key, value in config.items()
        if key.startswith("pooling_mode_") and value is True
    }
    if modes != {"lasttoken"}:
        raise ValueError(
            f"{path}: pooling {sorted(modes)} is not supported; pagedserve pools the last "
            "token (lasttoken) only"
        )


def _read_json(path: Path) -> Any:
    """The parsed file, or None when there is none."""
    if not path.exists():
        return None
    return json.loads(path.read_text())
