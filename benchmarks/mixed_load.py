"""Tail latency under mixed load: streams decode while requests with long prompts keep
arriving, for a sweep of chunked-prefill settings and, optionally, llama.cpp's llama-server.

    python benchmarks/mixed_load.py [--settings NAME ...] [--rounds 2] \\
        [--llama-server /path/to/llama.cpp/build/bin/llama-server] \\
        [--out benchmarks/results/mixed-load]

Each setting starts `pagedserve serve` afresh with no model (the bundled SmolLM2-135M
Q4_1 GGUF, at the defaults but for the setting's flags); --llama-server serves the same
GGUF file with 2 threads and 16 slots (../shared/PEERS.md says how to build it). The
servers alternate, round after round, so that drift on a shared machine hits them all.

The workload is a closed loop of --concurrency streams (16), each sending its next
request when the last ends: every --long-every'th request (4th) has a long prompt of
1024-2048 tokens, the others 128-256, and each asks for --output-len tokens (128), with
SmolLM2's end tokens forbidden (logit_bias), since llama-server ignores ignore_eos. So
at any time some streams decode while others' long prompts are being prefilled beside
them: a decode's inter-token latency is the time of a step that carries prefill chunks.
Prompts are random token ids sent as text, the same text to every server. With
`--long-every 0 --short-len 200 200 --num-requests 32` it is issue 40's "16 at once"
(compare_servers.py's quantized suite): no long prompts, a new 200-token prompt beside the
decodes whenever a stream ends.

Prints per run output tok/s, ITL p50/p99, TTFT p50/p99 (TTFT of the short prompts
alone too) and the CPU that other processes took meanwhile, in cores (the machine's busy
time from /proc/stat, less the server's and this client's); then each setting's figures against
llama-server's. Writes the figures to <out>.json, each request's TTFT and ITLs to
<out>.requests.json, and a throughput-against-ITL-p99 chart, <out>.png (plot_compare.py
--tradeoff), one line per round. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import plot_compare
import serve_bench
from compare_servers import END_TOKENS, server
from engine_process import cpu_seconds, descendants

# The sweep: name -> `pagedserve serve` flags. Each point spells out the budget and the
# threshold, so that its figures keep their meaning whatever the defaults become.
SETTINGS = {
    "B256": "--max-num-batched-tokens 256 --long-prefill-token-threshold 0",
    "B128": "--max-num-batched-tokens 128 --long-prefill-token-threshold 0",
    "B256-T128": "--max-num-batched-tokens 256 --long-prefill-token-threshold 128",
    "B256-T64": "--max-num-batched-tokens 256 --long-prefill-token-threshold 64",
    "B256-T32": "--max-num-batched-tokens 256 --long-prefill-token-threshold 32",
    "B256-T16": "--max-num-batched-tokens 256 --long-prefill-token-threshold 16",
    "B512-T64": "--max-num-batched-tokens 512 --long-prefill-token-threshold 64",
    "B256-T64-P2": "--max-num-batched-tokens 256 --long-prefill-token-threshold 64 "
    "--max-num-partial-prefills 2 --max-long-partial-prefills 2",
    # The cap beside decodes in time, as a multiple of a step of decodes alone (all
    # prefills of a step together), no threshold.
    "B256-R1": "--max-num-batched-tokens 256 --prefill-time-beside-decodes 1",
    "B256-R2": "--max-num-batched-tokens 256 --prefill-time-beside-decodes 2",
    "B256-R3": "--max-num-batched-tokens 256 --prefill-time-beside-decodes 3",
    "B256-R4": "--max-num-batched-tokens 256 --prefill-time-beside-decodes 4",
    # Whatever the defaults are now.
    "default": "",
}
LLAMA_SERVER = "llama-server"
LATENCIES = ("itl_p50_s", "itl_p99_s", "ttft_p50_s", "ttft_p99_s", "short_ttft_p50_s")


def make_prompts(args: argparse.Namespace, tokenizer: Any) -> list[tuple[str, bool]]:
    """(text, is_long) per request, in the order the streams take them."""
    rng = random.Random(args.seed)
    prompts = []
    for i in range(args.num_requests):
        is_long = args.long_every > 0 and i % args.long_every == args.long_every - 1
        low, high = args.long_len if is_long else args.short_len
        ids = [rng.randrange(1000, 20000) for _ in range(rng.randint(low, high))]
        prompts.append((tokenizer.decode(ids), is_long))
    return prompts


async def run_load(
    args: argparse.Namespace, url: str, prompts: list[tuple[str, bool]]
) -> tuple[list[tuple[serve_bench.RequestRecord, bool]], float]:
    """Every request through --concurrency closed-loop streams; (record, is_long) each, and
    the wall time."""
    bench = argparse.Namespace(
        base_url=url, model="m", output_len=args.output_len, forbid_tokens=END_TOKENS
    )
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        await serve_bench.one_request(client, bench, prompts[0][0][:200])  # warm-up
        queue = list(reversed(prompts))
        records: list[tuple[serve_bench.RequestRecord, bool]] = []

        async def stream() -> None:
            while queue:
                text, is_long = queue.pop()
                records.append((await serve_bench.one_request(client, bench, text), is_long))

        start = time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(args.concurrency)))
        return records, time.perf_counter() - start


def summary(records: list[tuple[serve_bench.RequestRecord, bool]], wall: float) -> dict:
    figures = serve_bench.summarise([r for r, _ in records], wall)
    short = [r.ttft for r, is_long in records if not is_long and r.ttft is not None]
    figures["short_ttft_p50_s"] = serve_bench.percentile(short, 50)
    figures["short_ttft_p99_s"] = serve_bench.percentile(short, 99)
    prompt_tokens = [r.prompt_tokens for r, _ in records if r.prompt_tokens is not None]
    figures["prompt_tokens"] = sum(prompt_tokens)
    return figures


def server_command(name: str, args: argparse.Namespace, gguf: Path) -> list[str]:
    host = ["--host", "127.0.0.1", "--port", str(args.port)]
    if name == LLAMA_SERVER:
        # -c is shared by the -np slots: each holds its longest prompt and its output.
        context = args.concurrency * (args.long_len[1] + args.output_len + 64)
        threads = str(os.cpu_count() or 1)
        cmd = [args.llama_server, "-m", str(gguf), "--alias", "m", "-t", threads]
        return [*cmd, "-c", str(context), "-np", str(args.concurrency), *host]
    cmd = [sys.executable, "-m", "server.cli", "serve", "--served-model-name", "m", *host]
    return [*cmd, "--no-log-requests", *SETTINGS[name].split()]


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def run_one(
    name: str, args: argparse.Namespace, gguf: Path, prompts: list
) -> tuple[dict, list[dict]]:
    """One server, one run of the workload: its figures, with the CPU others took meanwhile
    (the machine's busy time less the server's and this process's) in cores, and each
    request's TTFT and ITLs."""
    url = f"http://127.0.0.1:{args.port}"
    log = args.out.with_suffix(f".{name}.log")
    with server(server_command(name, args, gguf), {}, url, log, timeout=900) as proc:
        pids = [os.getpid(), proc.pid, *descendants(proc.pid)]
        load = os.getloadavg()[0]
        before = busy_cpu_s() - sum(map(cpu_seconds, pids))
        records, wall = asyncio.run(run_load(args, url, prompts))
        others = busy_cpu_s() - sum(map(cpu_seconds, pids)) - before
    figures = summary(records, wall) | {"load_1m_before": load}
    figures["others_cpu_cores"] = others / wall
    raw = [{"long": is_long, "ttft": r.ttft, "itls": r.itls} for r, is_long in records]
    return figures, raw


def row(name: str, f: dict) -> str:
    ms = {k: 1e3 * (f[k] or 0) for k in LATENCIES}
    return (
        f"{name:14s} {f['output_tokens_per_s']:7.1f} tok/s  ITL p50 {ms['itl_p50_s']:6.1f} "
        f"p99 {ms['itl_p99_s']:6.1f} ms  TTFT p50 {ms['ttft_p50_s']:7.0f} p99 "
        f"{ms['ttft_p99_s']:7.0f} ms (short p50 {ms['short_ttft_p50_s']:6.0f})  others' CPU "
        f"{f['others_cpu_cores']:.2f} cores, errors {f['errors']}"
    )


def print_ratios(results: dict[str, dict[str, dict]]) -> None:
    """Each setting's tok/s and ITL p99 against llama-server's in the same round."""
    if LLAMA_SERVER not in results:
        return
    print(f"\nagainst {LLAMA_SERVER}, round by round: output tok/s (x), ITL p99 (x)")
    for name, rounds in results.items():
        if name == LLAMA_SERVER:
            continue
        cells = []
        for key, f in rounds.items():
            peer = results[LLAMA_SERVER].get(key)
            if peer is None:
                continue
            tok = f["output_tokens_per_s"] / peer["output_tokens_per_s"]
            p99 = f["itl_p99_s"] / peer["itl_p99_s"]
            cells.append(f"{key}: {tok:.2f}x, {p99:.2f}x")
        print(f"{name:14s} " + "; ".join(cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--long-every", type=int, default=4)
    p.add_argument("--long-len", type=int, nargs=2, default=(1024, 2048))
    p.add_argument("--short-len", type=int, nargs=2, default=(128, 256))
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--port", type=int, default=8125)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/mixed-load"))
    args = p.parse_args()

    from transformers import AutoTokenizer

    from engine import prepare_default_model

    model_dir = prepare_default_model()
    gguf = next(Path(model_dir).glob("*.gguf"))
    prompts = make_prompts(args, AutoTokenizer.from_pretrained(model_dir))
    names = args.settings + ([LLAMA_SERVER] if args.llama_server else [])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, dict]] = {name: {} for name in names}
    requests: dict[str, dict[str, list[dict]]] = {name: {} for name in names}
    for round_no in range(1, args.rounds + 1):
        for name in names:
            figures, raw = run_one(name, args, gguf, prompts)
            results[name][f"round {round_no}"] = figures
            requests[name][f"round {round_no}"] = raw
            print(f"round {round_no}  {row(name, figures)}", flush=True)
            args.out.with_suffix(".json").write_text(json.dumps(results, indent=2))
            args.out.with_suffix(".requests.json").write_text(json.dumps(requests))
    print_ratios(results)
    if args.long_every:
        title = f"{args.concurrency} streams, every {args.long_every}th prompt long"
    else:
        title = f"{args.concurrency} streams, {args.short_len[0]}-{args.short_len[1]}-token prompts"
    # The chart's lines join the runs in this order: from the lowest ITL p99 up.
    by_p99 = sorted(results.items(), key=lambda item: item[1]["round 1"]["itl_p99_s"])
    plot_compare.plot_tradeoff(dict(by_p99), args.out.with_suffix(".png"), title)


if __name__ == "__main__":
    main()
