"""Tenants: keys from --api-key and --api-keys-file, prefix-cache isolation, 401 on every
route that needs a key, a per-tenant concurrency limit, the tenant in the request log."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine import EngineHooks
from server.app import create_app
from server.middleware import OPEN_PATHS
from server.settings import ServerSettings
from server.tenants import KeyRing, read_keys_file
from tests.server.conftest import tiny_engine
from tests.server.live import LiveServer

KEYS = "# key tenant\nkey-a1 alpha\nkey-a2 alpha\n\nkey-b beta\n"
PROMPT = " ".join(f"t{20 + i}" for i in range(64))  # four full blocks


def keys_file(tmp_path: Path, text: str = KEYS) -> Path:
    path = tmp_path / "api-keys"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = keys_file(tmp_path_factory.mktemp("keys"))
    engine = tiny_engine(tiny_model_dir, EngineHooks(step_delay=0.01))
    with LiveServer(
        engine,
        served_model_name="tiny",
        api_key=["key-solo"],
        api_keys_file=str(path),
        max_concurrent_requests_per_tenant=2,
        tenant_metrics=True,
    ) as live:
        yield live


def sdk(server: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def cached(server: LiveServer, key: str, **extra: Any) -> int:
    out = sdk(server, key).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, extra_body=extra or None
    )
    return out.usage.prompt_tokens_details.cached_tokens


def test_tenants_never_share_prefix_cache_blocks(server: LiveServer) -> None:
    assert cached(server, "key-a1") == 0
    assert cached(server, "key-b") == 0, "beta hit alpha's blocks"
    assert cached(server, "key-a2") == 48, "alpha's second key is alpha too"
    assert cached(server, "key-solo") == 0
    # A client's own salt is combined with its tenant's, never replacing it.
    assert cached(server, "key-a1", cache_salt="shared") == 0
    assert cached(server, "key-b", cache_salt="shared") == 0
    assert cached(server, "key-a1", cache_salt="shared") == 48


def app_routes() -> list[tuple[str, str]]:
    app = create_app(lambda: None, ServerSettings())  # type: ignore[arg-type, return-value]
    return sorted(
        (method, route.path)
        for route in app.routes
        for method in getattr(route, "methods", None) or ()
        if method != "HEAD"
    )


ROUTES = app_routes()
KEYED = [(m, p) for m, p in ROUTES if p not in OPEN_PATHS]


def test_the_routes_are_found() -> None:
    assert ("POST", "/v1/completions") in KEYED and ("GET", "/openapi.json") in KEYED
    assert {p for _, p in ROUTES} >= OPEN_PATHS


@pytest.mark.parametrize(("method", "path"), KEYED, ids=[f"{m} {p}" for m, p in KEYED])
@pytest.mark.parametrize("authorization", [None, "Bearer key-a1x", "Basic key-a1", "Bearer"])
def test_a_wrong_key_gets_401_on_every_route_that_needs_one(
    server: LiveServer, method: str, path: str, authorization: str | None
) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    response = httpx.request(method, f"{server.url}{path}", headers=headers, json={})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("path", sorted(OPEN_PATHS))
def test_probes_and_metrics_stay_open(server: LiveServer, path: str) -> None:
    assert httpx.get(f"{server.url}{path}").status_code == 200


def test_the_tenant_limit_gets_429_and_spares_other_tenants(server: LiveServer) -> None:
    long = {"model": "tiny", "prompt": "t10", "max_tokens": 150, "ignore_eos": True}

    def hold(key: str) -> None:
        httpx.post(
            f"{server.url}/v1/completions",
            json=long,
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )

    threads = [threading.Thread(target=hold, args=(key,)) for key in ("key-a1", "key-a2")]
    for thread in threads:
        thread.start()
    while server.state.in_flight < 2:
        time.sleep(0.01)
    with pytest.raises(openai.RateLimitError) as caught:
        sdk(server, "key-a1").completions.create(model="tiny", prompt="t10", max_tokens=1)
    assert caught.value.response.headers["retry-after"] == "1"
    assert caught.value.body["code"] == "rate_limit_exceeded"  # type: ignore[index]
    assert sdk(server, "key-b").completions.create(model="tiny", prompt="t10", max_tokens=1)
    assert server.metric("pagedserve:requests_rejected_total", reason="tenant_concurrency") >= 1
    for thread in threads:
        thread.join()
    assert sdk(server, "key-a1").completions.create(model="tiny", prompt="t10", max_tokens=1)


def test_the_tenant_is_in_the_log_line_and_in_opt_in_metrics(
    server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="pagedserve.requests"):
        sdk(server, "key-b").completions.create(model="tiny", prompt="t11", max_tokens=2, n=2)
        deadline = time.monotonic() + 5
        while len(caplog.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert [r.tenant for r in caplog.records] == ["beta", "beta"]
    assert server.metric("pagedserve:tenant_requests_total", tenant="beta") >= 2
    assert server.metric("pagedserve:tenant_generation_tokens_total", tenant="beta") >= 4


def test_no_tenant_series_unless_asked(tiny_server: LiveServer) -> None:
    assert "pagedserve:tenant_" not in httpx.get(f"{tiny_server.url}/metrics").text


KEY_FILE_ERRORS = {
    "one field": ("key-only\n", ":1: expected `KEY TENANT`"),
    "three fields": ("k t extra\n", ":1: expected"),
    "bad tenant": ("k tenant/x\n", ":1: expected"),
    "key twice": ("k a\nk b\n", ":2: this key already belongs to another tenant"),
    "empty": ("# nothing\n", "no keys"),
}


@pytest.mark.parametrize(("text", "message"), KEY_FILE_ERRORS.values(), ids=KEY_FILE_ERRORS.keys())
def test_a_bad_keys_file_is_refused_without_echoing_keys(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        read_keys_file(keys_file(tmp_path, text))
    assert "key-only" not in str(caught.value)


def test_keys_from_the_flag_and_the_file(tmp_path: Path) -> None:
    ring = KeyRing.load(["solo"], str(keys_file(tmp_path)))
    assert ring.tenant("Bearer key-a2") == "alpha" and ring.tenant("bearer key-b") == "beta"
    assert ring.tenant("Bearer solo") is not None and ring.tenant("Bearer solo ") is not None
    assert ring.tenant("Bearer nope") is None and not ring.open
    assert KeyRing.load([], None).open
    with pytest.raises(ValueError, match="also given by --api-key"):
        KeyRing.load(["key-b"], str(keys_file(tmp_path)))
