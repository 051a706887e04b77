"""Shared fixtures. Tests build tiny models themselves; the default model is converted once.

Only GPU tests (@pytest.mark.gpu) and the instruction sets this CPU lacks (tests/isas.py)
may skip: any other skip, at collection or in a test, is reported as a failure, so a
missing tool or a native kernel that did not build or load fails the suite instead of
thinning it out unnoticed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from tests.isas import CPU_LACKS


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker runs on its own share of the CPUs (its servers and
    subprocesses inherit it): two workers' torch thread pools on the same cores would
    spin waiting for each other instead of working."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker is None or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    share = cpus[int(worker.removeprefix("gw")) % count :: count] if count <= len(cpus) else []
    if share:
        os.sched_setaffinity(0, share)


# The two longest files, a wheel build and the 30-second soak: a parallel run that started
# either late would end on it while the other workers sit idle.
LONGEST = ("test_wheel.py", "test_soak.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Orders whole files (their module fixtures start once): the longest, then the others
    with a slow test, then the rest. `make test` keeps this order (--dist loadfile
    --no-loadscope-reorder), so its workers end on short files."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: (item.path.name not in LONGEST, item.path not in slow))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from engine.models.default_model import prepare_default_model

    return prepare_default_model()


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _fail_the_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    reason = _skip_reason(report)
    report.outcome = "failed"
    report.longrepr = (
        f"only GPU tests and instruction sets this CPU lacks may skip; this one skipped: {reason}"
    )


@pytest.fixture(autouse=True)
def _auto_cpu_isa() -> Generator[None, None, None]:
    """Puts the native kernels' instruction set back on auto after each test: a test that
    selects another (select_cpu_isa, an engine with cpu_isa) changes no other test."""
    yield
    if "engine.ops.loader" in sys.modules:
        from engine.ops.loader import select_cpu_isa

        select_cpu_isa("auto")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator:
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail") or item.get_closest_marker("gpu"):
        return
    if not _skip_reason(report).startswith(CPU_LACKS):
        _fail_the_skip(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator:
    outcome = yield
    report = outcome.get_result()
    if report.skipped:
        _fail_the_skip(report)
