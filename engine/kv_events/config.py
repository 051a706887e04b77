"""`--kv-events-config`: vLLM's KVEventsConfig, the same JSON keys and defaults (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from engine.utils import json_flag


@dataclass(frozen=True)
class KVEventsConfig:
    """Where and how KV cache events are published.

    `publisher` defaults to "zmq" when events are enabled and to "null" otherwise, as in
    vLLM. An endpoint with a wildcard (`tcp://*:5557`), `ipc://` or `inproc://` is bound,
    any other is connected to.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # past batches kept for replay
    hwm: int = 100_000  # ZMQ high-water mark of the PUB socket
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv-events-config: unknown publisher {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv-events-config: {name} must be positive")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str | None) -> KVEventsConfig:
        """Parses the flag's JSON object; raises ValueError naming a bad or unknown key."""
        raw = json_flag(text, "kv-events-config")
        if raw is None:
            return cls()
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"kv-events-config: unknown keys {unknown}; known: {sorted(known)}")
        for key, value in raw.items():
            _check_type(key, value, known[key].type)
        return cls(**raw)


_TYPES: dict[str, tuple[type, ...]] = {
    "bool": (bool,),
    "int": (int,),
    "str": (str,),
    "str | None": (str, type(None)),
}


def _check_type(key: str, value: Any, annotation: Any) -> None:
    allowed = _TYPES[str(annotation)]
    # bool is an int in Python; a count given as true is still a mistake.
    if isinstance(value, bool) and bool not in allowed:
        allowed = ()
    if not isinstance(value, allowed):
        raise ValueError(f"kv-events-config: {key} must be {annotation}, got {value!r}")
