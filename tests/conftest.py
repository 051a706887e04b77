"""Shared fixtures. Tests build tiny models themselves; the default model is converted once.

Only GPU tests (@pytest.mark.gpu) may skip: any other skip, at collection or in a test,
is reported as a failure, so a missing tool or a native kernel that did not build or
load fails the suite instead of thinning it out unnoticed.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from engine.models.default_model import prepare_default_model

    return prepare_default_model()


def _fail_the_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    report.outcome = "failed"
    report.longrepr = f"only GPU tests may skip; this one skipped: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator:
    outcome = yield
    report = outcome.get_result()
    expected_failure = hasattr(report, "wasxfail")
    if report.skipped and not expected_failure and item.get_closest_marker("gpu") is None:
        _fail_the_skip(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator:
    outcome = yield
    report = outcome.get_result()
    if report.skipped:
        _fail_the_skip(report)
