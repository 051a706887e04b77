"""Small helpers shared across the engine's layers (pure Python)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints: the number of size-`b` blocks `a` items fill."""
    return -(-a // b)
