"""What KV cache events cost the engine's step: events off, on with no subscriber, and on
with a subscriber draining the stream.

    .venv/bin/python benchmarks/kv_events_overhead.py --rounds 2 --prompts 48

Runs the same shared-prefix workload (token-id prompts, a KV cache small enough to evict)
through LLM with the default model (or --model), once per configuration per round, in
interleaved order, timing every EngineCore.step. Prints the median and mean step time of
each configuration, their ratio to events off, and how many batches were published or
dropped. Not a test: nothing is asserted. The machine is shared, so absolute times are
noisy; compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import threading
import time
from typing import Any

import zmq

from engine import LLM, SamplingParams


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def workload(num_prompts: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 20000) for _ in range(64)] for _ in range(4)]
    return [
        prefixes[i % 4] + [rng.randrange(100, 20000) for _ in range(rng.randrange(16, 96))]
        for i in range(num_prompts)
    ]


def drain(endpoint: str, stop: threading.Event, counts: list[int]) -> None:
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    while not stop.is_set():
        if sub.poll(100):
            sub.recv_multipart()
            counts[0] += 1
    context.destroy(linger=0)


def run(model: str | None, mode: str, prompts: list[list[int]], args: Any) -> dict[str, Any]:
    port = free_port()
    events = None
    if mode != "off":
        events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    llm = LLM(model, num_kv_blocks=args.num_kv_blocks, max_model_len=512, kv_events_config=events)
    stop, received = threading.Event(), [0]
    subscriber = None
    if mode == "subscriber":
        target = (f"tcp://127.0.0.1:{port}", stop, received)
        subscriber = threading.Thread(target=drain, args=target, daemon=True)
        subscriber.start()
        time.sleep(0.5)  # let the subscription reach the publisher
    step, samples = llm.core.step, []

    def timed() -> Any:
        start = time.perf_counter()
        try:
            return step()
        finally:
            samples.append(time.perf_counter() - start)

    llm.core.step = timed  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, params)
    published = dropped = 0
    if llm.core.kv_events is not None:
        published = llm.core.kv_events.publisher.num_batches
        dropped = llm.core.kv_events.publisher.dropped
    llm.close()
    stop.set()
    if subscriber is not None:
        subscriber.join()
    return {"steps": samples, "published": published, "dropped": dropped, "received": received[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=64)
    args = parser.parse_args()
    prompts = workload(args.prompts)
    modes = ("off", "no-subscriber", "subscriber")
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            results[mode].append(run(args.model, mode, prompts, args))
    base = statistics.median(s for r in results["off"] for s in r["steps"])
    print(f"{'events':<15}{'steps':>7}{'median ms':>11}{'mean ms':>9}{'vs off':>8}  batches")
    for mode in modes:
        steps = [s for r in results[mode] for s in r["steps"]]
        median = statistics.median(steps)
        published = sum(r["published"] for r in results[mode])
        dropped = sum(r["dropped"] for r in results[mode])
        received = sum(r["received"] for r in results[mode])
        print(
            f"{mode:<15}{len(steps):>7}{median * 1e3:>11.2f}{statistics.mean(steps) * 1e3:>9.2f}"
            f"{median / base:>8.3f}  published {published}, dropped {dropped}, "
            f"received {received}"
        )


if __name__ == "__main__":
    main()
