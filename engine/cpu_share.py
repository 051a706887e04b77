"""How much CPU a process gets: its threads' run-queue waits, and its cgroup's CPU limit.

On a shared node a CPU pod has neighbours, and a CPU limit throttles it. Either way the
engine's threads are ready to run and do not. The kernel counts that time for every
thread: `run_delay` in /proc/<pid>/task/<tid>/schedstat is the time it was runnable and
not running, whether other processes held the CPUs or the cgroup's CFS quota was spent.
The cgroup's `cpu.stat` counts the quota's periods and the throttled ones.

StepThreads reads them between steps; the server's metrics read them at each scrape.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
CGROUP = Path("/sys/fs/cgroup")


class ThreadTimes:
    """A process's CPU time and run-queue wait, summed over its threads as counters: a
    thread's last reading is kept once it exits, so neither sum goes back."""

    def __init__(self, pid: int, proc: Path = PROC) -> None:
        self.tasks = proc / str(pid) / "task"
        self._last: dict[str, tuple[int, int]] = {}  # live tid: (cpu ns, wait ns)
        self._gone = (0, 0)  # the exited threads' last readings

    def read(self) -> tuple[float, float] | None:
        """(CPU seconds, run-queue wait seconds) so far; None when the process is gone or
        the kernel keeps no schedstat."""
        try:
            tids = os.listdir(self.tasks)
        except OSError:
            return None
        now: dict[str, tuple[int, int]] = {}
        for tid in tids:
            try:
                fields = (self.tasks / tid / "schedstat").read_text().split()
                now[tid] = (int(fields[0]), int(fields[1]))
            except (OSError, ValueError, IndexError):
                continue  # exited since the listing, or no schedstat on this kernel
        if not now:
            return None
        gone_cpu, gone_wait = self._gone
        for tid, (cpu_ns, wait_ns) in self._last.items():
            if tid not in now:
                gone_cpu, gone_wait = gone_cpu + cpu_ns, gone_wait + wait_ns
        self._gone, self._last = (gone_cpu, gone_wait), now
        total_cpu = gone_cpu + sum(c for c, _ in now.values())
        total_wait = gone_wait + sum(w for _, w in now.values())
        return total_cpu / 1e9, total_wait / 1e9


def own_cgroup_cpu_dir(proc: Path = PROC, root: Path = CGROUP) -> tuple[Path, str] | None:
    """This process's cgroup directory that holds its CPU controller's files, and the
    cgroup version ("v2" or "v1"); None where neither is mounted where this process sees it.

    A container in a cgroup namespace of its own sees its group as the mount's root; one
    without sees the host's path in /proc/self/cgroup, and its group still mounted as the
    root, so the root is the fallback."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":
            if not (root / "cgroup.controllers").exists():
                continue  # a hybrid host's v2 tree, without the CPU controller
            candidates, version = [root / relative, root], "v2"
        elif "cpu" in controllers.split(","):
            mounts = [root / "cpu", root / "cpu,cpuacct"]
            candidates, version = [m / relative for m in mounts] + mounts, "v1"
        else:
            continue
        for candidate in candidates:
            if (candidate / "cpu.stat").is_file():
                return candidate, version
    return None


@dataclass(frozen=True)
class Throttling:
    periods: int  # CFS periods with the quota enforced
    throttled_periods: int  # of which the group used up its quota
    throttled_s: float  # wall time the group was held


def read_throttling(group: Path) -> Throttling | None:
    """The CFS counters in a cgroup directory's cpu.stat (v2 `throttled_usec`, v1
    `throttled_time` in ns); None where it holds none."""
    try:
        text = (group / "cpu.stat").read_text()
        fields = dict(line.split()[:2] for line in text.splitlines() if line.strip())
        periods, throttled = int(fields["nr_periods"]), int(fields["nr_throttled"])
        if "throttled_usec" in fields:
            seconds = int(fields["throttled_usec"]) / 1e6
        else:
            seconds = int(fields["throttled_time"]) / 1e9
    except (OSError, ValueError, KeyError):
        return None
    return Throttling(periods, throttled, seconds)


def cpu_limit(group: Path, version: str) -> float | None:
    """The CPUs a cgroup's CFS quota allows (1.5 for 150000 per 100000 us); None without a
    quota or where it cannot be read."""
    try:
        if version == "v2":
            quota_text, period_text = (group / "cpu.max").read_text().split()
            return None if quota_text == "max" else int(quota_text) / int(period_text)
        quota = int((group / "cpu.cfs_quota_us").read_text())
        period = int((group / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
