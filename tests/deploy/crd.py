"""Validates custom resources against a vendored CustomResourceDefinition, as the API
server would: its openAPIV3Schema (unknown fields rejected, as with a structural schema),
defaults applied, then its CEL rules (x-kubernetes-validations) evaluated with cel-python."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml


class CrdError(ValueError):
    pass


class CustomResourceDefinition:
    def __init__(self, path: Path) -> None:
        crd = yaml.safe_load(path.read_text())
        self.group = crd["spec"]["group"]
        self.kind = crd["spec"]["names"]["kind"]
        self.schemas = {
            f"{self.group}/{v['name']}": v["schema"]["openAPIV3Schema"]
            for v in crd["spec"]["versions"]
            if v["served"]
        }
        self.cel = celpy.Environment()

    def validate(self, manifest: dict[str, Any]) -> None:
        """Raises CrdError naming every problem of `manifest`."""
        if manifest.get("kind") != self.kind:
            raise CrdError(f"kind {manifest.get('kind')!r} is not {self.kind}")
        schema = self.schemas.get(manifest.get("apiVersion", ""))
        if schema is None:
            raise CrdError(f"apiVersion {manifest.get('apiVersion')!r} is not served")
        strict = _closed(copy.deepcopy(schema))
        errors = [e.message for e in jsonschema.Draft7Validator(strict).iter_errors(manifest)]
        if errors:
            raise CrdError("; ".join(errors))
        defaulted = _defaulted(schema, copy.deepcopy(manifest))
        failures = list(self._rules(schema, defaulted, "$"))
        if failures:
            raise CrdError("; ".join(failures))

    def _rules(self, schema: dict[str, Any], value: Any, where: str) -> Any:
        for rule in schema.get("x-kubernetes-validations", []):
            program = self.cel.program(self.cel.compile(rule["rule"]))
            if not program.evaluate({"self": celpy.json_to_cel(value)}):
                yield f"{where}: {rule.get('message', rule['rule'])}"
        if isinstance(value, dict):
            for key, sub in schema.get("properties", {}).items():
                if key in value:
                    yield from self._rules(sub, value[key], f"{where}.{key}")
        elif isinstance(value, list) and "items" in schema:
            for i, item in enumerate(value):
                yield from self._rules(schema["items"], item, f"{where}[{i}]")


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """Every object with declared properties rejects others (a structural schema prunes
    them; a strict client, such as kubectl's field validation, rejects them)."""
    open_ = "additionalProperties" in schema or schema.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in schema and not open_:
        schema["additionalProperties"] = False
    for sub in schema.get("properties", {}).values():
        _closed(sub)
    if isinstance(schema.get("items"), dict):
        _closed(schema["items"])
    if isinstance(schema.get("additionalProperties"), dict):
        _closed(schema["additionalProperties"])
    return schema


def _defaulted(schema: dict[str, Any], value: Any) -> Any:
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = _defaulted(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        return [_defaulted(schema["items"], item) for item in value]
    return value
