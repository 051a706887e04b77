"""How much CPU the engine gets, read at scrape time (engine.worker.cpu_share), so stepping
pays nothing for it:

- `pagedserve:engine_cpu_seconds_total`: CPU time of the engine's process (the engine core,
  or the server's own process with --engine-in-process), summed over its threads;
- `pagedserve:engine_cpu_wait_seconds_total`: the time those threads were runnable but
  waited for a CPU, because other processes held the cores or a CPU limit throttled the
  container. Its rate over the first's is near 0 on cores of its own;
- `pagedserve:cpu_cfs_periods_total`, `pagedserve:cpu_cfs_throttled_periods_total` and
  `pagedserve:cpu_cfs_throttled_seconds_total`: the server's cgroup's CFS quota periods,
  those in which it used up its CPU limit, and how long it was held; only where the cgroup
  has a limit to enforce.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from engine import ThreadTimes, own_cgroup_cpu_dir, read_throttling


class EngineCpuCollector(Collector):
    """The series above for the engine's process `pid`, labelled with `model_name`."""

    def __init__(self, pid: int, model_name: str) -> None:
        self.model_name = model_name
        self.threads = ThreadTimes(pid)

    def collect(self) -> Iterator[CounterMetricFamily]:
        times = self.threads.read()
        if times is not None:
            cpu, wait = times
            yield self._counter(
                "pagedserve:engine_cpu_seconds",
                "CPU time of the engine's process, summed over its threads.",
                cpu,
            )
            yield self._counter(
                "pagedserve:engine_cpu_wait_seconds",
                "Time the engine's threads were runnable but waited for a CPU (other "
                "processes on its cores, or its CPU limit's throttling).",
                wait,
            )
        group = own_cgroup_cpu_dir()  # looked up each time: a process may change groups
        throttling = None if group is None else read_throttling(group[0])
        if throttling is not None and throttling.periods:
            yield self._counter(
                "pagedserve:cpu_cfs_periods",
                "CFS quota periods enforced on the server's cgroup.",
                throttling.periods,
            )
            yield self._counter(
                "pagedserve:cpu_cfs_throttled_periods",
                "CFS quota periods in which the server's cgroup used up its CPU limit.",
                throttling.throttled_periods,
            )
            yield self._counter(
                "pagedserve:cpu_cfs_throttled_seconds",
                "Time the server's cgroup was held back by its CPU limit.",
                throttling.throttled_s,
            )

    def describe(self) -> list[CounterMetricFamily]:
        return []  # which series exist depends on the machine: found at each collect

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family
