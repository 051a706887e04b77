"""KV events from a served engine with tenants, as llm-d's precise prefix routing uses them.

The endpoint picker (llm-d-router v0.10.0) tokenizes a request through the render endpoints,
without an API key, folds the request body's `cache_salt` into the first block, and looks
the blocks up among the keys it computed from each pod's BlockStored events (token ids, and
the strings among a block's extra keys). The two agree only if the events publish the salt
the body carries: the tenant part of the engine's salt stays in the engine.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.kv_events_subscriber import Subscriber, replay_index
from tests.server.conftest import tiny_engine
from tests.server.live import LiveServer, free_port

PROMPT = " ".join(f"t{20 + i}" for i in range(40))  # two full blocks of 16 and a part
BLOCK = 16
RENDER = "/v1/completions/render"
MINE = {"cache_salt": "mine"}


def picker_keys(tokens: list[int], first_block_extras: list[str]) -> list[str]:
    """Block keys the way the picker chains them: each block's tokens and extra strings,
    after its parent's key. (Its own hash function; what matters is what goes in.)"""
    keys, parent = [], ""
    for i in range(len(tokens) // BLOCK):
        extras = first_block_extras if i == 0 else []
        block = json.dumps([parent, tokens[i * BLOCK : (i + 1) * BLOCK], extras])
        parent = hashlib.sha256(block.encode()).hexdigest()
        keys.append(parent)
    return keys


def chains(index: dict[int, tuple[int | None, list[int], Any]]) -> list[tuple[list[int], Any]]:
    """(all the tokens, the first block's published extra keys) of each stored chain."""
    found = []
    for block_hash, (parent, tokens, extra) in index.items():
        if parent is not None:
            continue
        chain_tokens, last = list(tokens), block_hash
        while child := next((h for h, (p, _, _) in index.items() if p == last), None):
            chain_tokens += index[child][1]
            last = child
        found.append((chain_tokens, extra))
    return found


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "core-process"])
def test_tenants_requests_match_what_the_picker_computes(
    tiny_model_dir: Path, in_process: bool
) -> None:
    """Also with the engine core in a process of its own, where the publisher lives."""
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    subscriber = Subscriber(endpoint, replay_endpoint=replay)
    config = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay}
    engine = tiny_engine(
        tiny_model_dir, kv_events_config=json.dumps(config), engine_in_process=in_process
    )
    keys = ["key-one", "key-two"]
    with LiveServer(
        engine, served_model_name="tiny", api_key=keys, render_allow_from=["127.0.0.0/8"]
    ) as server:
        for key, salt in [("key-one", None), ("key-one", "mine"), ("key-two", None)]:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
            extra = {"cache_salt": salt} if salt else None
            usage = client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=1, extra_body=extra
            ).usage
            # The engine still keeps tenants, and salts, apart: no request hit another's.
            assert usage.prompt_tokens_details.cached_tokens == 0
        # The picker's render calls, without a key, from an allowed network.
        rendered = {
            salt: httpx.post(f"{server.url}{RENDER}", json=body, timeout=30)
            for salt, body in [(None, {"prompt": PROMPT}), ("mine", {"prompt": PROMPT, **MINE})]
        }
        deadline = time.monotonic() + 30
        while len(replay_index(subscriber.events())) < 6 and time.monotonic() < deadline:
            subscriber.drain(quiet_s=0.2)  # the publisher's thread may still be sending
            subscriber.replay(0)
    subscriber.close()
    assert all(r.status_code == 200 for r in rendered.values())
    (render,) = rendered[None].json()
    stored = chains(replay_index(subscriber.events()))
    # Three chains of the same tokens (two tenants, one tenant's salt); the events name no
    # tenant, only the client's own salt.
    assert sorted(json.dumps(extra) for _, extra in stored) == ['["mine"]', "null", "null"]
    assert all(tokens == render["token_ids"][: 2 * BLOCK] for tokens, _ in stored)
    by_event = [picker_keys(tokens, extra or []) for tokens, extra in stored]
    unsalted = picker_keys(render["token_ids"], [])
    (salted_render,) = rendered["mine"].json()
    salted = picker_keys(salted_render["token_ids"], [MINE["cache_salt"]])
    assert sorted(by_event) == sorted([unsalted, unsalted, salted])
    assert unsalted != salted


def test_the_picker_renders_without_a_key_only_from_an_allowed_network(
    tiny_model_dir: Path,
) -> None:
    prompt = {"prompt": "t10 t11"}
    chat = {"messages": [{"role": "user", "content": "t10"}]}
    with LiveServer(
        tiny_engine(tiny_model_dir),
        api_key=["key-one"],
        render_allow_from=["10.0.0.0/8", "127.0.0.1/32"],
    ) as server:

        def post(path: str, body: dict[str, Any], **headers: str) -> int:
            return httpx.post(f"{server.url}{path}", json=body, headers=headers).status_code

        assert post(RENDER, prompt) == 200
        assert post("/v1/chat/completions/render", chat) == 200
        # Proxied through a Gateway: a client's call, which needs a key.
        assert post(RENDER, prompt, **{"X-Forwarded-For": "203.0.113.9"}) == 401
        assert post(RENDER, prompt, Forwarded="for=203.0.113.9") == 401
        assert post("/v1/completions", prompt) == 401
        assert post("/tokenize", prompt) == 401
        assert post(RENDER, prompt, Authorization="Bearer key-one") == 200
    with LiveServer(
        tiny_engine(tiny_model_dir), api_key=["k"], render_allow_from=["10.0.0.0/8"]
    ) as elsewhere:
        assert httpx.post(f"{elsewhere.url}{RENDER}", json=prompt).status_code == 401


def test_render_allow_from_takes_networks_only() -> None:
    from pydantic import ValidationError

    from server.settings import ServerSettings

    assert ServerSettings(render_allow_from=["10.0.0.0/8", "fd00::/8", "10.1.2.3"])
    with pytest.raises(ValidationError, match="not a network"):
        ServerSettings(render_allow_from=["cluster"])
