"""Does tokenizing a long prompt stall the other streams? (Not a test: nothing is asserted.)

    python benchmarks/tokenize_stall.py --base-url http://127.0.0.1:8000

Runs --streams streaming completions and, once they flow, --long-clients clients that for
--duration seconds send texts of about --long-tokens tokens back to back: /tokenize calls
(tokenization and nothing else) and chat completions rejected after tokenization for
exceeding the context (no prefill). Reports the running streams' inter-token latency (p50,
p99, max) in that window, beside the same streams' latency before it, and the latency of a
GET /health probe every 5 ms: the time the event loop was unavailable.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time

import httpx


def long_text(tokens: int) -> str:
    # About 2 tokens per word with SmolLM2's tokenizer; the server's count is printed.
    return " ".join(f"item{i} costs {i * 7} coins" for i in range(tokens // 8))


async def stream(client: httpx.AsyncClient, args: argparse.Namespace, times: list[float]) -> None:
    body = {
        "model": args.model,
        "prompt": "Write a very long story about a lighthouse keeper.",
        "max_tokens": args.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                times.append(time.perf_counter())


async def long_requests(client: httpx.AsyncClient, args: argparse.Namespace) -> tuple[int, int]:
    """--long-clients clients, each sending long texts back to back for --duration s."""
    text = long_text(args.long_tokens)
    count = (await client.post("/tokenize", json={"prompt": text})).json()["count"]
    deadline = time.perf_counter() + args.duration
    sent = 0

    async def client_loop(i: int) -> None:
        nonlocal sent
        while time.perf_counter() < deadline:
            if i % 2:
                body = {"model": args.model, "messages": [{"role": "user", "content": text}]}
                response = await client.post("/v1/chat/completions", json=body | {"max_tokens": 8})
                assert response.status_code == 400, response.text  # context length exceeded
            else:
                await client.post("/tokenize", json={"prompt": text})
            sent += 1

    await asyncio.gather(*(client_loop(i) for i in range(args.long_clients)))
    return count, sent


async def probe_loop(client: httpx.AsyncClient, stop: asyncio.Event) -> list[tuple[float, float]]:
    """(time, latency) of GET /health every 5 ms: how long the event loop is unavailable."""
    samples = []
    while not stop.is_set():
        sent = time.perf_counter()
        await client.get("/health")
        samples.append((sent, time.perf_counter() - sent))
        await asyncio.sleep(0.005)
    return samples


def gaps(times: list[float], start: float, end: float) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times) if start <= b <= end]


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {
        "n": len(values),
        "p50_ms": 1e3 * statistics.median(ordered),
        "p99_ms": 1e3 * p99,
        "max_ms": 1e3 * ordered[-1],
    }


async def main(args: argparse.Namespace) -> None:
    limits = httpx.Limits(max_connections=args.streams + args.long_clients + 1)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=600, limits=limits) as client:
        times: list[list[float]] = [[] for _ in range(args.streams)]
        tasks = [asyncio.create_task(stream(client, args, t)) for t in times]
        while min(len(t) for t in times) < 10:
            await asyncio.sleep(0.05)
        stop = asyncio.Event()
        probe = asyncio.create_task(probe_loop(client, stop))
        warm = time.perf_counter()
        await asyncio.sleep(args.baseline_s)
        start = time.perf_counter()
        count, sent = await long_requests(client, args)
        end = time.perf_counter()
        stop.set()
        probes = await probe
        await asyncio.gather(*tasks)
    before = [g for t in times for g in gaps(t, warm, start)]
    during = [g for t in times for g in gaps(t, start, end)]
    report = {
        "long_prompt_tokens": count,
        "long_requests": sent,
        "window_s": end - start,
        "itl_before": summary(before),
        "itl_during_tokenization": summary(during),
        "health_latency_before": summary([d for t, d in probes if warm <= t < start]),
        "health_latency_during": summary([d for t, d in probes if start <= t <= end]),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=400)
    parser.add_argument("--long-tokens", type=int, default=6000)
    parser.add_argument("--long-clients", type=int, default=1)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--baseline-s", type=float, default=2.0)
    asyncio.run(main(parser.parse_args()))
