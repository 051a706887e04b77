"""pagedserve's engine: scheduling, the paged KV cache and model execution. No HTTP here.

This module is the engine's public API; callers (the HTTP gateway among them) import
nothing else. `LLM` is the offline face, `AsyncLLM` the asyncio one; both take
EngineArgs fields and yield RequestOutputs. They are imported lazily, so the pure-Python
parts (scheduler, KV cache, configs) load without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.config import EngineArgs, EngineHooks, check_scheduling_options
from engine.cpu_share import ThreadTimes, own_cgroup_cpu_dir, read_throttling
from engine.errors import EngineClosedError, EngineDeadError, RequestValidationError
from engine.introspection import (
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
from engine.kv_cache.salt import scoped_cache_salt
from engine.lora import LoRAError, LoRARequest
from engine.models.default_model import DEFAULT_MODEL_NAME, cache_root, prepare_default_model
from engine.outputs import (
    CompletionOutput,
    FinishedRequestStats,
    IterationStats,
    Logprobs,
    RequestOutput,
)
from engine.pooling import PoolingParams
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.scheduler.output import SchedulerStats
from engine.streams import RequestStream
from engine.structured_output.params import ReasoningBounds, StructuredOutputsParams

if TYPE_CHECKING:
    from engine.async_llm import AsyncLLM, StatsListener
    from engine.core_client import CoreStart, discard_prestarted, prestart_core, start_core
    from engine.core_proc import CoreChannel
    from engine.llm import LLM
    from engine.worker.worker import check_cpu_kernels, describe_setup

__all__ = [
    "DEFAULT_MODEL_NAME",
    "LLM",
    "AsyncLLM",
    "BlockCounts",
    "BlockState",
    "CompletionOutput",
    "CoreChannel",
    "CoreStart",
    "EngineArgs",
    "EngineClosedError",
    "EngineDeadError",
    "EngineDelta",
    "EngineGauges",
    "EngineHooks",
    "EngineRates",
    "EngineSnapshot",
    "EngineTotals",
    "EngineView",
    "FinishedRequestStats",
    "FinishedView",
    "IterationStats",
    "LoRAError",
    "LoRARequest",
    "Logprobs",
    "PoolingParams",
    "ReasoningBounds",
    "RequestOutput",
    "RequestOutputKind",
    "RequestStream",
    "RequestValidationError",
    "RequestView",
    "SamplingParams",
    "SchedulerStats",
    "StatsListener",
    "StructuredOutputsParams",
    "ThreadTimes",
    "cache_root",
    "check_cpu_kernels",
    "check_scheduling_options",
    "describe_setup",
    "discard_prestarted",
    "own_cgroup_cpu_dir",
    "prepare_default_model",
    "prestart_core",
    "read_throttling",
    "scoped_cache_salt",
    "start_core",
]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name in ("AsyncLLM", "StatsListener"):
        from engine import async_llm

        return getattr(async_llm, name)
    if name in ("CoreStart", "start_core", "prestart_core", "discard_prestarted"):
        from engine import core_client

        return getattr(core_client, name)
    if name == "CoreChannel":
        from engine.core_proc import CoreChannel

        return CoreChannel
    if name in ("check_cpu_kernels", "describe_setup"):
        from engine.worker import worker

        return getattr(worker, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
