"""Structured outputs: constraints (params), their compilation (manager, on its own threads)
and each request's grammar state (request). Pure Python except `backend`, the grammar engine,
which the manager loads on first use; the scheduler sees only the GrammarMatcher protocol."""

from engine.structured_output.manager import StructuredOutputManager
from engine.structured_output.params import (
    GrammarKey,
    ReasoningBounds,
    StructuredOutputsParams,
)
from engine.structured_output.request import (
    CompiledGrammar,
    GrammarMatcher,
    StructuredOutputRequest,
)

__all__ = [
    "CompiledGrammar",
    "GrammarKey",
    "GrammarMatcher",
    "ReasoningBounds",
    "StructuredOutputManager",
    "StructuredOutputRequest",
    "StructuredOutputsParams",
]
