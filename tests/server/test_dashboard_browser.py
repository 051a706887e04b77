"""The dashboard in headless Chromium (Debian's package) against a real server under a
shared-prefix workload: what the page shows, read from its DOM, and a screenshot."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from PIL import Image

from tests.browser import Chromium
from tests.server.conftest import tiny_engine
from tests.server.live import LiveServer

NUM_BLOCKS = 320
PREFIX = " ".join(f"t{10 + i}" for i in range(48))  # three full blocks, shared by all


def count(state: str) -> str:
    return f"Number(document.getElementById('count-{state}').textContent)"


@contextmanager
def shared_prefix_workload(url: str, concurrency: int = 8) -> Iterator[None]:
    """Waves of concurrent completions that share a prefix, until the block exits."""
    stop = threading.Event()
    errors: list[str] = []

    def one(i: int) -> None:
        body = {"prompt": f"{PREFIX} t{100 + i}", "max_tokens": 120, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        if response.status_code != 200:
            errors.append(response.text)

    def waves() -> None:
        while not stop.is_set():
            threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

    runner = threading.Thread(target=waves)
    runner.start()
    try:
        yield
    finally:
        stop.set()
        runner.join(timeout=120)
    assert errors == []


def test_the_dashboard_shows_the_pool_at_work(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = tiny_engine(tiny_model_dir, num_kv_blocks=NUM_BLOCKS)
    with LiveServer(engine, served_model_name="tiny") as server, Chromium(tmp_path) as browser:
        browser.navigate(f"{server.url}/dashboard")
        browser.wait_for("document.body.dataset.seq !== undefined", timeout=30)
        grid = browser.evaluate(
            "[document.getElementById('grid').dataset.blocks,"
            " document.querySelectorAll('#grid i').length]"
        )
        assert grid == [str(NUM_BLOCKS), NUM_BLOCKS]
        assert browser.evaluate(count("never_used")) == NUM_BLOCKS
        assert browser.evaluate("document.getElementById('model').textContent") == "tiny"

        with shared_prefix_workload(server.url):
            shared = browser.wait_for(f"{count('shared')} > 0 && {count('shared')}")
            assert shared >= 3
            browser.wait_for("document.querySelectorAll('#running tbody tr').length >= 2")
            browser.wait_for(
                "document.querySelectorAll('#grid i.s4').length > 0"
                " && document.querySelectorAll('#grid i.s3').length > 0"
            )
            shot = browser.screenshot(tmp_path / "dashboard-under-load.png")

        browser.wait_for(f"{count('in_use')} === 0 && {count('shared')} === 0")
        idle = browser.evaluate(
            "[document.getElementById('num-running').textContent,"
            " document.querySelectorAll('#grid i.s3, #grid i.s4').length,"
            " document.querySelectorAll('#grid i.s2').length,"
            " document.querySelectorAll('#finished tbody tr').length]"
        )
        assert idle[:2] == ["0", 0]
        assert idle[2] >= 3 and idle[3] >= 8  # the prefix stays cached; requests listed
        assert browser.console == [], "the page threw"
        # Everything the page loaded came from the server itself.
        origins = browser.evaluate(
            "performance.getEntriesByType('resource').map((e) => new URL(e.name).origin)"
        )
        assert set(origins) <= {server.url}

    image = Image.open(shot).convert("RGB")
    assert image.width >= 1000 and image.height >= 800
    colors = {color for _, color in image.getcolors(maxcolors=image.width * image.height)}
    assert len(colors) > 20, "the screenshot is blank"
    assert (245, 158, 11) in colors, "no shared block (orange) in the screenshot"


def test_a_large_pool_is_drawn_several_blocks_to_a_cell(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    engine = tiny_engine(tiny_model_dir, num_kv_blocks=10_000)
    with LiveServer(engine) as server, Chromium(tmp_path) as browser:
        browser.navigate(f"{server.url}/dashboard")
        browser.wait_for("document.body.dataset.seq !== undefined", timeout=30)
        grid = browser.evaluate(
            "(() => { const g = document.getElementById('grid');"
            " return [g.dataset.blocks, g.dataset.group, g.children.length,"
            " document.getElementById('grid-note').textContent]; })()"
        )
        assert grid[:3] == ["10000", "3", 3334]
        assert "one cell per 3 consecutive blocks" in grid[3]
        assert browser.evaluate(count("never_used")) == 10_000
