"""A live view of the engine: the block pool, the queues and the prefix cache. Pure Python."""

from engine.introspection.capture import CoreState, core_state
from engine.introspection.monitor import FINISHED_KEEP, FINISHED_TTL, EngineMonitor, Watcher
from engine.introspection.view import (
    BlockCounts,
    BlockState,
    EngineDelta,
    EngineGauges,
    EngineRates,
    EngineSnapshot,
    EngineTotals,
    EngineView,
    FinishedView,
    RequestView,
)

__all__ = [
    "FINISHED_KEEP",
    "FINISHED_TTL",
    "BlockCounts",
    "BlockState",
    "CoreState",
    "EngineDelta",
    "EngineGauges",
    "EngineMonitor",
    "EngineRates",
    "EngineSnapshot",
    "EngineTotals",
    "EngineView",
    "FinishedView",
    "RequestView",
    "Watcher",
    "core_state",
]
