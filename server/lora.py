"""The adapters a server serves by name: --lora-modules, and vLLM's runtime endpoints.

    POST /v1/load_lora_adapter    {"lora_name": ..., "lora_path": ..., "load_inplace": false}
    POST /v1/unload_lora_adapter  {"lora_name": ...}

Both answer vLLM's plain-text "Success: ..." (200) or an OpenAI-shaped error: 400 for an
adapter that cannot load (the engine core reads and checks it before the name is served)
or a name already taken, 404 for an unknown one. A request names an adapter as its
`model`; /v1/models lists each with the base model as its `parent`. A name loaded again
(load_inplace) gets a new id, so its requests never meet the old weights' cached blocks.

With several API server processes (--api-server-count), each knows the --lora-modules from
the command line, but a runtime load would reach only one of them: the endpoints refuse it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine import AsyncLLM, LoRARequest, RequestValidationError
from server.errors import OpenAIError

if TYPE_CHECKING:
    from server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest


@dataclass(frozen=True)
class ServedAdapter:
    request: LoRARequest
    parent: str
    created: int


class LoRARegistry:
    """The served adapters by name (the frontend's view; the engine core holds weights)."""

    def __init__(
        self, engine: AsyncLLM, base_name: str, runtime_updates: bool, why_not: str = ""
    ) -> None:
        self.engine = engine
        self.base_name = base_name
        self.enabled = engine.config.lora is not None
        self.runtime_updates = runtime_updates and self.enabled
        self.why_not = why_not
        self.adapters: dict[str, ServedAdapter] = {}
        self._next_id = 1
        self._lock = asyncio.Lock()
        config = engine.config.lora
        if config is not None:
            created = int(time.time())
            for module, request in zip(config.modules, config.module_requests(), strict=True):
                parent = module.base_model_name or base_name
                self.adapters[module.name] = ServedAdapter(request, parent, created)
                self._next_id = request.lora_int_id + 1

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names, None for the base model; 404 for another name."""
        if model is None or model == self.base_name:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            raise OpenAIError(
                404, f"The model `{model}` does not exist.", "model", code="model_not_found"
            )
        return adapter.request

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        self._check_updates()
        name = body.lora_name
        if not name or not body.lora_path:
            raise OpenAIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.base_name:
            raise OpenAIError(400, f"'{name}' is the base model's name", "lora_name")
        async with self._lock:
            if name in self.adapters and not body.load_inplace:
                raise OpenAIError(
                    400, f"The lora adapter '{name}' has already been loaded.", "lora_name"
                )
            request = LoRARequest(name, self._next_id, body.lora_path)
            try:
                await self.engine.add_lora(request)
            except RequestValidationError as exc:
                raise OpenAIError(400, str(exc), "lora_path") from None
            self._next_id += 1
            old = self.adapters.get(name)
            self.adapters[name] = ServedAdapter(request, self.base_name, int(time.time()))
            if old is not None:
                await self.engine.remove_lora(old.request.lora_int_id)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        self._check_updates()
        name = body.lora_name
        async with self._lock:
            adapter = self.adapters.get(name)
            if adapter is None:
                raise OpenAIError(
                    404, f"The lora adapter '{name}' cannot be found.", "lora_name",
                    code="model_not_found",
                )  # fmt: skip
            del self.adapters[name]
            await self.engine.remove_lora(adapter.request.lora_int_id)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _check_updates(self) -> None:
        if not self.enabled:
            raise OpenAIError(400, "LoRA is not enabled: start the server with --enable-lora")
        if not self.runtime_updates:
            raise OpenAIError(400, f"loading LoRA adapters at run time is off: {self.why_not}")

    def model_cards(self, created: int, max_model_len: int) -> list[dict[str, object]]:
        return [
            {
                "id": name,
                "object": "model",
                "created": adapter.created,
                "owned_by": "pagedserve",
                "root": adapter.request.lora_path,
                "parent": adapter.parent,
                "max_model_len": max_model_len,
            }
            for name, adapter in self.adapters.items()
        ]
