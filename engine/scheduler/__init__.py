"""The V1 scheduler and its typed outputs. Pure Python: no torch here."""

from engine.scheduler.output import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
    StepResult,
)
from engine.scheduler.scheduler import Scheduler

__all__ = [
    "EngineCoreOutput",
    "ModelRunnerOutput",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
    "StepResult",
]
