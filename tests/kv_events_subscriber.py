"""A KV events subscriber as llm-d's indexer is one: pyzmq SUB, plus its replay client.

Payloads are decoded with plain msgpack (msgspec's untyped decoder), not with the engine's
own structs, so tests read the positions a consumer reads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq


@dataclass
class Received:
    topic: bytes
    seq: int
    batch: list[Any]  # [ts, events, data_parallel_rank]


@dataclass
class Subscriber:
    """Binds (or connects) a SUB socket to `endpoint`; `replay_endpoint` is a ROUTER."""

    endpoint: str
    topic: bytes = b""
    bind: bool = True
    replay_endpoint: str | None = None
    received: dict[int, Received] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.linger = 0
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        (self.sub.bind if self.bind else self.sub.connect)(self.endpoint)

    def drain(self, quiet_s: float = 0.5, timeout_s: float = 30.0) -> None:
        """Receives until nothing came for `quiet_s` (or `timeout_s` passed)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.sub.poll(int(quiet_s * 1000)):
            self._keep(*self.sub.recv_multipart())

    def replay(self, start: int = 0) -> list[int]:
        """Asks the publisher for every buffered batch from `start`, as llm-d-router
        v0.10.0's requestReplay does (see `llmd_replay`); returns the replayed seqs."""
        assert self.replay_endpoint is not None
        replayed = llmd_replay(self.context, self.replay_endpoint, start)
        for topic, seq, payload in replayed:
            assert topic.startswith(self.topic), f"replayed under {topic!r}, not {self.topic!r}"
            self._keep(topic, seq.to_bytes(8, "big"), payload)
        return [seq for _, seq, _ in replayed]

    def replay_until(self, last: int, attempts: int = 100) -> list[int]:
        """Replays from 0 until batch `last` is among them: the publisher's thread may
        still be sending when the request arrives."""
        seqs: list[int] = []
        for _ in range(attempts):
            seqs = self.replay(0)
            if last in seqs:
                return seqs
            time.sleep(0.05)
        raise AssertionError(f"batch {last} never came; replayed {seqs}")

    def _keep(self, topic: bytes, seq_bytes: bytes, payload: bytes) -> int:
        assert len(seq_bytes) == 8
        seq = int.from_bytes(seq_bytes, "big")
        self.received[seq] = Received(topic, seq, msgspec.msgpack.decode(payload))
        return seq

    def events(self) -> list[list[Any]]:
        """Every event, in sequence order; fails on a gap in the sequence."""
        seqs = sorted(self.received)
        assert seqs == list(range(len(seqs))), f"sequence gaps: {seqs}"
        return [event for s in seqs for event in self.received[s].batch[1]]

    def close(self) -> None:
        self.context.destroy(linger=0)


class ReplayError(AssertionError):
    """A reply llm-d's requestReplay would refuse: it then resets the pod's index."""


def llmd_replay(
    context: zmq.Context, endpoint: str, start: int, timeout_s: float = 10.0
) -> list[tuple[bytes, int, bytes]]:
    """llm-d-router v0.10.0's side of the replay protocol (pkg/kvevents/zmq_subscriber.go,
    requestReplay): a DEALER sends [b"", start (8 bytes, big-endian)]; each reply, after
    an empty leading frame is dropped, is either the end (three frames, the last empty) or
    [topic, seq (8 bytes or more, big-endian), payload] whose seq is exactly the next one
    expected, from `start` on. Anything else is a ReplayError, as it is an error there.
    Returns (topic, seq, payload) per replayed batch."""
    dealer = context.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        replayed: list[tuple[bytes, int, bytes]] = []
        while True:
            if not dealer.poll(int(timeout_s * 1000)):
                raise ReplayError(f"no end marker after {len(replayed)} batches")
            frames = dealer.recv_multipart()
            if frames and not frames[0]:
                frames = frames[1:]
            if len(frames) == 3 and not frames[2]:
                return replayed
            if len(frames) != 3 or len(frames[1]) < 8:
                raise ReplayError(f"malformed replay frame with {len(frames)} frames")
            topic, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes[:8], "big")
            if seq != start + len(replayed):
                raise ReplayError(f"expected sequence {start + len(replayed)}, got {seq}")
            replayed.append((topic, seq, payload))
    finally:
        dealer.close()


def replay_index(events: list[list[Any]]) -> dict[int, tuple[int | None, list[int], Any]]:
    """Applies events as an indexer would: hash -> (parent, token ids, extra keys). Fails
    when a removal names a block not stored, or a store names an unknown parent."""
    index: dict[int, tuple[int | None, list[int], Any]] = {}
    for event in events:
        tag = event[0]
        if tag == "BlockStored":
            _, hashes, parent, tokens, block_size, *_ = event
            extra = event[8]
            assert parent is None or parent in index, f"unknown parent {parent}"
            for i, block_hash in enumerate(hashes):
                index[block_hash] = (
                    parent,
                    tokens[i * block_size : (i + 1) * block_size],
                    extra[i],
                )
                parent = block_hash
        elif tag == "BlockRemoved":
            for block_hash in event[1]:
                assert block_hash in index, f"removed {block_hash} was never stored"
                del index[block_hash]
        else:
            assert event == ["AllBlocksCleared"], event
            index.clear()
    return index
