"""Speculative decoding off against on, one stream, in one run (not a test).

    python benchmarks/spec_decode.py [--model DIR] [--rounds 2] [--k 4,8] \\
        [--methods ngram,suffix,draft_model --draft-model DIR[:QUANTIZATION] ...] \\
        [--server-args "--quantization none"] [--out benchmarks/results/spec_decode]

Servers of the default model (its Q4_1 weights by default), one after the other on the same
port: `pagedserve serve` without speculation, then with `--speculative-config
'{"method": M, "num_speculative_tokens": K}'` for each method M of --methods and each K
(draft_model: once for each --draft-model, a path with an optional quantization).
Each serves, one request at a time, greedy chat completions of two workloads:

  copy    "repeat this text" and "fix the typos in this text" over paragraphs the output
          copies spans of: where drafts from the request's own tokens help
  free    open questions: where they don't

and reports output tok/s (tokens after the first over the time after the first), the time
per output token after the first, and the acceptance rate (accepted over drafted tokens,
from /metrics). Rounds alternate the servers; the figures are each round's and their best.
Prints a table and writes <out>.json. Run benchmarks/hardware_limits.py beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import compare_servers

PARAGRAPHS = [
    "The river rose slowly through the night. By morning the low fields were under water, "
    "and the farmers moved their animals to the hill behind the church. Nobody in the "
    "village could remember a flood this early in the year, and the old men argued about "
    "whether the dam upstream had been opened on purpose.",
    "To reset the router, unplug it from the wall and wait thirty seconds. Plug it back in "
    "and wait until the status light turns green. If the light stays orange for more than "
    "five minutes, hold the reset button for ten seconds with a paper clip, then set up the "
    "network again from the printed card on the bottom of the router.",
    "Our quarterly report shows that revenue grew by eight percent, mostly from the new "
    "subscription plans. Costs rose by three percent because we hired two engineers and "
    "moved the servers to a larger data center. We expect the next quarter to be slower, "
    "since the summer months are usually quiet for our customers.",
]
TYPOS = [
    ("night", "nigth"),
    ("water", "watre"),
    ("thirty", "thrity"),
    ("network", "netwrok"),
    ("revenue", "revenu"),
    ("customers", "custmers"),
]
FREE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, for a ten-year-old.",
    "What are three things to consider when choosing a first programming language?",
    "Describe a perfect Sunday morning in a small mountain town.",
    "Give some advice to someone starting their first job in an office.",
    "Why do leaves change color in autumn?",
]


def copy_prompts() -> list[str]:
    prompts = []
    for text in PARAGRAPHS:
        prompts.append(f"Repeat the following text exactly, word for word:\n\n{text}")
        typo = text
        for right, wrong in TYPOS:
            typo = typo.replace(right, wrong)
        prompts.append(f"Fix the spelling mistakes in this text and write it out again:\n\n{typo}")
    return prompts


WORKLOADS = {"copy": copy_prompts(), "free": FREE}


def one_request(url: str, prompt: str, max_tokens: int) -> dict[str, float]:
    """One streamed greedy chat completion: output tokens and timings."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = last = None
    tokens = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
    assert first is not None and last is not None and tokens > 1
    return {"tokens": tokens, "ttft_s": first - start, "after_first_s": last - first}


def spec_counts(url: str) -> tuple[float, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values = {"vllm:spec_decode_num_draft_tokens_total": 0.0}
    values["vllm:spec_decode_num_accepted_tokens_total"] = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
    return (
        values["vllm:spec_decode_num_draft_tokens_total"],
        values["vllm:spec_decode_num_accepted_tokens_total"],
    )


def serve(name: str, spec: str | None, args: argparse.Namespace) -> dict[str, Any]:
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "server.cli", "serve", *([args.model] if args.model else [])]
    cmd += ["--host", "127.0.0.1", "--port", str(args.port), "--served-model-name", "m"]
    cmd += ["--no-log-requests", *(["--speculative-config", spec] if spec else [])]
    cmd += args.server_args.split()
    log = args.out.parent / f"{args.out.name}-{name}.log"
    result: dict[str, Any] = {}
    with compare_servers.server(cmd, {}, url, log, timeout=600):
        one_request(url, "Say hello.", 8)  # warm-up
        for workload, prompts in WORKLOADS.items():
            before = spec_counts(url)
            runs = [one_request(url, p, args.max_tokens) for p in prompts]
            drafted, accepted = (a - b for a, b in zip(spec_counts(url), before, strict=True))
            tokens = sum(r["tokens"] - 1 for r in runs)
            seconds = sum(r["after_first_s"] for r in runs)
            result[workload] = {
                "output_tokens_per_s": tokens / seconds,
                "tpot_ms": 1000 * seconds / tokens,
                "ttft_ms": 1000 * sum(r["ttft_s"] for r in runs) / len(runs),
                "output_tokens": tokens + len(runs),
                "acceptance_rate": accepted / drafted if drafted else None,
                "drafted": drafted,
            }
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the bundled default model")
    p.add_argument("--k", default="4,8", help="num_speculative_tokens values to run")
    p.add_argument("--methods", default="ngram", help="comma-separated: ngram, suffix, draft_model")
    p.add_argument(
        "--draft-model",
        action="append",
        default=[],
        metavar="DIR[:QUANTIZATION]",
        help="a draft model for draft_model, with its quantization (default auto); repeatable",
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--server-args", default="", help="extra flags for every server")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/spec_decode"))
    args = p.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    servers: dict[str, str | None] = {"off": None}
    for method in args.methods.split(","):
        for k in args.k.split(","):
            config: dict[str, Any] = {"method": method, "num_speculative_tokens": int(k)}
            if method != "draft_model":
                servers[f"{method}-k{k}"] = json.dumps(config)
                continue
            if not args.draft_model:
                p.error("--methods draft_model needs --draft-model")
            for draft in args.draft_model:
                path, _, quantization = draft.partition(":")
                config.update(model=path, quantization=quantization or "auto")
                name = f"draft-{Path(path).name}-{quantization or 'auto'}-k{k}"
                servers[name] = json.dumps(config)
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "rounds": []}
    for _ in range(args.rounds):
        report["rounds"].append({name: serve(name, s, args) for name, s in servers.items()})
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    for workload in WORKLOADS:
        best_off = max(r["off"][workload]["output_tokens_per_s"] for r in report["rounds"])
        for name in servers:
            rows = [r[name][workload] for r in report["rounds"]]
            rates = [row["output_tokens_per_s"] for row in rows]
            accept = rows[0]["acceptance_rate"]
            print(
                f"{workload:5s} {name:11s} tok/s "
                + " / ".join(f"{x:6.1f}" for x in rates)
                + f"  best {max(rates) / best_off:4.2f}x off"
                + f"  TPOT {min(row['tpot_ms'] for row in rows):6.2f} ms"
                + ("" if accept is None else f"  acceptance {accept:.0%}")
            )


if __name__ == "__main__":
    main()
