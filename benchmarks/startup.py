"""Seconds from `pagedserve serve` to its /ready answering 200: what a pod's readiness
waits for, and the resident memory of the serving process (the frontend; the core and any
other frontends are its children) at that moment. Each round starts the server once per
checkout given (alternating, so a VM's swings fall on both alike) and stops it.

    python benchmarks/startup.py --rounds 5 -- --dtype float32
    python benchmarks/startup.py --checkouts . ../before -- MODEL_DIR --engine-in-process

Arguments after `--` go to `serve` (no model: the bundled one). Every checkout runs with this
interpreter (its venv), with PYTHONPATH set to the checkout: a checkout other than this
one needs the same native module built in place (or none, when the kernels' sources match).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from engine.worker.tensor_parallel import free_port


def resident_mib(pid: int) -> float:
    """Process `pid`'s resident memory (VmRSS), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"process {pid} has no VmRSS")


def time_to_ready(checkout: Path, serve_args: list[str], timeout: float) -> tuple[float, float]:
    """Seconds to /ready 200, and the frontend's resident MiB then."""
    port = free_port()
    # What the `pagedserve` command runs: server.launch where the checkout has it (it
    # starts the core before reading the flags), server.cli before it.
    entry = "server.launch" if (checkout / "server" / "launch.py").exists() else "server.cli"
    cmd = [sys.executable, "-m", entry, "serve", *serve_args, "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        while time.monotonic() - start < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}")
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200
            except httpx.TransportError:  # not listening yet
                ready = False
            if ready:
                return time.monotonic() - start, resident_mib(proc.pid)
            time.sleep(0.02)
        raise TimeoutError(f"not ready after {timeout:.0f}s: {' '.join(cmd)}")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--checkouts", nargs="+", type=Path, default=[Path(".")])
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("serve_args", nargs="*", help="after --: serve's arguments")
    args = parser.parse_args()
    checkouts = [c.resolve() for c in args.checkouts]
    times: dict[Path, list[float]] = {c: [] for c in checkouts}
    memory: dict[Path, list[float]] = {c: [] for c in checkouts}
    for round_ in range(args.rounds):
        for checkout in checkouts:
            seconds, mib = time_to_ready(checkout, args.serve_args, args.timeout)
            times[checkout].append(seconds)
            memory[checkout].append(mib)
            print(
                f"round {round_ + 1} {checkout}: {seconds:.2f} s, frontend {mib:.0f} MiB",
                flush=True,
            )
    for checkout, ts in times.items():
        print(
            f"{checkout}: median {statistics.median(ts):.2f} s, min {min(ts):.2f}, "
            f"max {max(ts):.2f} over {len(ts)}; frontend median "
            f"{statistics.median(memory[checkout]):.0f} MiB"
        )


if __name__ == "__main__":
    main()
