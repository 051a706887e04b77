"""FlashInfer's real call signatures, for binding every call the backend makes.

With flashinfer importable, they are `inspect.signature` of the installed classes, so API
drift fails the CPU tests on such a machine. Elsewhere they come from
tests/data/flashinfer_signatures.json, recorded from a FlashInfer release's source (its
"recorded_from" names the release and commit) by running this module on a checkout of it:

    python -m tests.flashinfer_api CHECKOUT "flashinfer vX.Y.Z (tag, commit)" \
        > tests/data/flashinfer_signatures.json

A `plan` that only forwards **kwargs to `_plan_impl` (BatchDecodeWithPagedKVCacheWrapper in
0.6.17) is bound against `_plan_impl`, which declares the keywords it accepts.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data" / "flashinfer_signatures.json"
CLASSES = {
    "BatchPrefillWithPagedKVCacheWrapper": "flashinfer/prefill.py",
    "BatchDecodeWithPagedKVCacheWrapper": "flashinfer/decode.py",
}
METHODS = ("__init__", "plan", "run")
_KINDS = {
    "posonlyargs": inspect.Parameter.POSITIONAL_ONLY,
    "args": inspect.Parameter.POSITIONAL_OR_KEYWORD,
    "kwonlyargs": inspect.Parameter.KEYWORD_ONLY,
}


@dataclass(frozen=True)
class UnevaluatedDefault:
    """A default that is not a literal (recorded as source text)."""

    source: str


@dataclass(frozen=True)
class FlashInferApi:
    source: str  # which FlashInfer the signatures describe
    signatures: dict[str, inspect.Signature]  # "Class.method" -> its signature (with self)

    def bind(self, method: str, *args: Any, **kwargs: Any) -> inspect.BoundArguments:
        """Binds a call as FlashInfer would receive it (raises TypeError on a mismatch) and
        fills in FlashInfer's defaults."""
        bound = self.signatures[method].bind(*args, **kwargs)
        bound.apply_defaults()
        return bound


def _effective(cls: type, method: str) -> inspect.Signature:
    signature = inspect.signature(getattr(cls, method))
    forwards = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    if method == "plan" and forwards and hasattr(cls, "_plan_impl"):
        return inspect.signature(cls._plan_impl)
    return signature


def installed_api() -> FlashInferApi | None:
    """The installed flashinfer's signatures, or None when it does not import."""
    try:
        flashinfer = importlib.import_module("flashinfer")
    except Exception:  # absent, or present without a usable CUDA: use the recording
        return None
    signatures = {
        f"{name}.{method}": _effective(getattr(flashinfer, name), method)
        for name in CLASSES
        for method in METHODS
    }
    return FlashInferApi(f"installed flashinfer {flashinfer.__version__}", signatures)


def _parameter(entry: dict[str, Any]) -> inspect.Parameter:
    kind = getattr(inspect.Parameter, entry["kind"])
    if "default" in entry:
        default = entry["default"]
    elif "default_source" in entry:
        default = UnevaluatedDefault(entry["default_source"])
    else:
        default = inspect.Parameter.empty
    return inspect.Parameter(entry["name"], kind, default=default)


def recorded_api() -> FlashInferApi:
    data = json.loads(DATA.read_text())
    signatures = {
        method: inspect.Signature([_parameter(p) for p in parameters])
        for method, parameters in data["methods"].items()
    }
    return FlashInferApi(f"recorded from {data['recorded_from']}", signatures)


def flashinfer_api() -> FlashInferApi:
    return installed_api() or recorded_api()


# --- Recording, from a checkout's source (no CUDA needed) -------------------------------


def _default_entry(node: ast.expr | None) -> dict[str, Any]:
    if node is None:
        return {}
    try:
        return {"default": ast.literal_eval(node)}
    except ValueError:
        return {"default_source": ast.unparse(node)}


def _parameters(function: ast.FunctionDef) -> list[dict[str, Any]]:
    a = function.args
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    entries = []
    for group in ("posonlyargs", "args"):
        for arg in getattr(a, group):
            default = defaults[positional.index(arg)]
            entries.append({"name": arg.arg, "kind": _KINDS[group].name} | _default_entry(default))
    if a.vararg:
        entries.append({"name": a.vararg.arg, "kind": "VAR_POSITIONAL"})
    for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        entries.append({"name": arg.arg, "kind": "KEYWORD_ONLY"} | _default_entry(default))
    if a.kwarg:
        entries.append({"name": a.kwarg.arg, "kind": "VAR_KEYWORD"})
    return entries


def _methods(path: Path, class_name: str) -> dict[str, list[dict[str, Any]]]:
    """The last definition of each method (after any @overload stubs)."""
    tree = ast.parse(path.read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name]
    found = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    methods = {}
    for method in METHODS:
        function = found[method]
        parameters = _parameters(function)
        if method == "plan" and parameters[-1]["kind"] == "VAR_KEYWORD" and "_plan_impl" in found:
            parameters = _parameters(found["_plan_impl"])
        methods[f"{class_name}.{method}"] = parameters
    return methods


def record(checkout: Path, recorded_from: str) -> dict[str, Any]:
    methods: dict[str, Any] = {}
    for class_name, relative in CLASSES.items():
        methods |= _methods(checkout / relative, class_name)
    return {"recorded_from": recorded_from, "methods": methods}


if __name__ == "__main__":
    checkout, recorded_from = Path(sys.argv[1]), sys.argv[2]
    print(json.dumps(record(checkout, recorded_from), indent=1))
