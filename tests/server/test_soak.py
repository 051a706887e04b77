"""The soak (tests/server/soak.py) for 30 seconds; `make soak` runs it for 10 minutes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.server.soak import check, run_soak


@pytest.mark.slow
def test_half_a_minute_of_random_load_leaves_nothing_behind(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    figures = run_soak(tiny_model_dir, duration=30, log=tmp_path / "server.log")
    print(json.dumps(figures, indent=2))
    assert check(figures) == []
    # The run did what it says: real traffic, hang-ups and invalid bodies among it.
    assert figures["statuses"].get("200", 0) > 200
    assert figures["hangups"] > 10 and figures["invalid"] > 0
    assert figures["statuses"].get("400", 0) >= figures["invalid"]
