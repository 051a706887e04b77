"""Serving when the CPU is shared or throttled: one stream and 16 at once, quiet and beside
busy neighbours, as a pod on a busy node or under a CPU limit sees it.

    python benchmarks/shared_cpu.py [--model DIR] [--out benchmarks/results/shared-cpu]

Each case starts `pagedserve serve` afresh (the default model at its defaults: Q4_1 on CPU)
and measures, with serve_bench, 12 single-stream requests (200 tokens in, 64 out) and 32
requests 16 at once (200 in, 64 out):

- quiet;
- 1 and 2 busy neighbours (a Python busy loop each) in the server's session;
- the server in a session of its own (as a container's process is) and 1 neighbour in
  another: with the kernel's autogroup scheduling the two sessions share the CPU, not the
  threads, much as a CFS quota does;
- a 1.5-CPU CFS quota on the server (cgroup v2 `cpu.max` or v1 `cpu.cfs_quota_us`, where
  this process may create a cgroup), else the server pinned to one core with taskset.

Prints ITL p50/p99 and output tok/s per case, and each against quiet; writes the figures
as JSON to --out. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import serve_bench
from compare_servers import END_TOKENS, server

WORKLOADS = {
    "1 stream": "--num-requests 12 --concurrency 1 --input-len 200 --output-len 64",
    "16 at once": "--num-requests 32 --concurrency 16 --input-len 200 --output-len 64",
}
BUSY = [sys.executable, "-c", "while True: pass"]
QUOTA_CPUS = 1.5


@contextmanager
def neighbours(count: int, own_session: bool = False) -> Iterator[None]:
    """`count` busy loops, in this process's session or each in one of its own."""
    procs = [subprocess.Popen(BUSY, start_new_session=own_session) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def quota_cgroup() -> tuple[Path, str] | None:
    """A cgroup limited to QUOTA_CPUS that this process may move the server into, and how
    (v2 or v1); None where it cannot create one."""
    period = 100_000
    quota = int(QUOTA_CPUS * period)
    for root, version in ((Path("/sys/fs/cgroup"), "v2"), (Path("/sys/fs/cgroup/cpu"), "v1")):
        group = root / f"pagedserve-bench-{os.getpid()}"
        try:
            if version == "v2" and not (root / "cgroup.controllers").exists():
                continue
            group.mkdir()
            if version == "v2":
                (group / "cpu.max").write_text(f"{quota} {period}")
            else:
                (group / "cpu.cfs_period_us").write_text(str(period))
                (group / "cpu.cfs_quota_us").write_text(str(quota))
            return group, version
        except OSError:
            if group.exists():
                group.rmdir()
    return None


def measure(args: argparse.Namespace, url: str, label: str) -> dict[str, dict]:
    out = {}
    for workload, spec in WORKLOADS.items():
        bench = serve_bench.parse_args(
            [*spec.split(), "--base-url", url, "--model", "m", "--tokenizer", args.model,
             "--forbid-tokens", *END_TOKENS, "--label", label]
        )  # fmt: skip
        summary = serve_bench.run(bench)["summary"]
        out[workload] = {k: summary[k] for k in ("output_tokens_per_s", "itl_p50_s", "itl_p99_s")}
        print(f"{label:34s} {workload:10s} {json.dumps(out[workload])}", flush=True)
    return out


def run_case(
    args: argparse.Namespace,
    label: str,
    own_session: bool = False,
    prefix: list[str] | None = None,
    setup: Callable[[ExitStack, subprocess.Popen[bytes]], None] | None = None,
) -> dict[str, dict]:
    url = f"http://127.0.0.1:{args.port}"
    cmd = [*(prefix or []), sys.executable, "-m", "server.cli", "serve", args.model]
    cmd += ["--served-model-name", "m", "--host", "127.0.0.1", "--port", str(args.port)]
    cmd += ["--no-log-requests", *args.server_args.split()]
    log = args.out.with_suffix(f".{label.replace(' ', '_')}.log")
    with ExitStack() as stack:
        env = dict(item.split("=", 1) for item in args.env)
        proc = stack.enter_context(server(cmd, env, url, log, timeout=300, new_session=own_session))
        if setup is not None:
            setup(stack, proc)
        return measure(args, url, label)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--port", type=int, default=8124)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/shared-cpu"))
    parser.add_argument("--server-args", default="", help="more `pagedserve serve` flags")
    parser.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="the server's environment"
    )
    parser.add_argument(
        "--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}"
    )
    args = parser.parse_args()
    if args.model is None:
        from engine import prepare_default_model

        args.model = str(prepare_default_model())
    args.out.parent.mkdir(parents=True, exist_ok=True)

    cases = args.cases.split(",")
    unknown = set(cases) - set(CASES)
    if unknown or "quiet" not in cases:
        parser.error(f"--cases: one of {', '.join(CASES)} each, quiet among them")
    results = {}
    for case in cases:
        results.update(CASES[case](args))
    print(f"\n{'case':36s} {'workload':11s} tok/s (x quiet), ITL p50 (x), ITL p99 (x)")
    for case, by_workload in results.items():
        for workload, figures in by_workload.items():
            print(f"{case:36s} {workload:11s} {_row(figures, results['quiet'][workload])}")
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2))


def _row(figures: dict[str, float], quiet: dict[str, float]) -> str:
    tok, p50, p99 = (figures[k] for k in ("output_tokens_per_s", "itl_p50_s", "itl_p99_s"))
    q_tok, q_p50, q_p99 = (quiet[k] for k in ("output_tokens_per_s", "itl_p50_s", "itl_p99_s"))
    return (
        f"{tok:6.1f} ({tok / q_tok:.2f}), {p50 * 1e3:6.1f} ms ({p50 / q_p50:.1f}), "
        f"{p99 * 1e3:6.1f} ms ({p99 / q_p99:.1f})"
    )


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (the engine core and its threads' process)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    found = [int(c) for c in children.read_text().split()] if children.exists() else []
    return found + [d for c in found for d in _descendants(c)]


def _busy(count: int, own_session: bool = False) -> Callable[..., None]:
    return lambda stack, proc: stack.enter_context(neighbours(count, own_session))


def _quota_case(args: argparse.Namespace) -> dict[str, dict[str, dict]]:
    group = quota_cgroup()
    if group is None:
        label = "taskset onto 1 core"
        return {label: run_case(args, "taskset", prefix=["taskset", "-c", "0"])}
    path, version = group

    def join(stack: ExitStack, proc: subprocess.Popen[bytes]) -> None:
        for pid in [proc.pid, *_descendants(proc.pid)]:
            (path / "cgroup.procs").write_text(str(pid))

    try:
        return {f"{QUOTA_CPUS} CPU quota (cgroup {version})": run_case(args, "quota", setup=join)}
    finally:
        path.rmdir()  # empty again: the server has exited


CASES: dict[str, Callable[[argparse.Namespace], dict[str, dict[str, dict]]]] = {
    "quiet": lambda a: {"quiet": run_case(a, "quiet")},
    "neighbour": lambda a: {
        "1 neighbour, same session": run_case(a, "1 neighbour", setup=_busy(1))
    },
    "neighbours": lambda a: {
        "2 neighbours, same session": run_case(a, "2 neighbours", setup=_busy(2))
    },
    "own-session": lambda a: {
        "server's own session, 1 neighbour": run_case(
            a, "own session + 1 neighbour", own_session=True, setup=_busy(1)
        )
    },
    "quota": _quota_case,
}


if __name__ == "__main__":
    main()
