"""KV cache events: the block pool's emission points, vLLM's wire format, and delivery.

A pyzmq subscriber (tests/kv_events_subscriber.py) decodes the batches with plain msgpack
and replays them into an index, as llm-d's KV-cache indexer does.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from pathlib import Path

import msgspec
import pytest
import zmq

from engine import LLM, SamplingParams
from engine.kv_cache import KVCacheManager
from engine.kv_cache.hashing import extend_block_hashes
from engine.kv_cache.salt import published_salt, scoped_cache_salt
from engine.kv_events import KVEventsConfig
from engine.kv_events.publisher import ZmqEventPublisher, consecutive_from, replay_request
from engine.kv_events.recorder import KVEventRecorder, external_hash
from engine.request import Request
from tests.kv_events_subscriber import ReplayError, Subscriber, llmd_replay, replay_index
from tests.server.live import free_ports
from tests.tiny_models import make_tiny_model

B = 4


def request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def decoded(recorder: KVEventRecorder) -> list:
    batch = recorder.take_batch()
    assert batch is not None
    return msgspec.msgpack.decode(msgspec.msgpack.encode(batch))


# --- configuration ----------------------------------------------------------------------


def test_config_defaults_follow_vllm() -> None:
    assert not KVEventsConfig.from_json(None).enabled
    on = KVEventsConfig.from_json('{"enable_kv_cache_events": true}')
    assert (on.publisher, on.endpoint, on.topic, on.enabled) == ("zmq", "tcp://*:5557", "", True)
    assert KVEventsConfig.from_json('{"publisher": "zmq"}').enabled is False
    off = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}')
    assert not off.enabled


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not JSON"),
        ("[1]", "JSON object"),
        ('{"enable_kv_cache_event": true}', "unknown keys"),
        ('{"hwm": "many"}', "hwm must be int"),
        ('{"max_queue_size": true}', "max_queue_size must be int"),
        ('{"buffer_steps": 0}', "positive"),
        ('{"publisher": "kafka"}', "unknown publisher"),
    ],
)
def test_config_rejects_bad_json(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.from_json(text)


# --- the block pool's emission points, in vLLM's layout ----------------------------------


def test_stored_events_carry_the_chain_tokens_and_salt() -> None:
    recorder = KVEventRecorder(B)
    manager = KVCacheManager(num_blocks=8, block_size=B, events=recorder)
    tokens = list(range(10, 20))  # two full blocks and two tokens
    manager.allocate_slots(request("a", tokens, "tenant-a"), 10, [])
    (event,) = decoded(recorder)[1]
    hashes: list = []
    extend_block_hashes(hashes, tokens, B, "tenant-a")
    assert event == [
        "BlockStored",
        [external_hash(h) for h in hashes],
        None,
        tokens[:8],
        B,
        None,
        "GPU",
        None,
        [["tenant-a"], None],
    ]
    # The chain goes on in a later step: the parent is the last block stored before.
    req = manager.req_to_blocks["a"]
    assert len(req) == 3


def test_a_scoped_salt_is_published_without_its_scope() -> None:
    """The scope (the server's tenant) separates the blocks but stays out of the events:
    they carry the part a router can compute from the request, or nothing."""
    recorder = KVEventRecorder(B)
    manager = KVCacheManager(num_blocks=8, block_size=B, events=recorder)
    tokens = list(range(10, 14))
    salts = [scoped_cache_salt("alpha", "s1"), scoped_cache_salt("beta", "s1")]
    salts.append(scoped_cache_salt("alpha", None))
    for i, salt in enumerate(salts):
        manager.allocate_slots(request(str(i), tokens, salt), 4, [])
    stored = decoded(recorder)[1]
    assert [event[8] for event in stored] == [[["s1"]], [["s1"]], [None]]
    assert len({event[1][0] for event in stored}) == 3  # three blocks, three hashes
    # Something that only looks scoped is published whole.
    assert published_salt("\x00scoped\x00not json") == "\x00scoped\x00not json"
    assert published_salt("\x00scoped\x005") == "\x00scoped\x005"
    assert published_salt("plain") == "plain"


def test_an_adapters_blocks_carry_its_id_and_name() -> None:
    """vLLM's BlockStored lora_id (position 5) and lora_name (7): an adapter's blocks are
    its own, hashed apart from the base model's and from another load of the same name."""
    from engine.lora import LoRARequest

    recorder = KVEventRecorder(B)
    manager = KVCacheManager(num_blocks=8, block_size=B, events=recorder)
    tokens = list(range(10, 14))
    loras = [None, LoRARequest("sql", 3, "/a/sql"), LoRARequest("sql", 4, "/a/sql")]
    for i, lora in enumerate(loras):
        req = request(str(i), tokens)
        req.lora = lora
        manager.allocate_slots(req, 4, [])
    stored = decoded(recorder)[1]
    assert [(event[5], event[7]) for event in stored] == [(None, None), (3, "sql"), (4, "sql")]
    assert len({event[1][0] for event in stored}) == 3


def test_removed_after_eviction_and_cleared_on_reset() -> None:
    recorder = KVEventRecorder(B)
    manager = KVCacheManager(num_blocks=3, block_size=B, events=recorder)
    first = request("a", list(range(1, 9)))
    manager.allocate_slots(first, 8, [])
    manager.free(first)
    stored = decoded(recorder)[1][0][1]
    # Needs two blocks: the never-used one, then the front of the free queue, which holds
    # the first request's tail block (freed tail-first, evicted first).
    second = request("b", list(range(101, 109)))
    manager.allocate_slots(second, 8, [])
    removed, new = decoded(recorder)[1]
    assert removed == ["BlockRemoved", [stored[1]], "GPU"]
    assert new[0] == "BlockStored" and new[2] is None and len(new[1]) == 2
    assert manager.reset_prefix_cache() is False  # "b" holds blocks
    manager.free(second)
    assert manager.reset_prefix_cache() is True
    assert decoded(recorder)[1] == [["AllBlocksCleared"]]
    assert manager.pool.cached == {}
    manager.check_invariants()


def test_batch_layout() -> None:
    recorder = KVEventRecorder(B)
    recorder.all_cleared()
    ts, events, dp_rank = decoded(recorder)
    assert isinstance(ts, float) and events == [["AllBlocksCleared"]] and dp_rank == 0
    assert recorder.take_batch() is None


# --- delivery ---------------------------------------------------------------------------


def endpoints() -> tuple[str, str]:
    """The publisher's and its replay socket's: two distinct ports (two free_port() calls
    could return the same one)."""
    publish, replay = free_ports(2)
    return f"tcp://127.0.0.1:{publish}", f"tcp://127.0.0.1:{replay}"


def test_publish_never_blocks_on_a_stuck_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the sending thread stuck, publish() returns at once and counts the drops; their
    sequence numbers are spent, so a subscriber sees the gap."""
    endpoint, replay = endpoints()
    subscriber = Subscriber(endpoint, replay_endpoint=replay)
    config = KVEventsConfig(True, "zmq", endpoint, replay, max_queue_size=2)
    publisher = ZmqEventPublisher(config)
    release, sending = threading.Event(), threading.Event()
    send = publisher._send

    def stuck_send(seq: int, payload: bytes) -> None:
        sending.set()
        release.wait()
        send(seq, payload)

    monkeypatch.setattr(publisher, "_send", stuck_send)
    recorder = KVEventRecorder(B)
    recorder.all_cleared()
    batch = recorder.take_batch()
    assert batch is not None
    publisher.publish(batch)  # seq 0: taken by the thread, which gets stuck sending it
    assert sending.wait(10)
    for _ in range(5):  # seqs 1, 2 wait in the queue; 3, 4, 5 are dropped
        publisher.publish(batch)
    assert publisher.dropped == 3
    release.set()
    assert subscriber.replay_until(2) == [0, 1, 2]
    publisher.close()
    subscriber.close()


# --- replay, as llm-d-router v0.10.0 asks for it -------------------------------------------


def publish_cleared(publisher: ZmqEventPublisher, count: int) -> None:
    recorder = KVEventRecorder(B)
    for _ in range(count):
        recorder.all_cleared()
        batch = recorder.take_batch()
        assert batch is not None
        publisher.publish(batch)


def test_replay_answers_in_the_layout_llmd_reads() -> None:
    """Each replayed batch is [topic, seq, payload] behind the delimiter, as it goes out
    live; the end marker's payload is empty; a DEALER without the delimiter gets none."""
    endpoint, replay = endpoints()
    topic = b"kv@10.0.0.7@tiny"
    subscriber = Subscriber(endpoint, topic=topic, replay_endpoint=replay)
    publisher = ZmqEventPublisher(
        KVEventsConfig(True, "zmq", endpoint, replay, topic=topic.decode())
    )
    publish_cleared(publisher, 4)
    assert subscriber.replay_until(3) == [0, 1, 2, 3]
    replayed = llmd_replay(subscriber.context, replay, 1)
    assert [(t, seq) for t, seq, _ in replayed] == [(topic, 1), (topic, 2), (topic, 3)]
    for *_, payload in replayed:
        _ts, events, dp_rank = msgspec.msgpack.decode(payload)
        assert (events, dp_rank) == ([["AllBlocksCleared"]], 0)
    for envelope in ([b""], []):
        dealer = subscriber.context.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(replay)
        dealer.send_multipart([*envelope, (3).to_bytes(8, "big")])
        assert dealer.poll(10_000)
        assert dealer.recv_multipart()[: len(envelope) + 2] == [*envelope, topic, b"\0" * 7 + b"\3"]
        assert dealer.poll(10_000)
        assert dealer.recv_multipart() == [
            *envelope,
            b"",
            (-1).to_bytes(8, "big", signed=True),
            b"",
        ]
        dealer.close()
    publisher.close()
    subscriber.close()


def test_llmd_client_refuses_the_old_layout() -> None:
    """The client above has teeth: the pre-v0.26 reply [seq, payload] fails its parse, as
    it fails llm-d's (which then resets the pod's index)."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def answer_old_style() -> None:
        identity, _, _start = router.recv_multipart()
        router.send_multipart((identity, b"", (0).to_bytes(8, "big"), b"payload"))
        router.send_multipart((identity, b"", (-1).to_bytes(8, "big", signed=True), b""))

    server = threading.Thread(target=answer_old_style)
    server.start()
    with pytest.raises(ReplayError, match="malformed replay frame with 2 frames"):
        llmd_replay(context, f"tcp://127.0.0.1:{port}", 0)
    server.join(10)
    context.destroy(linger=0)


def test_replay_sends_only_an_unbroken_run_from_the_start_asked_for() -> None:
    """llm-d-router v0.10.0 resets the pod when the first replayed seq is not the one it
    asked for: a batch gone from the buffer (rolled over, or dropped) ends the run, and a
    start no longer buffered gets just the end marker."""
    buffer = deque([(2, b"c"), (3, b"d"), (4, b"e"), (7, b"h"), (8, b"i")])
    assert consecutive_from(buffer, 2) == [(2, b"c"), (3, b"d"), (4, b"e")]
    assert consecutive_from(buffer, 3) == [(3, b"d"), (4, b"e")]
    assert consecutive_from(buffer, 7) == [(7, b"h"), (8, b"i")]
    for gone in (0, 1, 5, 6, 9):
        assert consecutive_from(buffer, gone) == [], gone
    assert consecutive_from(deque(), 0) == []


@pytest.mark.parametrize(
    ("frames", "parsed"),
    [
        ([b"id", b"", b"\0" * 7 + b"\5"], ((b"id", b""), 5)),
        ([b"id", b"\0" * 7 + b"\5"], ((b"id",), 5)),
        ([b"id", b"", b"\5"], None),
        ([b"id", b"x", b"\0" * 8], None),
        ([b"id", b"", b"", b"\0" * 8], None),
        ([b"id"], None),
    ],
)
def test_replay_requests_are_parsed_strictly(frames: list[bytes], parsed: tuple | None) -> None:
    assert replay_request(frames) == parsed


def test_a_rolled_over_buffer_replays_from_0_as_nothing() -> None:
    """Over ZMQ: after more batches than `buffer_steps`, a replay from 0 is an empty,
    complete answer (llm-d then goes on from the live stream), one from a kept seq is the
    rest of the buffer."""
    endpoint, replay = endpoints()
    subscriber = Subscriber(endpoint, replay_endpoint=replay)
    publisher = ZmqEventPublisher(KVEventsConfig(True, "zmq", endpoint, replay, buffer_steps=3))
    publish_cleared(publisher, 5)
    seqs: list[int] = []
    for _ in range(100):  # until the publisher's thread has sent all five
        seqs = [seq for _, seq, _ in llmd_replay(subscriber.context, replay, 2)]
        if seqs and seqs[-1] == 4:
            break
    assert seqs == [2, 3, 4]
    assert llmd_replay(subscriber.context, replay, 0) == []
    publisher.close()
    subscriber.close()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def test_shared_prefix_workload_over_zmq(tiny_model: Path) -> None:
    """Stored events hold each prompt's full blocks; eviction sends removals; replaying
    the stream gives exactly the engine's prefix cache; nothing is lost in between."""
    endpoint, replay = endpoints()
    subscriber = Subscriber(endpoint, topic=b"kv@pod@tiny", replay_endpoint=replay)
    events_config = {
        "enable_kv_cache_events": True,
        "endpoint": endpoint,
        "replay_endpoint": replay,
        "topic": "kv@pod@tiny",
    }
    llm = LLM(
        str(tiny_model),
        dtype="float32",
        block_size=16,
        num_kv_blocks=8,
        max_model_len=128,
        kv_events_config=json.dumps(events_config),
    )
    prefix = list(range(3, 3 + 48))  # three full blocks shared by every prompt
    # Each prompt adds two full blocks of its own: 8 blocks cannot hold them all.
    prompts = [prefix + [100 + i] * 40 for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for prompt in prompts:  # one at a time: each later one finds the prefix cached
        llm.generate([prompt], params)
    assert llm.core.scheduler.kv_cache.counters.hits >= 5 * 48
    assert llm.reset_prefix_cache() is True
    llm.generate(prompts[:2], params)
    pool = llm.core.scheduler.kv_cache.pool
    expected_index = {external_hash(b.block_hash): b for b in pool.cached.values()}
    assert llm.core.kv_events is not None
    num_batches = llm.core.kv_events.publisher.num_batches
    subscriber.drain()
    # Fills in whatever the SUB socket missed while it was joining.
    subscriber.replay_until(num_batches - 1)
    llm.close()

    events = subscriber.events()
    assert {r.topic for r in subscriber.received.values()} == {b"kv@pod@tiny"}
    tags = [e[0] for e in events]
    assert "BlockRemoved" in tags and "AllBlocksCleared" in tags
    cleared = tags.index("AllBlocksCleared")
    before_reset = replay_index(events[:cleared])
    for prompt in prompts:  # every prompt's full blocks were stored, chained, unsalted
        hashes: list = []
        extend_block_hashes(hashes, prompt, 16, None)
        stored = [
            (p, tokens, extra)
            for e in events[:cleared]
            if e[0] == "BlockStored"
            for p, tokens, extra in _blocks(e)
        ]
        for i, block_hash in enumerate(hashes):
            parent = external_hash(hashes[i - 1]) if i else None
            assert (parent, list(block_hash.token_ids), None) in stored
    index = replay_index(events)
    assert set(index) == set(expected_index)
    for block_hash, (_, tokens, _) in index.items():
        assert tuple(tokens) == expected_index[block_hash].block_hash.token_ids
    assert len(before_reset) > 0
    subscriber.close()


def _blocks(event: list) -> list[tuple]:
    _, hashes, parent, tokens, size, _, _, _, extra = event
    chain = [parent, *hashes[:-1]]
    return [(chain[i], tokens[i * size : (i + 1) * size], extra[i]) for i in range(len(hashes))]
