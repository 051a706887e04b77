"""Serving benchmark for any OpenAI-compatible server (pagedserve, vLLM, ...).

    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000 --workload random \
        --num-requests 64 --concurrency 16 --input-len 256 --output-len 128 --out results/x

Workloads (token-id prompts, so every server sees exactly the same tokens; with
--tokenizer DIR the same prompts as text, for servers that take no token ids, such as
llama.cpp's):
  random         independent random prompts of --input-len tokens
  shared-prefix  a --prefix-len token prefix shared by all, plus --input-len unique tokens
Load: a fixed --concurrency (closed loop), or --request-rate requests/s (Poisson arrivals).
Streams /v1/completions with ignore_eos (and --forbid-tokens, as logit_bias -100, for servers
that ignore ignore_eos), measures TTFT and inter-token latency from chunk arrival times, and
reports output tokens/s, TTFT, ITL and end-to-end latency at p50 and p99. Every chunk with a
choice counts, its text empty or not, as vLLM's own benchmark (vllm bench serve) counts them: a
token that ends inside a multi-byte character streams as an empty text until the next one
completes it, and skipping it made one inter-token gap of two steps (greedy continuations of
random prompts can repeat such bytes for a whole request). Output tokens come from the
stream's usage when the server sends it, else one per chunk. Writes <out>.json and <out>.png.
Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx


@dataclass
class RequestRecord:
    # The server's count from the stream's usage; else the token ids sent; None for a text
    # prompt to a server that reports no usage (its characters are not tokens).
    prompt_tokens: int | None
    output_tokens: int = 0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str | None = None
    # The server closed the connection before any response (one_request sends it again).
    dropped: bool = False
    # Sent again on a new connection: the server had closed the kept-alive one (below).
    retried: bool = False


Prompt = list[int] | str


def make_prompts(args: argparse.Namespace) -> list[Prompt]:
    rng = random.Random(args.seed)
    low, high = args.token_range

    def tokens(n: int) -> list[int]:
        return [rng.randrange(low, high) for _ in range(n)]

    prefix = tokens(args.prefix_len) if args.workload == "shared-prefix" else []
    prompts = [prefix + tokens(args.input_len) for _ in range(args.num_requests)]
    if args.tokenizer is None:
        return list(prompts)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    return [tokenizer.decode(p) for p in prompts]


async def one_request(
    client: httpx.AsyncClient, args: argparse.Namespace, prompt: Prompt
) -> RequestRecord:
    """One streamed request; sent once more if the server dropped the connection before any
    response. A server may close a kept-alive connection when it likes (llama-server after
    some requests on it), and a request sent on it as it closes fails that way: in two
    quantized-suite runs, 2 and 3 of llama-server's 6 single-stream requests, whose figures
    then came from the rest. A browser or an SDK sends such a request again; so does this,
    timed from the second send, and counted in the summary's `retried`."""
    record = await _stream_once(client, args, prompt)
    if record.dropped:
        record = await _stream_once(client, args, prompt)
        record.retried = True
    return record


async def _stream_once(
    client: httpx.AsyncClient, args: argparse.Namespace, prompt: Prompt
) -> RequestRecord:
    record = RequestRecord(prompt_tokens=None if isinstance(prompt, str) else len(prompt))
    body: dict[str, Any] = {
        "model": args.model,
        "prompt": prompt,
        "max_tokens": args.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.forbid_tokens:
        body["logit_bias"] = {str(t): -100 for t in args.forbid_tokens}
    chunks = 0
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", f"{args.base_url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                record.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return record
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                    record.prompt_tokens = chunk["usage"].get("prompt_tokens", record.prompt_tokens)
                if not chunk.get("choices"):
                    continue
                chunks += 1
                if record.ttft is None:
                    record.ttft = now - start
                else:
                    record.itls.append(now - last)
                last = now
    except httpx.RemoteProtocolError as exc:
        record.error = repr(exc)
        record.dropped = record.ttft is None
    except httpx.HTTPError as exc:
        record.error = repr(exc)
    record.output_tokens = record.output_tokens or chunks
    record.latency = time.perf_counter() - start
    return record


async def run_load(
    args: argparse.Namespace, prompts: list[Prompt]
) -> tuple[list[RequestRecord], float]:
    limits = httpx.Limits(max_connections=max(args.concurrency, 64))
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        # Warm-up outside the measurement.
        await one_request(client, args, prompts[0][: max(1, len(prompts[0]) // 4)])
        start = time.perf_counter()
        if args.request_rate:
            rng = random.Random(args.seed + 1)
            tasks = []
            for prompt in prompts:
                tasks.append(asyncio.create_task(one_request(client, args, prompt)))
                await asyncio.sleep(rng.expovariate(args.request_rate))
            records = await asyncio.gather(*tasks)
        else:
            queue = list(reversed(prompts))
            records = []

            async def worker() -> None:
                while queue:
                    records.append(await one_request(client, args, queue.pop()))

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        return list(records), time.perf_counter() - start


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarise(records: list[RequestRecord], wall: float) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for r in ok for x in r.itls]
    latencies = [r.latency for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "retried": sum(r.retried for r in records),
        "first_error": next((r.error for r in records if r.error), None),
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall if wall else 0.0,
        "requests_per_s": len(ok) / wall if wall else 0.0,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "itl_p50_s": percentile(itls, 50),
        "itl_p99_s": percentile(itls, 99),
        "e2e_p50_s": percentile(latencies, 50),
        "e2e_p99_s": percentile(latencies, 99),
    }


def plot(records: list[RequestRecord], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ttfts = sorted(r.ttft for r in records if r.ttft is not None)
    itls = sorted(x for r in records for x in r.itls)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, values, name in ((axes[0], ttfts, "TTFT (s)"), (axes[1], itls, "ITL (s)")):
        if values:
            ax.plot(values, [i / len(values) for i in range(1, len(values) + 1)])
        ax.set_xlabel(name)
        ax.set_ylabel("CDF")
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--workload", choices=["random", "shared-prefix"], default="random")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals/s")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--token-range", type=int, nargs=2, default=(1000, 20000))
    p.add_argument("--tokenizer", default=None, help="send prompts as text, decoded with this")
    p.add_argument("--forbid-tokens", type=int, nargs="*", default=[], help="logit_bias -100")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--label", default="server")
    p.add_argument("--out", type=Path, default=None, help="writes <out>.json and <out>.png")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.model is None:
        args.model = httpx.get(f"{args.base_url}/v1/models").json()["data"][0]["id"]
    prompts = make_prompts(args)
    records, wall = asyncio.run(run_load(args, prompts))
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result = {"label": args.label, "config": config, "summary": summarise(records, wall)}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        full = result | {"requests": [asdict(r) for r in records]}
        args.out.with_suffix(".json").write_text(json.dumps(full, indent=2))
        plot(records, args.out.with_suffix(".png"), f"{args.label}: {args.workload}")
    return result


if __name__ == "__main__":
    print(json.dumps(run(parse_args()), indent=2))
