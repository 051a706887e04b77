"""StructuredOutputManager: compiles grammars off the event loop and off the step.

Compilation runs on the manager's own threads and is cached by GrammarKey, so the n choices
of a prompt, and every later request with the same schema, share one compiled grammar. A
request whose grammar is still compiling waits (the scheduler skips it without holding up
others); the step never compiles. The grammar engine is loaded on the first constrained
request, so an engine that never sees one never pays for its tokenizer tables.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine.structured_output.params import GrammarKey, StructuredOutputsParams
from engine.structured_output.request import CompiledGrammar, StructuredOutputRequest

# Compiles a key; raises RequestValidationError for a grammar that cannot compile.
Compiler = Callable[[GrammarKey], CompiledGrammar]


class StructuredOutputManager:
    def __init__(
        self,
        compiler_factory: Callable[[], Compiler],
        max_workers: int = 2,
        cache_size: int = 512,
    ) -> None:
        """`compiler_factory` builds the compiler once, on a compile thread, on first use."""
        self._factory = compiler_factory
        self._compiler: Compiler | None = None
        self._compiler_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[GrammarKey, Future[CompiledGrammar]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._cache_size = cache_size

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> StructuredOutputManager:
        """The production manager: llguidance over the model's tokenizer."""

        def factory() -> Compiler:
            from engine.structured_output.backend import LLGuidanceBackend

            return LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids).compile

        return cls(factory)

    def compile(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """The compiled grammar for `params`, from the cache or a compile thread. The future
        fails with RequestValidationError for a grammar that cannot compile."""
        key = params.key()
        with self._cache_lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, key)
            self._cache[key] = future
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return future

    def request_grammar(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """A new request's grammar state (its matcher is created once compiled)."""
        return StructuredOutputRequest(self.compile(params), params.reasoning)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, key: GrammarKey) -> CompiledGrammar:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = self._factory()
        return self._compiler(key)
