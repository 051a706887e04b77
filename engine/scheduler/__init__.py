"""The V1 scheduler and its typed outputs. Pure Python: no torch here."""

from engine.scheduler.output import (
    EngineCoreOutput,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
    StepResult,
)
from engine.scheduler.scheduler import Scheduler

__all__ = [
    "EngineCoreOutput",
    "Logprobs",
    "ModelRunnerOutput",
    "NewRequestData",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
    "StepResult",
]
