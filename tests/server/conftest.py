"""Live servers shared by the gateway tests: a tiny random model and the default model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import AsyncLLM, EngineArgs, EngineHooks
from tests.server.live import LiveServer
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-server"))


def tiny_engine(path: Path, hooks: EngineHooks | None = None, **kwargs: object) -> AsyncLLM:
    options: dict[str, object] = dict(
        model=str(path),
        dtype="float32",
        num_kv_blocks=256,
        max_model_len=256,
        engine_in_process=True,
    )
    options.update(kwargs)
    return AsyncLLM.from_engine_args(EngineArgs(**options), hooks)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    with LiveServer(tiny_engine(tiny_model_dir), served_model_name="tiny") as server:
        yield server


@pytest.fixture(scope="module")
def default_server(default_model_dir: Path) -> Iterator[LiveServer]:
    engine = AsyncLLM.from_engine_args(
        EngineArgs(
            model=str(default_model_dir),
            dtype="float32",
            max_model_len=1024,
            num_kv_blocks=256,  # not the default 4 GiB, faulted in at each module's start
            engine_in_process=True,
        )
    )
    with LiveServer(engine) as server:
        yield server
