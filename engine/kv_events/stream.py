"""What EngineCore holds when KV events are on: the recorder the block pool calls and the
publisher each step's batch goes to."""

from __future__ import annotations

from engine.kv_events.config import KVEventsConfig
from engine.kv_events.publisher import ZmqEventPublisher
from engine.kv_events.recorder import KVEventRecorder


class KVEventStream:
    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        """Opens the publisher's sockets: raises ValueError when they cannot be opened."""
        self.recorder = KVEventRecorder(block_size)
        self.publisher = ZmqEventPublisher(config)

    def flush(self) -> None:
        """Hands the events recorded since the last flush to the publisher, as one batch."""
        batch = self.recorder.take_batch()
        if batch is not None:
            self.publisher.publish(batch)

    def close(self) -> None:
        self.flush()
        self.publisher.close()
