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


def refused_here(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int | str | None, str]:
    """`pagedserve info ARGS` in this process, for the command line's refusals (each comes
    before anything is loaded or set): its exit code and stderr. A process of its own costs
    about 5 s of imports; the real entry point's run is `info` above."""
    from server.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["info", *args])
    return exited.value.code, capsys.readouterr().err


def info_here(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, str]:
    """`pagedserve info ARGS` in this process (it loads nothing; the instruction set it
    forces goes back to auto after the test, conftest.py): the facts it prints."""
    from server.cli import main

    assert main(["info", *args]) == 0
    return facts(capsys.readouterr().out)


def facts(output: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in output.splitlines())


def test_info_prints_what_runs_on_this_cpu(default_model_dir: Path) -> None:
    result = info(*SETTINGS)  # the default model, whose GGUF file runs as stored
    assert result.returncode == 0, result.stderr
    from engine.ops.hugepages import huge_pages
    from engine.ops.loader import native_kernels

    kernels = native_kernels()
    assert facts(result.stdout) == {
        "device": "cpu",
        "dtype": "float32",
        "attention": "cpu-native (auto: the native CPU kernels load)",
        "native kernels": f"{kernels.best} (auto: best this CPU runs)",
        "kernels built": " ".join(kernels.built),
        "kernels this CPU runs": " ".join(kernels.supported),
        "torch threads": "1",
        "huge pages": (
            f"weights and KV cache (transparent huge pages: {huge_pages()})"
            if huge_pages() in ("madvise", "always")
            else f"none (transparent huge pages: {huge_pages()}; 4 KiB pages)"
        ),
        "quantization": "GGUF as stored, dense copy for steps of over 8 tokens",
    }
    assert "CUDA" not in result.stdout


def test_info_names_the_quantization_it_was_asked_for(
    default_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dense = info_here(capsys, str(default_model_dir), *SETTINGS, "--quantization", "none")
    assert dense["quantization"] == "none"


def test_the_startup_log_line_says_the_same(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Also with a forced instruction set, which `serve` applies as `info` does."""
    settings = [*SETTINGS, "--cpu-isa", "portable"]
    expected = info_here(capsys, str(tiny_model_dir), *settings)
    assert expected["quantization"] == "none"
    assert expected["native kernels"] == "portable (forced by --cpu-isa)"
    log = tmp_path / "server.log"
    args = [str(tiny_model_dir), *settings, "--num-kv-blocks", "64", "--max-model-len", "256"]
    with ServerProcess(args, log=log):
        pass
    [line] = [ln for ln in log.read_text().splitlines() if "engine: " in ln]
    print(line)
    described = line.split("engine: ", 1)[1]
    assert all(f"{name} {value}" in described for name, value in expected.items())
    assert "CUDA" not in described


def test_info_reads_the_environment_and_refuses_what_cannot_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from_env = info(env={"PAGEDSERVE_ATTENTION_BACKEND": "torch", "PAGEDSERVE_DTYPE": "float32"})
    assert facts(from_env.stdout)["attention"] == "torch (requested)"
    code, stderr = refused_here(capsys, "--attention-backend", "flashinfer")
    assert code == 2
    assert "'flashinfer' is unavailable: CUDA is not available" in stderr


@pytest.mark.parametrize("flag", ["--port", "--max-model-len"])
def test_info_takes_only_the_settings_it_reports(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, stderr = refused_here(capsys, flag, "8000")
    assert code == 2 and "unrecognized arguments" in stderr


def test_the_flag_and_the_environment_force_an_instruction_set(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    forced = "portable (forced by --cpu-isa)"
    flag = info_here(capsys, str(tiny_model_dir), *SETTINGS, "--cpu-isa", "portable")
    assert flag["native kernels"] == forced
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", "portable")
    assert info_here(capsys, str(tiny_model_dir), *SETTINGS)["native kernels"] == forced


def test_a_set_that_cannot_run_here_exits_2_naming_the_choices(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unknown set, and every built set this CPU lacks (none on a CPU that runs them
    all), from `info` and from `serve`, which refuses it before it loads anything."""
    from engine.ops.loader import native_kernels

    kernels = native_kernels()
    choices = f"{', '.join(kernels.supported)} (built: {', '.join(kernels.built)})"
    code, stderr = refused_here(capsys, str(tiny_model_dir), "--cpu-isa", "sse9")
    assert code == 2
    assert f"--cpu-isa sse9: this build has no sse9; this CPU runs {choices}" in stderr
    for isa in (isa for isa in kernels.built if isa not in kernels.supported):
        monkeypatch.setenv("PAGEDSERVE_CPU_ISA", isa)
        code, stderr = refused_here(capsys, str(tiny_model_dir))
        assert code == 2
        assert f"--cpu-isa {isa}: this CPU lacks {isa}; it runs {choices}" in stderr
    monkeypatch.delenv("PAGEDSERVE_CPU_ISA", raising=False)
    serve = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", str(tiny_model_dir), "--cpu-isa", "sse9"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert serve.returncode == 2
    assert "pagedserve serve: error: --cpu-isa sse9: this build has no sse9" in serve.stderr
