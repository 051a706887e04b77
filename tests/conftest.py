"""Shared fixtures. Tests build tiny models themselves; the default model is converted once."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from engine.models.default_model import prepare_default_model

    return prepare_default_model()
