"""What watching the engine costs it: view capture and encoding time against step time.

    .venv/bin/python benchmarks/dashboard_overhead.py --duration 60 --concurrency 64

Serves the default model (or --model) in-process with --max-num-seqs equal to the
concurrency, keeps that many requests running (closed loop, token-id prompts sharing a
prefix, ignore_eos), and runs two phases of --duration seconds: no viewer, then one viewer
reading /dashboard/events. It times every EngineCore.step (the worker thread), every view the
engine takes (EngineMonitor.capture, on the event loop between steps) and every view encoded
for the feed (server.dashboard.encode_view), and reports views and encoding as a share of
step time. Then it times one view of fully used pools of many blocks, the GPU-sized case.
With --screenshot PATH it also saves the page under load, through headless Chromium.

Not a test: nothing is asserted. The machine is shared, so absolute times are noisy; the
share is a ratio of times taken in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from PIL import Image

from engine import AsyncLLM, EngineArgs, prepare_default_model
from engine.core import EngineCore
from engine.introspection import EngineMonitor
from engine.introspection.capture import block_states, eviction_order
from engine.kv_cache import BlockHash, BlockPool
from server import dashboard
from server.app import create_app
from server.settings import ServerSettings

ROOT = Path(__file__).resolve().parent.parent


class Timer:
    """Wraps `owner.name` so every call's duration is recorded (in seconds)."""

    def __init__(self, owner: Any, name: str) -> None:
        self.samples: list[float] = []
        original: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.samples.append(time.perf_counter() - start)

        setattr(owner, name, timed)

    def take(self) -> list[float]:
        samples, self.samples = self.samples, []
        return samples


def start_server(args: argparse.Namespace) -> tuple[uvicorn.Server, str, int]:
    """The server in a thread, its URL, and the model's vocabulary size."""
    engine_args = EngineArgs(
        model=args.model or str(prepare_default_model()),
        max_num_seqs=args.concurrency,
        num_kv_blocks=args.num_kv_blocks,
    )
    settings = ServerSettings(host="127.0.0.1", port=args.port, log_requests=False)
    engine = AsyncLLM.from_engine_args(engine_args)
    app = create_app(engine, settings)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{args.port}"
    while True:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return server, url, engine.config.model.arch.vocab_size
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


async def closed_loop(url: str, args: argparse.Namespace, stop: threading.Event) -> None:
    """Keeps `concurrency` requests in flight until `stop`."""
    rng = random.Random(0)
    top = min(args.vocab_size, 20000)
    prefix = [rng.randrange(3, top) for _ in range(args.prefix_len)]

    async def worker(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            prompt = prefix + [rng.randrange(3, top) for _ in range(args.input_len)]
            body = {"prompt": prompt, "max_tokens": args.output_len, "ignore_eos": True}
            response = await client.post(f"{url}/v1/completions", json=body)
            response.raise_for_status()

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))


@contextlib.contextmanager
def under_load(url: str, args: argparse.Namespace) -> Iterator[None]:
    """The closed loop runs in a thread for the duration of the block, after a warm-up."""
    stop = threading.Event()
    load = threading.Thread(target=lambda: asyncio.run(closed_loop(url, args, stop)))
    load.start()
    time.sleep(args.warmup)
    try:
        yield
    finally:
        stop.set()
        load.join()


def generated_tokens(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("vllm:generation_tokens_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError("no vllm:generation_tokens_total in /metrics")


def viewer(url: str, stop: threading.Event, received: list[int]) -> None:
    with httpx.stream("GET", f"{url}/dashboard/events", timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                received.append(len(line))
            if stop.is_set():
                return


def phase(url: str, args: argparse.Namespace, watch: bool, timers: dict[str, Timer]) -> dict:
    stop, received = threading.Event(), []
    watcher = threading.Thread(target=viewer, args=(url, stop, received))
    with under_load(url, args):
        for timer in timers.values():
            timer.take()
        tokens = generated_tokens(url)
        if watch:
            watcher.start()
        time.sleep(args.duration)
        samples = {name: timer.take() for name, timer in timers.items()}
        tokens = generated_tokens(url) - tokens
        stop.set()
    if watch:
        watcher.join()
    return {"tokens_per_s": tokens / args.duration, **summarize(samples, received)}


def summarize(samples: dict[str, list[float]], received: list[int]) -> dict:
    step_s = sum(samples["step"])
    views_s = sum(samples["capture"]) + sum(samples["encode"])
    out = {
        "steps": len(samples["step"]),
        "step_ms_mean": 1000 * step_s / max(1, len(samples["step"])),
        "views": len(samples["capture"]),
        "events_received": len(received),
        "event_kb_mean": statistics.fmean(received) / 1000 if received else 0.0,
        "view_share_of_step_time": views_s / step_s if step_s else 0.0,
    }
    for name in ("capture", "encode"):
        if samples[name]:
            out[f"{name}_ms_mean"] = 1000 * statistics.fmean(samples[name])
            out[f"{name}_ms_max"] = 1000 * max(samples[name])
    return out


def take_screenshot(url: str, args: argparse.Namespace) -> None:
    """The page under load after a minute of charts, through the tests' Chromium helper."""
    sys.path.insert(0, str(ROOT))
    from tests.browser import Chromium

    with (
        under_load(url, args),
        tempfile.TemporaryDirectory() as workdir,
        Chromium(Path(workdir), 1280, 1400) as browser,
    ):
        browser.navigate(f"{url}/dashboard")
        time.sleep(60)
        data = browser.call("Page.captureScreenshot", format="png")["data"]
    # 128 colours (octree keeps the page's few flat colours exact) keep the PNG small.
    image = Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")
    small = image.quantize(colors=128, method=Image.Quantize.FASTOCTREE)
    small.save(args.screenshot, optimize=True)


def pool_view_cost(num_blocks: int, repeats: int = 5) -> dict:
    """One view of a pool whose every block was used: a third held, a third cached-free."""
    pool = BlockPool(num_blocks)
    blocks = pool.allocate(num_blocks)
    for block in blocks[: 2 * num_blocks // 3]:
        pool.cache(block, BlockHash(block.block_id.to_bytes(8, "little"), ()))
    pool.free(blocks[num_blocks // 3 :])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        block_states(pool)
        eviction_order(pool)
        times.append(time.perf_counter() - start)
    cost = min(times)
    return {"blocks": num_blocks, "view_ms": 1000 * cost, "min_interval_s": max(0.5, cost / 0.005)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--prefix-len", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--warmup", type=float, default=20.0)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--screenshot", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    timers = {
        "step": Timer(EngineCore, "step"),
        "capture": Timer(EngineMonitor, "capture"),
        "encode": Timer(dashboard, "encode_view"),
    }
    server, url, args.vocab_size = start_server(args)
    results = {
        "no_viewer": phase(url, args, False, timers),
        "one_viewer": phase(url, args, True, timers),
        "pool_view_cost": [pool_view_cost(n) for n in (10_000, 50_000, 200_000)],
    }
    if args.screenshot:
        take_screenshot(url, args)
    server.should_exit = True
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
