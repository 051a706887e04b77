"""What names an adapter, what bounds them, and the --lora-modules syntax (pure Python)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.errors import RequestValidationError


class LoRAError(RequestValidationError):
    """An adapter that cannot be loaded or served as given (a 400 at the gateway)."""


@dataclass(frozen=True)
class LoRARequest:
    """An adapter as requests carry it: its served name, an id unique in this server (the
    KV events' `lora_id`), and the PEFT directory its weights are read from."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass(frozen=True)
class LoRAModule:
    """One --lora-modules entry; `base_model_name` is what /v1/models shows as its parent."""

    name: str
    path: str
    base_model_name: str | None = None


@dataclass(frozen=True)
class LoRAConfig:
    """--max-loras adapters run at once (device slots), of rank --max-lora-rank at most;
    --max-cpu-loras stay loaded in host memory. `modules` are --lora-modules, served from
    the start with ids 1, 2, ... in their order (module_requests)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1
    modules: tuple[LoRAModule, ...] = ()

    def module_requests(self) -> list[LoRARequest]:
        return [LoRARequest(m.name, i + 1, m.path) for i, m in enumerate(self.modules)]

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be at least 1, got {self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                f"({self.max_loras})"
            )


def parse_lora_modules(entries: list[str] | None) -> list[LoRAModule]:
    """vLLM's --lora-modules: each entry `name=path`, or a JSON object with "name", "path"
    and optionally "base_model_name". Raises ValueError for a malformed entry or a name
    given twice."""
    modules: list[LoRAModule] = []
    for entry in entries or []:
        if entry.lstrip().startswith("{"):
            try:
                spec = json.loads(entry)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules {entry!r}: not a JSON object ({exc})") from exc
            unknown = set(spec) - {"name", "path", "base_model_name"}
            if (
                unknown
                or not isinstance(spec.get("name"), str)
                or not isinstance(spec.get("path"), str)
            ):
                raise ValueError(
                    f"--lora-modules {entry!r}: expected "
                    '{"name": ..., "path": ..., "base_model_name": ...}'
                    + (f" (unknown keys: {sorted(unknown)})" if unknown else "")
                )
            module = LoRAModule(spec["name"], spec["path"], spec.get("base_model_name"))
        else:
            name, sep, path = entry.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {entry!r}: expected name=path")
            module = LoRAModule(name, path)
        if any(m.name == module.name for m in modules):
            raise ValueError(f"--lora-modules names {module.name!r} twice")
        modules.append(module)
    return modules
