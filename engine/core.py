"""EngineCore: one scheduling step at a time. Not thread-safe; the caller serialises."""

from __future__ import annotations

from collections.abc import Iterable

from engine.model_runner import ModelRunner
from engine.request import Request
from engine.scheduler import Scheduler, StepResult


class EngineCore:
    def __init__(
        self, scheduler: Scheduler, runner: ModelRunner, check_invariants: bool = False
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.check_invariants = check_invariants

    def add_request(self, request: Request) -> None:
        """Mutates: queues a request. Raises ValueError for one that can never run."""
        if request.sampling_params.n != 1:
            raise ValueError("EngineCore takes n=1 requests; fan out with SamplingParams.for_child")
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Mutates: ends the requests and frees their blocks; unknown ids are ignored."""
        return self.scheduler.finish_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> StepResult:
        """Mutates: schedules, runs the model and applies its output."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output)
        result = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.check_invariants:
            self.scheduler.kv_cache.check_invariants()
        return result
