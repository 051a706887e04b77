"""`pagedserve info`: what `serve` would run here, the same facts as the startup log line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.live import ServerProcess

SETTINGS = ["--dtype", "float32", "--num-threads", "1"]


def info(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "server.cli", "info", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def facts(output: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in output.splitlines())


def test_info_prints_what_runs_on_this_cpu(default_model_dir: Path) -> None:
    result = info(*SETTINGS)  # the default model, whose GGUF file runs as stored
    assert result.returncode == 0, result.stderr
    from engine.ops.loader import native_kernels

    assert facts(result.stdout) == {
        "device": "cpu",
        "dtype": "float32",
        "attention": "cpu-native (auto: the native CPU kernels load)",
        "native kernels": str(native_kernels().isa),
        "torch threads": "1",
        "quantization": "GGUF as stored, dense copy for steps of over 4 tokens",
    }
    assert "CUDA" not in result.stdout
    dense = info(str(default_model_dir), *SETTINGS, "--quantization", "none")
    assert facts(dense.stdout)["quantization"] == "none"


def test_the_startup_log_line_says_the_same(tiny_model_dir: Path, tmp_path: Path) -> None:
    expected = facts(info(str(tiny_model_dir), *SETTINGS).stdout)
    assert expected["quantization"] == "none"
    log = tmp_path / "server.log"
    args = [str(tiny_model_dir), *SETTINGS, "--num-kv-blocks", "64", "--max-model-len", "256"]
    with ServerProcess(args, log=log):
        pass
    [line] = [ln for ln in log.read_text().splitlines() if "engine: " in ln]
    print(line)
    described = line.split("engine: ", 1)[1]
    assert all(f"{name} {value}" in described for name, value in expected.items())
    assert "CUDA" not in described


def test_info_reads_the_environment_and_refuses_what_cannot_run() -> None:
    from_env = info(env={"PAGEDSERVE_ATTENTION_BACKEND": "torch", "PAGEDSERVE_DTYPE": "float32"})
    assert facts(from_env.stdout)["attention"] == "torch (requested)"
    flashinfer = info("--attention-backend", "flashinfer")
    assert flashinfer.returncode == 2
    assert "'flashinfer' is unavailable: CUDA is not available" in flashinfer.stderr


@pytest.mark.parametrize("flag", ["--port", "--max-model-len"])
def test_info_takes_only_the_settings_it_reports(flag: str) -> None:
    result = info(flag, "8000")
    assert result.returncode == 2 and "unrecognized arguments" in result.stderr
