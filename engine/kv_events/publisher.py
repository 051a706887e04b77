"""The ZMQ publisher of KV event batches, off the engine's step path.

Wire format, as vLLM's ZmqEventPublisher sends it and llm-d's subscriber reads it: each
batch is one multipart message on a PUB socket,

    frame 0  topic          UTF-8 (llm-d expects "kv@<pod-id>@<model>")
    frame 1  sequence       8 bytes, big-endian unsigned, one per batch, from 0
    frame 2  payload        msgpack of a KVEventBatch (see recorder.py)

A ROUTER socket at `replay_endpoint` (optional) serves missed batches in the same three
frames, behind the requester's identity and delimiter (vLLM's layout since v0.26, PR
#45177, which is what llm-d-router v0.10.0's `requestReplay` parses):

    request   [identity, b"", start sequence (8 bytes, big-endian)]
    batches   [identity, b"", topic, sequence, payload]      from `start`, consecutive
    end       [identity, b"", b"", -1 (8 bytes, signed), b""]  an empty payload ends it

A request without the delimiter frame is answered without it.

`publish` never blocks: batches wait in a bounded queue for the background thread, which
encodes and sends them. A full queue drops the batch and counts it; its sequence number is
spent all the same, so a subscriber sees the gap. A slow or absent subscriber costs
nothing either: a PUB socket drops what a subscriber cannot take.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import msgspec
import zmq

from engine.kv_events.config import KVEventsConfig
from engine.kv_events.recorder import KVEventBatch

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# How long the thread waits on an empty queue before it looks at the replay socket again.
POLL_S = 0.05


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard or local endpoint is bound, any other is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Opens its sockets on construction (raising ValueError when an endpoint cannot be
    bound), then sends from its own thread until close()."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.topic = config.topic.encode()
        self.dropped = 0
        self._next_seq = 0
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(
            config.max_queue_size
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._context = zmq.Context()
        try:
            self._pub = self._open(zmq.PUB, config.endpoint, config.hwm, binds(config.endpoint))
            self._replay = None
            if config.replay_endpoint is not None:  # always bound, as vLLM does
                self._replay = self._open(zmq.ROUTER, config.replay_endpoint, config.hwm, True)
        except zmq.ZMQError as exc:
            self._context.destroy(linger=0)
            raise ValueError(f"kv-events-config: cannot open {config.endpoint}: {exc}") from exc
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def _open(self, kind: int, endpoint: str, hwm: int, bind: bool) -> zmq.Socket:
        socket = self._context.socket(kind)
        socket.set_hwm(hwm)
        socket.linger = 0
        if bind:
            socket.bind(endpoint)
        else:
            socket.connect(endpoint)
        return socket

    @property
    def num_batches(self) -> int:
        """Sequence numbers issued so far: batches sent, queued or dropped."""
        return self._next_seq

    def publish(self, batch: KVEventBatch) -> None:
        """Queues the batch under the next sequence number, or drops it when the queue is
        full. Never blocks."""
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("KV events: publisher queue full, %d batches dropped", self.dropped)

    def close(self) -> None:
        """Sends what is queued (within a second), then closes the sockets."""
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            logger.warning("KV events: closing with %d batches unsent", self._queue.qsize())
        self._thread.join(timeout=2.0)
        self._context.destroy(linger=0)

    # ---- the publisher thread: the only user of the sockets after construction --------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, batch = item
            try:
                payload = encoder.encode(batch)
                self._send(seq, payload)
            except zmq.ZMQError:
                logger.exception("KV events: sending batch %d failed", seq)
                continue
            self._buffer.append((seq, payload))

    def _send(self, seq: int, payload: bytes) -> None:
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        request = replay_request(self._replay.recv_multipart())
        if request is None:
            logger.warning("KV events: ignoring a malformed replay request")
            return
        envelope, first = request
        for seq, payload in consecutive_from(self._buffer, first):
            self._replay.send_multipart((*envelope, self.topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((*envelope, b"", END_OF_REPLAY, b""))


def replay_request(frames: list[bytes]) -> tuple[tuple[bytes, ...], int] | None:
    """(the frames a reply starts with, the first sequence asked for) of a ROUTER request:
    [identity, b"", start] from a DEALER or REQ, [identity, start] from a bare DEALER.
    None when it is neither."""
    if len(frames) not in (2, 3) or len(frames[-1]) != 8 or (len(frames) == 3 and frames[1]):
        return None
    return tuple(frames[:-1]), int.from_bytes(frames[-1], "big")


def consecutive_from(buffer: deque[tuple[int, bytes]], first: int) -> list[tuple[int, bytes]]:
    """The buffered batches `first`, `first` + 1, ... up to the first one missing (dropped
    when the queue was full, or long gone from the buffer); none when `first` itself is.

    Never a run that starts later or skips: llm-d-router v0.10.0 checks every replayed
    sequence against the one it expects next, and on a mismatch resets the pod's index and
    drops its live events until a retry 30 s later, which fails the same way. An empty
    answer to a request from 0 lets it go on from the live stream instead."""
    run: list[tuple[int, bytes]] = []
    for seq, payload in buffer:
        if seq < first:
            continue
        if seq != first + len(run):
            break
        run.append((seq, payload))
    return run
