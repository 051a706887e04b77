"""pagedserve's engine: scheduling, the paged KV cache and model execution. No HTTP here.

`from engine import LLM, SamplingParams` is the offline API. LLM is imported lazily so
the pure-Python parts (scheduler, KV cache) load without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm import LLM

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
