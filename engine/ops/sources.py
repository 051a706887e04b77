"""The native kernels' C++ sources and their digest. Standard library only: setup.py loads
this file to stamp the digest into the module it builds, and the loader compares the
module's stamp with the sources beside it, so a module built from other sources (a
checkout edited since `make install`) is refused instead of silently tested."""

from __future__ import annotations

import hashlib
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
_SUFFIXES = (".cpp", ".h")


def sources_sha256(csrc: Path = CSRC) -> str:
    """sha256 over the names and contents of csrc's C++ files, in name order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in csrc.iterdir() if p.suffix in _SUFFIXES):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()
