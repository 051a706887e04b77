"""Shared fixtures. Tests build tiny models themselves; the default model is converted once.

Only GPU tests (@pytest.mark.gpu) and the instruction sets this CPU lacks (tests/isas.py)
may skip: any other skip, at collection or in a test, is reported as a failure, so a
missing tool or a native kernel that did not build or load fails the suite instead of
thinning it out unnoticed.
"""

from __future__ import annotations

import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from tests.isas import CPU_LACKS


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
