"""What a process's threads wait for a CPU, and its cgroup's CPU limit (engine.cpu_share)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.cpu_share import ThreadTimes, cpu_limit, own_cgroup_cpu_dir, read_throttling

# Sleeps while the test pins it, then spins for 0.4 s of its own CPU time.
SPIN = "import time\ntime.sleep(0.2)\nwhile time.thread_time() < 0.4: pass"


def fake_task(proc: Path, pid: int, tid: int, cpu_ns: int, wait_ns: int) -> None:
    task = proc / str(pid) / "task" / str(tid)
    task.mkdir(parents=True, exist_ok=True)
    (task / "schedstat").write_text(f"{cpu_ns} {wait_ns} 7\n")


def test_thread_times_sum_the_threads_and_keep_an_exited_threads_time(tmp_path) -> None:
    fake_task(tmp_path, 10, 10, 2_000_000_000, 500_000_000)
    fake_task(tmp_path, 10, 11, 1_000_000_000, 250_000_000)
    times = ThreadTimes(10, proc=tmp_path)
    assert times.read() == pytest.approx((3.0, 0.75))
    (tmp_path / "10" / "task" / "11" / "schedstat").unlink()
    (tmp_path / "10" / "task" / "11").rmdir()
    fake_task(tmp_path, 10, 10, 2_500_000_000, 600_000_000)
    assert times.read() == pytest.approx((3.5, 0.85))  # thread 11's last reading stays
    fake_task(tmp_path, 10, 12, 100_000_000, 0)
    assert times.read() == pytest.approx((3.6, 0.85))
    assert ThreadTimes(99, proc=tmp_path).read() is None  # no such process


def test_thread_times_count_a_threads_cpu_time_here() -> None:
    times = ThreadTimes(os.getpid())
    first = times.read()
    if first is None:
        pytest.fail("this kernel keeps no /proc/<pid>/task/<tid>/schedstat")
    end = time.thread_time() + 0.2
    while time.thread_time() < end:
        pass
    cpu, wait = times.read()  # type: ignore[misc]
    assert cpu - first[0] >= 0.19
    assert wait >= first[1]


def test_two_processes_on_one_cpu_each_wait_for_it() -> None:
    """Run-queue wait is real time: two processes pinned to one CPU, each spinning for
    0.4 s of CPU, each wait about as long for the other."""
    cpu = min(os.sched_getaffinity(0))
    procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(2)]
    for proc in procs:
        os.sched_setaffinity(proc.pid, {cpu})
    times = [ThreadTimes(proc.pid) for proc in procs]
    last: list[tuple[float, float] | None] = [None, None]
    while any(proc.poll() is None for proc in procs):
        for i, reader in enumerate(times):
            last[i] = reader.read() or last[i]
        time.sleep(0.01)
    for reading in last:
        assert reading is not None
        ran, waited = reading
        assert ran > 0.3 and waited > 0.15, reading


@pytest.mark.parametrize(
    ("lines", "layout", "found"),
    [
        # v2 in a cgroup namespace: the group is the mount's root
        ("0::/\n", {"cgroup.controllers": "", "cpu.stat": "usage_usec 1\n"}, ("", "v2")),
        # v2 seen from the host: the group below the root
        ("0::/kubepods/pod1/c1\n", {"cgroup.controllers": "", "kubepods/pod1/c1/cpu.stat": ""},
         ("kubepods/pod1/c1", "v2")),
        # v1, the host's path inside a container whose group is mounted as the root
        ("4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n", {"cpu,cpuacct/cpu.stat": ""},
         ("cpu,cpuacct", "v1")),
        ("2:cpu,cpuacct:/a\n", {"cpu/a/cpu.stat": "", "cpu/cpu.stat": ""}, ("cpu/a", "v1")),
        # a hybrid host's empty v2 line is no CPU controller
        ("0::/\n1:name=systemd:/\n", {"unified/cgroup.controllers": ""}, None),
    ],
)  # fmt: skip
def test_own_cgroup_is_found_for_each_layout(tmp_path, lines, layout, found) -> None:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(lines)
    for name, text in layout.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    got = own_cgroup_cpu_dir(proc=proc, root=root)
    assert got == (None if found is None else (root / found[0], found[1]))


def test_throttling_and_limit_read_both_cgroup_versions(tmp_path) -> None:
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir(), v1.mkdir()
    (v2 / "cpu.stat").write_text(
        "usage_usec 9\nnr_periods 40\nnr_throttled 10\nthrottled_usec 250000\n"
    )
    (v2 / "cpu.max").write_text("150000 100000\n")
    (v1 / "cpu.stat").write_text("nr_periods 8\nnr_throttled 2\nthrottled_time 3000000000\n")
    (v1 / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    t2, t1 = read_throttling(v2), read_throttling(v1)
    assert t2 is not None and (t2.periods, t2.throttled_periods) == (40, 10)
    assert t2.throttled_s == pytest.approx(0.25)
    assert t1 is not None and (t1.periods, t1.throttled_periods, t1.throttled_s) == (8, 2, 3.0)
    assert cpu_limit(v2, "v2") == 1.5 and cpu_limit(v1, "v1") == 0.5
    (v2 / "cpu.max").write_text("max 100000\n")
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_limit(v2, "v2") is None and cpu_limit(v1, "v1") is None
    (v2 / "cpu.stat").write_text("usage_usec 9\n")  # no CPU controller enabled here
    assert read_throttling(v2) is None and read_throttling(tmp_path / "none") is None
