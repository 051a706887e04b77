"""The documentation: the site builds in strict mode, the flag reference is what the code
generates, the README is a front page whose links land, and every command line in the docs
uses flags that exist."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from server.cli import build_parser, engine_options, env_name, server_options
from server.flag_reference import PAGE, rendered

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))


def test_the_site_builds_strict_with_every_page_in_the_nav(tmp_path: Path) -> None:
    """Strict: a broken link or anchor, or a page left out of the nav, fails the build."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    assert (tmp_path / "index.html").exists()


def test_the_flag_reference_is_what_the_code_generates() -> None:
    page = PAGE.read_text()
    assert page == rendered(page), "run: python -m server.flag_reference --write"
    for option in engine_options() + server_options():
        assert f"`{env_name(option.name)}`" in page


def test_the_readme_is_a_front_page_whose_links_land() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    links = re.findall(r"\]\((docs/[^)#]+)(?:#([\w-]+))?\)", readme)
    assert {Path(page).name for page, _ in links} >= {p.name for p in PAGES} - {"index.md"}
    for page, anchor in links:
        assert (ROOT / page).is_file(), page
        if anchor:
            assert anchor in _anchors((ROOT / page).read_text()), (page, anchor)


def _anchors(markdown: str) -> set[str]:
    titles = re.findall(r"^#{1,6} (.+)$", _outside_code(markdown), flags=re.MULTILINE)
    return {re.sub(r"\s+", "-", re.sub(r"[^\w\- ]", "", t.strip().lower())) for t in titles}


def _outside_code(markdown: str) -> str:
    return re.sub(r"```.*?```", "", markdown, flags=re.DOTALL)


_COMMAND = re.compile(r"^(\S*/)?pagedserve (serve|info|prepare-default-model)\b")


def _command_lines() -> list[tuple[str, str]]:
    """Every `pagedserve ...` command of the README and the docs: the lines of shell blocks
    (continuations joined) and inline code spans."""
    found = []
    for path in [ROOT / "README.md", *PAGES]:
        text = path.read_text()
        for block in re.findall(r"```(?:bash|sh|shell|console)?\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip().removeprefix("$ ")
                if _COMMAND.match(line):
                    found.append((path.name, line))
        spans = re.findall(r"`([^`\n]+)`", _outside_code(text).replace("\n", " "))
        found += [(path.name, span) for span in spans if _COMMAND.match(span)]
    return found


def test_command_lines_in_the_docs_use_flags_that_exist() -> None:
    commands = _command_lines()
    assert len(commands) >= 5
    subcommands = _subcommand_flags()
    for page, line in commands:
        words = shlex.split(line)
        start = next(i for i, w in enumerate(words) if w.endswith("pagedserve"))
        flags = subcommands[words[start + 1]]
        for word in words[start + 2 :]:
            if word.startswith("--"):
                assert word.split("=")[0] in flags, f"{page}: {line!r}: {word} is no flag"


def _subcommand_flags() -> dict[str, set[str]]:
    """Each `pagedserve` subcommand's option strings, from the real parser."""
    parser = build_parser()
    (choices,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {
        name: {flag for action in sub._actions for flag in action.option_strings}
        for name, sub in choices.choices.items()
    }


def test_environment_variables_in_the_docs_exist() -> None:
    known = {env_name(o.name) for o in engine_options() + server_options()}
    other = {"PAGEDSERVE_CACHE_DIR", "PAGEDSERVE_CPU_ISA", "PAGEDSERVE_CPU_ISAS"}
    for path in [ROOT / "README.md", *PAGES]:
        for name in set(re.findall(r"\bPAGEDSERVE_[A-Z0-9_]+\b", path.read_text())):
            if name.endswith("_"):
                continue  # the prefix itself, as in PAGEDSERVE_<FLAG>
            assert name in known | other, f"{path.name}: {name}"


def test_the_results_chart_draws_from_its_figures(tmp_path: Path) -> None:
    """The README's chart is plot_compare.py on the recorded figures; it draws."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plot_compare

    figures = DOCS / "results" / "2026-11-29-vllm-avx512-j.json"
    plot_compare.plot(json.loads(figures.read_text()), tmp_path / "chart.png")
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "docs/results/2026-11-29-vllm-avx512-j.png" in (ROOT / "README.md").read_text()
    sweep = DOCS / "results" / "2026-11-25-token-budget.json"
    plot_compare.plot_tradeoff(json.loads(sweep.read_text()), tmp_path / "tradeoff.png")
    assert (tmp_path / "tradeoff.png").stat().st_size > 1000
