"""Tenants: who is calling, from the API key, and what that separates.

Keys come from `--api-key` (each key its own tenant, named by a short fingerprint of the
key) and from `--api-keys-file` (`KEY TENANT` lines; several keys may share a tenant, as
during a key rotation). A tenant's requests never share prefix-cache blocks with another
tenant's: the tenant salts every request, and a client's own `cache_salt` is combined
with it, never replacing it.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from pathlib import Path

from engine import scoped_cache_salt

_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """API key -> tenant. Lookups hash the presented key first, so their timing says
    nothing about how much of a real key it shares."""

    def __init__(self, tenants_by_key: dict[str, str]) -> None:
        self._tenants = {_digest(key): tenant for key, tenant in tenants_by_key.items()}

    @classmethod
    def load(cls, keys: list[str], keys_file: str | None) -> KeyRing:
        """Raises ValueError for a malformed file, naming the line (never the key)."""
        tenants = {key: "key-" + _digest(key).hex()[:8] for key in keys}
        if keys_file:
            for key, tenant in read_keys_file(Path(keys_file)).items():
                if tenants.setdefault(key, tenant) != tenant:
                    raise ValueError(f"{keys_file}: a key is also given by --api-key")
        return cls(tenants)

    @property
    def open(self) -> bool:
        """True when no key is configured: every request is let in, as no tenant."""
        return not self._tenants

    def tenant(self, authorization: str) -> str | None:
        """The tenant of an `Authorization: Bearer KEY` header; None if it names none."""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        return self._tenants.get(_digest(token.strip()))


def read_keys_file(path: Path) -> dict[str, str]:
    """`KEY TENANT` per line; blank lines and `#` comments are skipped."""
    tenants: dict[str, str] = {}
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) != 2 or not _TENANT.fullmatch(fields[1]):
            raise ValueError(
                f"{path}:{number}: expected `KEY TENANT` (a tenant is 1-64 of A-Z a-z 0-9 . _ @ -)"
            )
        key, tenant = fields
        if tenants.setdefault(key, tenant) != tenant:
            raise ValueError(f"{path}:{number}: this key already belongs to another tenant")
    if not tenants:
        raise ValueError(f"{path}: no keys")
    return tenants


def tenant_cache_salt(tenant: str | None, cache_salt: str | None) -> str | None:
    """The prefix-cache salt of a request: the tenant's, combined with the client's own.
    KV events publish only the client's part, which a router reading the request body can
    compute too (engine.scoped_cache_salt)."""
    if tenant is None:
        return cache_salt
    return scoped_cache_salt(tenant, cache_salt)


class TenantConcurrency:
    """Requests in flight per tenant, against an optional limit (None: unlimited)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._in_flight: Counter[str | None] = Counter()

    def try_acquire(self, tenant: str | None) -> bool:
        """Mutates the count: True (and one more in flight) if the tenant is under its limit."""
        if self.limit is not None and self._in_flight[tenant] >= self.limit:
            return False
        self._in_flight[tenant] += 1
        return True

    def release(self, tenant: str | None) -> None:
        self._in_flight[tenant] -= 1
        if not self._in_flight[tenant]:
            del self._in_flight[tenant]
