"""The configuration page's flag table, generated from the same Options that build
`pagedserve serve`'s parser, so the docs cannot drift from the code.

    python -m server.flag_reference --write    # rewrites the table in docs/configuration.md

tests/test_docs.py fails when the page's table is not what this generates.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from server.cli import Option, engine_options, env_name, parse_bool, server_options

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
BEGIN = "<!-- flags:begin (generated: python -m server.flag_reference --write) -->"
END = "<!-- flags:end -->"


def _default(option: Option) -> str:
    if option.default is None:
        return "none"
    if isinstance(option.default, bool):
        return "on" if option.default else "off"
    if option.is_list:
        return ", ".join(map(str, option.default)) or "none"
    return _cell(f"`{option.default}`")


def _flag(option: Option) -> str:
    if option.extra.get("positional"):
        return f"`{option.name.upper()}` (positional)"
    if option.parser() is parse_bool:
        return f"`{option.flag}`, `--no-{option.flag[2:]}`"
    return f"`{option.flag}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def table() -> str:
    """One row per `serve` flag: the flag, its environment variable, default and meaning."""
    rows = ["| flag | environment | default | what it does |", "| --- | --- | --- | --- |"]
    for option in sorted(engine_options() + server_options(), key=lambda o: o.name):
        choices = option.choices()
        what = _cell(option.help)
        if choices:
            what += " (" + ", ".join(f"`{c}`" for c in choices) + ")"
        env = f"`{env_name(option.name)}`"
        rows.append(f"| {_flag(option)} | {env} | {_default(option)} | {what} |")
    return "\n".join(rows)


def rendered(page: str) -> str:
    """`page` with the text between the markers replaced by the current table."""
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite docs/configuration.md")
    args = parser.parse_args()
    if args.write:
        PAGE.write_text(rendered(PAGE.read_text()))
    else:
        print(table())


if __name__ == "__main__":
    main()
