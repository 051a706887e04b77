"""EngineCore: one scheduling step at a time. Not thread-safe; the caller serialises.

`EngineCore.from_args` is where the parts are wired: the model's configuration and tokenizer,
the worker (device, weights, KV cache size, model runner), the scheduler over its KV cache
manager, and the structured-output manager that compiles request grammars.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, wait
from typing import TYPE_CHECKING, Any

from engine.config import (
    CacheConfig,
    EngineArgs,
    EngineConfig,
    EngineHooks,
    ModelConfig,
    check_scheduling_options,
    load_tokenizer,
    resolve_model_config,
    resolve_scheduler_config,
)
from engine.errors import RequestValidationError
from engine.introspection import CoreState, core_state
from engine.kv_cache import KVCacheManager
from engine.kv_events import KVEventsConfig
from engine.lora.request import LoRAError, LoRARequest
from engine.pooling import check_task
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler, SchedulerStats, StepResult
from engine.scheduler.output import ModelRunnerOutput, SchedulerOutput
from engine.spec_decode import (
    DraftModelProposer,
    Proposer,
    make_proposer,
    parse_speculative_config,
)
from engine.structured_output import StructuredOutputManager
from engine.worker.lora_manager import LoRAManager
from engine.worker.model_runner import ModelRunner, PendingOutput

if TYPE_CHECKING:
    from engine.kv_events.stream import KVEventStream
    from engine.worker.tensor_parallel import TensorParallelGroup

logger = logging.getLogger(__name__)
# With nothing to run but requests whose grammars compile, a step waits this long for one.
GRAMMAR_WAIT_S = 0.05


def check_draft_tokenizer(tokenizer: Any, draft: ModelConfig) -> None:
    """Raises ValueError unless the draft model's tokenizer maps every token as the
    target's `tokenizer` does: its drafts are token ids of the target's vocabulary."""
    if load_tokenizer(draft).get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            f"the draft model {draft.name} has another tokenizer than the target model; "
            "a draft model must share the target's vocabulary"
        )


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        config: EngineConfig,
        hooks: EngineHooks | None = None,
        tokenizer: Any = None,
        grammars: StructuredOutputManager | None = None,
        kv_events: KVEventStream | None = None,
        tp_group: TensorParallelGroup | None = None,
    ) -> None:
        """Without `grammars`, constrained requests are refused."""
        self.scheduler = scheduler
        self.runner = runner
        self.config = config
        self.hooks = hooks or EngineHooks()
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.kv_events = kv_events
        self.tp_group = tp_group
        self.num_steps = 0
        # Async scheduling: the step whose forward ran last and whose output is not applied
        # yet, with its sampled tokens on their way to the host.
        self.async_scheduling = config.scheduler.async_scheduling and runner.pooler is None
        self._in_flight: tuple[SchedulerOutput, PendingOutput] | None = None
        spec = config.speculative
        self.proposer: Proposer | None = None
        if spec is not None:
            self.proposer = make_proposer(spec, config.scheduler.max_model_len)

    @classmethod
    def from_args(cls, args: EngineArgs, hooks: EngineHooks | None = None) -> EngineCore:
        """Loads the model and builds every part; raises ValueError for a setting that
        cannot work (and FileNotFoundError for a missing model)."""
        from engine.worker.worker import Worker

        hooks = hooks or EngineHooks()
        check_scheduling_options(args)
        events_config = KVEventsConfig.from_json(args.kv_events_config)
        model_config = resolve_model_config(args)
        worker = Worker(args, model_config)
        scheduler_config = resolve_scheduler_config(
            args, model_config, worker.device_config.device_type
        )
        groups = worker.kv_cache_groups(args)
        cache_config = CacheConfig(
            args.block_size,
            worker.num_kv_blocks(args, scheduler_config, groups),
            args.enable_prefix_caching,
            groups,
        )
        speculative = parse_speculative_config(args.speculative_config)
        config = EngineConfig(
            model_config,
            worker.device_config,
            scheduler_config,
            cache_config,
            worker.quant_config,
            speculative,
            worker.lora_config,
        )
        logger.info("engine: %s", config.describe())
        runner = worker.create_runner(cache_config, hooks.profile)
        kv_events = None
        if events_config.enabled:
            from engine.kv_events.stream import KVEventStream

            kv_events = KVEventStream(events_config, cache_config.block_size)
        kv_manager = KVCacheManager(
            cache_config.num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            kv_events.recorder if kv_events is not None else None,
            model_config.arch.kv_window if groups is None else None,
            None if groups is None else groups.windows,
        )
        tokenizer = load_tokenizer(model_config)
        if worker.draft_config is not None:
            check_draft_tokenizer(tokenizer, worker.draft_config)
        arch = model_config.arch
        grammars = StructuredOutputManager.for_tokenizer(
            tokenizer, arch.vocab_size, arch.eos_token_ids
        )
        scheduler = Scheduler(scheduler_config, kv_manager)
        core = cls(
            scheduler, runner, config, hooks, tokenizer, grammars, kv_events, worker.tp_group
        )
        if config.lora is not None:
            for lora in config.lora.module_requests():  # --lora-modules: refused up front
                core.add_lora(lora)
        return core

    def add_request(self, request: Request) -> None:
        """Queues one engine request (one choice: n == 1). Raises RequestValidationError for
        a request that can never run."""
        if request.sampling_params.n != 1:
            raise ValueError("EngineCore takes n=1 requests; fan out with SamplingParams.for_child")
        check_task(self.config.model.pooler, request.pooling_params)
        if request.lora is not None:  # in host memory from now until the request ends
            self._lora_manager(request.lora.lora_name).add(request.lora)
        constraint = request.sampling_params.structured_outputs
        if constraint is not None:
            if self.grammars is None:
                raise RequestValidationError(
                    "this engine has no grammar engine", "structured_outputs"
                )
            request.structured = self.grammars.request_grammar(constraint)
        self.scheduler.add_request(request)

    def add_lora(self, lora: LoRARequest) -> None:
        """Reads and checks a LoRA adapter now, so that requests naming it can run; raises
        LoRAError for one that cannot (or when LoRA is not enabled)."""
        self._lora_manager(lora.lora_name).add(lora)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drops a LoRA adapter's weights; whether they were loaded. Requests that still
        use it finish with it (its weights go once they have ended)."""
        return self._lora_manager(str(lora_int_id)).remove(lora_int_id)

    def _lora_manager(self, name: str) -> LoRAManager:
        manager = getattr(self.runner, "lora", None)
        if manager is None:
            raise LoRAError(f"LoRA adapter {name!r}: this server runs without --enable-lora")
        manager.in_use = self._loras_in_use
        return manager

    def _loras_in_use(self) -> set[int]:
        requests = self.scheduler.requests.values()
        return {r.lora.lora_int_id for r in requests if r.lora is not None}

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Ends the requests and frees their blocks; unknown or finished ids are ignored."""
        return self.scheduler.finish_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def stats(self) -> SchedulerStats:
        """The scheduler's gauges now (and its counters since the last step or call)."""
        return self.scheduler.stats()

    def step(self) -> StepResult:
        """Schedules, runs the model and applies its output."""
        fail_after = self.hooks.fail_after_steps
        if fail_after is not None and self.num_steps >= fail_after:
            raise RuntimeError("injected engine step failure (test hook)")
        if self.hooks.step_delay:
            time.sleep(self.hooks.step_delay)
        if self.async_scheduling:
            result = self._overlapped_step()
        else:
            scheduler_output = self.scheduler.schedule()
            if not scheduler_output.scheduled:
                self._wait_for_grammars()
            start = time.perf_counter()
            runner_output = self.runner.execute(scheduler_output)
            self.scheduler.observe_step_time(time.perf_counter() - start)
            result = self.scheduler.update_from_output(scheduler_output, runner_output)
            if isinstance(self.proposer, DraftModelProposer):
                self.proposer.propose(self.scheduler.running, runner_output.draft_token_ids)
            elif self.proposer is not None:
                self.proposer.propose(self.scheduler.running)
        if self.hooks.check_invariants:
            self.scheduler.kv_cache.check_invariants()
        if self.kv_events is not None:
            self.kv_events.flush()
        self.num_steps += 1
        return result

    def _overlapped_step(self) -> StepResult:
        """Async scheduling: schedules and launches step N+1 before applying step N's
        output, so that on a GPU the host's work for N (stop checks, detokenization's
        inputs, the outputs' trip to the frontend) runs while the device computes N+1.
        Step N+1's decode inputs are N's sampled tokens, read on the device. Returns step
        N's result (empty on the first call); N+1 samples after N's output is applied, so
        its grammars, penalties and seeds see every token, as in a synchronous step."""
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled and self._in_flight is None:
            self._wait_for_grammars()
        step = self.runner.forward(scheduler_output)
        if self._in_flight is None:
            result = self.scheduler.update_from_output(SchedulerOutput([]), ModelRunnerOutput({}))
        else:
            previous, pending = self._in_flight
            result = self.scheduler.update_from_output(previous, pending.result())
        self._in_flight = None
        if step is not None:
            self._in_flight = (scheduler_output, self.runner.sample(step))
        return result

    def _wait_for_grammars(self) -> None:
        """Nothing could run because the waiting requests' grammars are still compiling:
        sleep on them briefly instead of spinning (the caller comes back between waits)."""
        compiling = [
            r.structured.compiled
            for r in self.scheduler.waiting
            if r.structured is not None and r.status is RequestStatus.WAITING_FOR_GRAMMAR
        ]
        if compiling:
            wait(compiling, timeout=GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)

    def state(self) -> CoreState:
        """What the live view reads, between steps."""
        return core_state(self.scheduler, self.num_steps)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (publishing AllBlocksCleared) when no request holds
        KV blocks; returns whether it did."""
        done = self.scheduler.kv_cache.reset_prefix_cache()
        if self.kv_events is not None:
            self.kv_events.flush()
        return done

    def failure(self) -> str | None:
        """Why no step can run any more though the engine itself is fine (a tensor-parallel
        worker died), or None."""
        return None if self.tp_group is None else self.tp_group.failure()

    def close(self) -> None:
        """Releases what outlives steps: the grammar compiler's threads, the KV events
        publisher's sockets and thread, the tensor-parallel workers."""
        if self.grammars is not None:
            self.grammars.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        if self.tp_group is not None:
            self.tp_group.close()
            self.tp_group = None
