"""Small helpers shared across the engine's layers (pure Python)."""

from __future__ import annotations

import json
from typing import Any


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints: the number of size-`b` blocks `a` items fill."""
    return -(-a // b)


def json_flag(text: str | None, flag: str) -> dict[str, Any] | None:
    """A flag's JSON object, or None when the flag is unset or blank. Raises ValueError
    naming the flag when the text is not JSON, or not an object."""
    if text is None or not text.strip():
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return raw
