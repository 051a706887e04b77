"""Where /v1/responses keeps what it stored: SQLite on the server's disk, or Redis shared by
the replicas.

A record is a response object (as GET /v1/responses/{id} returns it) and the conversation
that led to it (the input items of every turn before, without instructions, which OpenAI
does not carry over), so that `previous_response_id` can continue from one read. Records
belong to a tenant (server/tenants.py; "" with no API keys): one tenant's id is not found
by another. Each expires `ttl` seconds after its last write.

- `sqlite:PATH` (the default, `PATH` under the cache directory): one file, written by one
  connection in WAL mode, off the event loop. Restarts keep it; a PVC keeps it in a pod.
- `redis://[user:password@]host:port/db` or `rediss://...`: one key per record, expiring by
  Redis' own TTL, so that every replica behind a router sees every response.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    context: list[dict[str, Any]]  # the earlier turns' items, oldest first

    def encode(self) -> str:
        return json.dumps({"response": self.response, "context": self.context})

    @classmethod
    def decode(cls, text: str | bytes) -> StoredResponse:
        record = json.loads(text)
        return cls(record["response"], record["context"])


class ResponseStore(ABC):
    def __init__(self, ttl: float) -> None:
        self.ttl = ttl

    @abstractmethod
    async def put(self, tenant: str, record: StoredResponse) -> None:
        """Writes the record under its response's id, replacing one there."""

    @abstractmethod
    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's record, or None (absent, expired, or another tenant's)."""

    @abstractmethod
    async def delete(self, tenant: str, response_id: str) -> bool:
        """Whether the tenant had it."""

    async def close(self) -> None:
        return None


def open_store(spec: str, ttl: float, cache_dir: Path) -> ResponseStore:
    """The store `spec` names (--responses-store); raises ValueError for one it cannot
    open."""
    if spec.startswith(("redis://", "rediss://")):
        return RedisStore(spec, ttl)
    if spec == "sqlite" or spec.startswith("sqlite:"):
        path = Path(spec.removeprefix("sqlite").removeprefix(":") or cache_dir / "responses.db")
        return SqliteStore(path, ttl)
    raise ValueError(
        f"--responses-store {spec!r}: give sqlite, sqlite:PATH or a redis:// or rediss:// URL"
    )


class SqliteStore(ResponseStore):
    """Expired rows are skipped when read and deleted now and then when writing."""

    PURGE_EVERY_S = 60.0

    def __init__(self, path: Path, ttl: float) -> None:
        super().__init__(ttl)
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS responses (tenant TEXT NOT NULL, id TEXT NOT NULL, "
                "record TEXT NOT NULL, expires REAL NOT NULL, PRIMARY KEY (tenant, id))"
            )
        except (OSError, sqlite3.Error) as exc:
            raise ValueError(f"cannot open the responses store {path}: {exc}") from exc
        self._lock = threading.Lock()
        self._purged = 0.0

    def _run(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    async def put(self, tenant: str, record: StoredResponse) -> None:
        now = time.time()
        sql = "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)"
        args = (tenant, record.response["id"], record.encode(), now + self.ttl)
        await asyncio.to_thread(self._run, sql, *args)
        if now - self._purged > self.PURGE_EVERY_S:
            self._purged = now
            await asyncio.to_thread(self._run, "DELETE FROM responses WHERE expires < ?", now)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        sql = "SELECT record FROM responses WHERE tenant = ? AND id = ? AND expires >= ?"
        rows = await asyncio.to_thread(self._run, sql, tenant, response_id, time.time())
        return StoredResponse.decode(rows[0][0]) if rows else None

    async def delete(self, tenant: str, response_id: str) -> bool:
        sql = "DELETE FROM responses WHERE tenant = ? AND id = ? AND expires >= ? RETURNING id"
        rows = await asyncio.to_thread(self._run, sql, tenant, response_id, time.time())
        return bool(rows)

    async def close(self) -> None:
        with self._lock:
            self._db.close()


class RedisStore(ResponseStore):
    """Keys `pagedserve:response:<tenant>:<id>`, set with their TTL."""

    def __init__(self, url: str, ttl: float) -> None:
        super().__init__(ttl)
        import redis.asyncio as redis

        try:
            self._redis = redis.Redis.from_url(url)
        except ValueError as exc:
            raise ValueError(f"--responses-store: {exc}") from exc

    @staticmethod
    def _key(tenant: str, response_id: str) -> str:
        return f"pagedserve:response:{tenant}:{response_id}"

    async def put(self, tenant: str, record: StoredResponse) -> None:
        key = self._key(tenant, record.response["id"])
        await self._redis.set(key, record.encode(), px=max(1, int(self.ttl * 1000)))

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        text = await self._redis.get(self._key(tenant, response_id))
        return None if text is None else StoredResponse.decode(text)

    async def delete(self, tenant: str, response_id: str) -> bool:
        return bool(await self._redis.delete(self._key(tenant, response_id)))

    async def close(self) -> None:
        await self._redis.aclose()
