"""KV events from a served engine: the tenant's salt reaches the events' extra keys, so an
indexer keeps tenants apart as the engine's prefix cache does."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import openai
import pytest

from server.tenants import tenant_cache_salt
from tests.kv_events_subscriber import Subscriber, replay_index
from tests.server.conftest import tiny_engine
from tests.server.live import LiveServer, free_port

PROMPT = " ".join(f"t{20 + i}" for i in range(40))  # two full blocks of 16 and a part


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "core-process"])
def test_tenant_salt_reaches_the_extra_keys(tiny_model_dir: Path, in_process: bool) -> None:
    """Also with the engine core in a process of its own, where the publisher lives."""
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    subscriber = Subscriber(endpoint, replay_endpoint=replay)
    config = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay}
    engine = tiny_engine(
        tiny_model_dir, kv_events_config=json.dumps(config), engine_in_process=in_process
    )
    with LiveServer(engine, served_model_name="tiny", api_key=["key-one"]) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="key-one", max_retries=0)
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1)
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"cache_salt": "mine"}
        )
        deadline = time.monotonic() + 30
        while len(replay_index(subscriber.events())) < 4 and time.monotonic() < deadline:
            subscriber.drain(quiet_s=0.2)  # the publisher's thread may still be sending
            subscriber.replay(0)
    subscriber.close()
    tenant = "key-" + hashlib.sha256(b"key-one").hexdigest()[:8]
    index = replay_index(subscriber.events())
    first_blocks = sorted(
        (extra for parent, _, extra in index.values() if parent is None), key=json.dumps
    )
    # Two chains of the same tokens, told apart by their salts; later blocks carry none.
    assert first_blocks == sorted(
        ([tenant_cache_salt(tenant, None)], [tenant_cache_salt(tenant, "mine")]), key=json.dumps
    )
    assert all(extra is None for parent, _, extra in index.values() if parent is not None)
    assert len(index) == 4
