"""Charts of a server comparison: output tok/s, and ITL p50/p99, per workload and server;
or, with --tradeoff, throughput against ITL p99 across runs of one server's setting.

    python benchmarks/plot_compare.py RESULTS.json OUT.png [--title TEXT] [--tradeoff]

RESULTS.json is what `compare_servers.py` writes (compare.json: server -> workload ->
summary with `output_tokens_per_s`, `itl_p50_s`, `itl_p99_s`); compare_servers.py also
calls this itself, for compare.png beside it. Not a test: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt


def plot(results: dict[str, dict[str, dict[str, Any]]], out: Path, title: str = "") -> None:
    """Writes a PNG: one row per workload, throughput on the left, ITL on the right."""
    servers = list(results)
    workloads = list(next(iter(results.values())))
    fig, axes = plt.subplots(len(workloads), 2, figsize=(10, 2.6 * len(workloads)), squeeze=False)
    for row, workload in enumerate(workloads):
        tok = [results[s].get(workload, {}).get("output_tokens_per_s") or 0 for s in servers]
        left, right = axes[row]
        left.barh(servers, tok, color="#4a7fb5")
        left.set_title(f"{workload}: output tok/s (higher is better)", fontsize=9)
        left.invert_yaxis()
        for i, value in enumerate(tok):
            left.text(value, i, f" {value:.0f}", va="center", fontsize=8)
        p50 = [1e3 * (results[s].get(workload, {}).get("itl_p50_s") or 0) for s in servers]
        p99 = [1e3 * (results[s].get(workload, {}).get("itl_p99_s") or 0) for s in servers]
        y = range(len(servers))
        right.barh([i - 0.2 for i in y], p50, height=0.4, label="ITL p50", color="#7fb54a")
        right.barh([i + 0.2 for i in y], p99, height=0.4, label="ITL p99", color="#b54a4a")
        right.set_yticks(list(y), servers)
        right.invert_yaxis()
        right.set_title(f"{workload}: ITL, ms (lower is better)", fontsize=9)
        right.legend(fontsize=7, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_tradeoff(
    results: dict[str, dict[str, dict[str, Any]]], out: Path, title: str = ""
) -> None:
    """Writes a PNG: per workload, output tok/s against ITL p99, one point per run (the
    runs are the values of the setting swept, in RESULTS.json's order)."""
    runs = list(results)
    workloads = list(next(iter(results.values())))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for workload in workloads:
        p99 = [1e3 * results[r][workload]["itl_p99_s"] for r in runs]
        tok = [results[r][workload]["output_tokens_per_s"] for r in runs]
        ax.plot(p99, tok, marker="o", label=workload)
        for run, x, y in zip(runs, p99, tok, strict=True):
            ax.annotate(run, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("ITL p99, ms (lower is better)")
    ax.set_ylabel("output tok/s (higher is better)")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--title", default="")
    parser.add_argument("--tradeoff", action="store_true", help="throughput against ITL p99")
    args = parser.parse_args()
    draw = plot_tradeoff if args.tradeoff else plot
    draw(json.loads(args.results.read_text()), args.out, args.title)


if __name__ == "__main__":
    main()
