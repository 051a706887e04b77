"""The import rules of DESIGN.md, checked on the source: the layers stay layers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TORCH_LAYERS = ("worker", "attention", "models", "ops")


def imports(path: Path) -> list[str]:
    """Every module `path` imports, at any depth (function-level imports included)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def top(name: str) -> str:
    return name.split(".")[0]


def test_the_tree_is_not_empty() -> None:
    assert len(sources("engine")) > 30 and len(sources("server")) > 8


@pytest.mark.parametrize("path", sources("server"), ids=lambda p: p.name)
def test_server_imports_only_the_engines_public_api(path: Path) -> None:
    deep = [name for name in imports(path) if top(name) == "engine" and name != "engine"]
    assert deep == [], f"{path.name} reaches inside the engine: {deep}; export it from engine"


@pytest.mark.parametrize("path", sources("engine"), ids=lambda p: str(p.relative_to(ROOT)))
def test_engine_never_imports_server(path: Path) -> None:
    assert "server" not in {top(name) for name in imports(path)}


@pytest.mark.parametrize("path", sources("engine"), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_device_layers_import_torch(path: Path) -> None:
    layer = path.relative_to(ROOT / "engine").parts[0]
    if layer in TORCH_LAYERS:
        return
    assert "torch" not in {top(name) for name in imports(path)}, (
        f"{path.relative_to(ROOT)} imports torch; only engine/{{{','.join(TORCH_LAYERS)}}} may"
    )


@pytest.mark.parametrize("path", sources("engine/kv_cache"), ids=lambda p: p.name)
def test_the_block_pool_knows_no_transport(path: Path) -> None:
    """KV events leave through a listener: the cache itself imports neither ZMQ nor msgpack."""
    assert not {top(name) for name in imports(path)} & {"zmq", "msgspec", "msgpack"}


def test_scheduler_and_kv_cache_load_without_torch() -> None:
    """Not even indirectly: importing them (and the engine's public types) leaves torch, the
    grammar engine and the KV events transport out; the scheduler sees grammars only through
    a protocol."""
    heavy = "('torch', 'numpy', 'llguidance', 'xgrammar', 'zmq', 'msgspec')"
    code = (
        "import sys, engine, engine.scheduler, engine.kv_cache, engine.output_processor\n"
        "import engine.structured_output, engine.kv_events\n"
        f"loaded = sorted(m for m in sys.modules if m.split('.')[0] in {heavy})\n"
        "print(','.join(loaded))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""
