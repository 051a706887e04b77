"""KV cache events for external routers (llm-d's KV-cache indexer), in vLLM's wire format.

    block pool ──(KVEventListener)──► KVEventRecorder ──(one batch per step)──►
        ZmqEventPublisher: bounded queue ► background thread ► msgpack ► ZMQ PUB

`config` is pure Python (it parses `--kv-events-config`); the recorder needs msgspec and
the publisher pyzmq, so they are imported only when events are on.
"""

from engine.kv_events.config import KVEventsConfig

__all__ = ["KVEventsConfig"]
