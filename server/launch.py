"""The `pagedserve` command's entry point: for `serve`, the engine core's interpreter starts
first, before this process imports the server and reads its flags.

A core process spends its first seconds importing torch, the model code and transformers
(about 3.7 s on a 2-core VM), and the frontend as long importing FastAPI, the engine's
client side and transformers' tokenizers (about 2.4 s) before it parses the flags and
starts the core. Started here, the core's imports run beside the frontend's; the core then
waits for its settings (core_client.prestart_core). It is only worth starting where the
flags will ask for one core of one frontend: a command line or environment naming
--engine-in-process or --api-server-count does not start it here (and if one gets through,
`serve` ends it when it reads the flags, or start_core does).
"""

from __future__ import annotations

import os
import sys

# Flags (and their prefixes: argparse takes an unambiguous one) after which the core, if
# any, is not a lone frontend's.
NOT_ONE_CORE_OF_ONE_FRONTEND = ("--engine-in", "--api-server", "-h", "--help")


def prestart_worthwhile(argv: list[str], environ: dict[str, str] | os._Environ[str]) -> bool:
    """Whether `pagedserve ARGV` will start one core process for one frontend, as far as
    the words and environment tell without parsing them."""
    if argv[:1] != ["serve"]:
        return False
    if any(arg.startswith(NOT_ONE_CORE_OF_ONE_FRONTEND) for arg in argv[1:]):
        return False
    in_process = environ.get("PAGEDSERVE_ENGINE_IN_PROCESS", "").strip().lower()
    frontends = environ.get("PAGEDSERVE_API_SERVER_COUNT", "1").strip()
    return in_process in ("", "0", "false", "no", "off") and frontends == "1"


def main() -> int:
    argv = sys.argv[1:]
    if prestart_worthwhile(argv, os.environ):
        from engine import prestart_core

        prestart_core()
    from server.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
