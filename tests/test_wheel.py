"""The package as a user installs it: `pip wheel` builds the native kernels into the wheel,
and the installed wheel serves with them on a machine without a C++ compiler.

Two fresh venvs borrow this venv's third-party packages (torch, transformers, ...) through
a .pth line instead of downloading them again: the build venv A builds the wheel from a
copy of the checkout's files, the run venv B installs it and runs it with a PATH that
holds no compiler. Neither sees this checkout or its editable install.

The wheel is built with PAGEDSERVE_CPU_ISAS=portable: the portable kernels alone, the
shortest build (the entry points and one set; each extra set is as long again as the
portable one), the same on every CPU, so the suite's length does not grow with the CPU's
sets. What the wheel adds to the checkout's build is the packaging: the module inside it,
loading without a compiler, and the message without it. The build of every set, and the
choice of the best one this CPU runs, are the ones `make install` makes for the other
tests (tests/engine/ops/test_loader.py checks its sets); the setting's parsing is tested
below.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.server.live import free_port, wait_ready
from tests.tiny_models import make_tiny_model

if TYPE_CHECKING:
    from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
COMPILERS = ("c++", "g++", "gcc", "cc", "clang", "clang++")
PROMPTS = [[5, 17, 30, 4], [9, 9, 41, 77, 3, 12, 60, 61, 62, 8, 200], [100]]


def checkout_copy(dest: Path) -> Path:
    """The files a clone of this checkout has (tracked or new, not ignored): no build
    outputs, no module built in place."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    for name in listed:
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def environ_without_checkout() -> dict[str, str]:
    """This process's environment less PYTHONPATH, which may name this checkout (a run as
    `PYTHONPATH=. python -m pytest`): the venvs must not see it."""
    return {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}


def borrowing_venv(path: Path) -> Path:
    """A new venv (no pip of its own) that sees this venv's site-packages after its own."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    own = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(own, "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def build_wheel(tmp_path: Path) -> Path:
    python = borrowing_venv(tmp_path / "build-venv")
    source, dist = checkout_copy(tmp_path / "src"), tmp_path / "dist"
    subprocess.run(
        [str(python), "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index",
         "-w", str(dist), str(source)],
        env={**environ_without_checkout(), "PAGEDSERVE_CPU_ISAS": "portable"},
        check=True, capture_output=True,
    )  # fmt: skip
    [wheel] = dist.glob("pagedserve-*.whl")
    return wheel


def compiler_free_env(venv: Path) -> dict[str, str]:
    path = str(venv / "bin")
    for compiler in COMPILERS:
        assert shutil.which(compiler, path=path) is None, compiler
    nowhere = str(venv / "no-compiler-here")
    assert not Path(nowhere).exists()
    return {**environ_without_checkout(), "PATH": path, "CC": nowhere, "CXX": nowhere}


def pagedserve(venv: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / "pagedserve"), *args],
        env=env, cwd=venv, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def serve_greedy(venv: Path, env: dict[str, str], model: Path, log: Path) -> list[str]:
    """The installed server's greedy completions of PROMPTS (token ids in, text out)."""
    port = free_port()
    args = ["serve", str(model), "--dtype", "float32", "--num-kv-blocks", "64",
            "--max-model-len", "256", "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(venv / "bin" / "pagedserve"), *args], env=env, cwd=venv, stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc=proc)
        body = {"prompt": PROMPTS, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])
        return [c["text"] for c in choices]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def torch_backend_greedy(model: Path) -> list[str]:
    from engine import LLM, SamplingParams

    llm = LLM(str(model), dtype="float32", attention_backend="torch", num_kv_blocks=64,
              max_model_len=256)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params)]


@pytest.mark.slow
def test_the_wheel_serves_with_its_native_kernels_without_a_compiler(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    [module] = [n for n in names if n.startswith("engine/ops/_C") and n.endswith(".so")]
    print(f"{wheel.name}: {module}")

    venv = tmp_path / "run-venv"
    python = borrowing_venv(venv)
    subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
         str(wheel)],
        check=True, capture_output=True,
    )  # fmt: skip
    env = compiler_free_env(venv)
    where = subprocess.run(
        [str(python), "-c", "import engine; print(engine.__file__)"],
        env=env, cwd=venv, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert where.startswith(str(venv)), where  # the wheel's engine, not this checkout's

    info = pagedserve(venv, env, "info", "--dtype", "float32")
    assert "attention: cpu-native (auto: the native CPU kernels load)" in info.stdout, (
        info.stdout + info.stderr
    )
    # Built with the portable set alone: the best of what it holds serves, on every CPU.
    assert "kernels built: portable\n" in info.stdout, info.stdout
    assert "kernels this CPU runs: portable\n" in info.stdout
    assert "native kernels: portable (auto: best this CPU runs)" in info.stdout

    model = make_tiny_model("llama", tmp_path / "model")
    log = tmp_path / "server.log"
    served = serve_greedy(venv, env, model, log)
    assert "attention cpu-native" in log.read_text()
    assert "native kernels portable (auto: best this CPU runs)" in log.read_text()
    assert served == torch_backend_greedy(model)

    # Without its module the install falls back to torch, and says why.
    installed = Path(where.strip()).parent / "ops"
    [built] = installed.glob("_C*.so")
    built.unlink()
    fallback = pagedserve(venv, env, "info", "--dtype", "float32")
    missing = "the package was installed without its built module _C"
    expected = f"attention: torch (auto: the native CPU kernels are unavailable: {missing}"
    assert expected in fallback.stdout, fallback.stdout
    assert "native CPU kernels unavailable" in fallback.stderr
    refused = pagedserve(venv, env, "info", "--attention-backend", "cpu-native")
    assert refused.returncode == 2 and "'cpu-native' is unavailable" in refused.stderr


@functools.cache
def setup_script() -> ModuleType:
    """setup.py as a module: its helpers, without the build its `__main__` block runs."""
    spec = importlib.util.spec_from_file_location("pagedserve_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EVERY_SET = ["avx2", "avx512", "avx512_bf16"]
ZEN3 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c bmi2\nbugs\t\t: spectre_v1\n"
SKYLAKE_X = ZEN3.replace("bmi2", "bmi2 avx512f avx512dq avx512bw avx512vl")
ZEN4 = SKYLAKE_X.replace("avx512vl", "avx512vl avx512_bf16 avx512_vnni")


def test_the_build_setting_picks_the_extra_sets() -> None:
    """PAGEDSERVE_CPU_ISAS: all sets by default, this CPU's sets for `native` (whole
    /proc/cpuinfo flags, every flag a set is compiled with), or the sets named, always
    smallest first (the link order); off x86-64, the portable set alone."""
    extra_isas = setup_script().extra_isas
    for setting in (None, "", " ", "all"):
        assert extra_isas(setting, x86=True) == EVERY_SET
        assert extra_isas(setting, x86=False) == []
    assert extra_isas("native", ZEN3, x86=True) == ["avx2"]
    assert extra_isas("native", SKYLAKE_X, x86=True) == ["avx2", "avx512"]
    assert extra_isas("native", ZEN4, x86=True) == EVERY_SET
    assert extra_isas("native", ZEN3.replace(" f16c", ""), x86=True) == []
    assert extra_isas("native", SKYLAKE_X.replace(" avx512dq", ""), x86=True) == ["avx2"]
    assert extra_isas("native", ZEN3.replace("avx2", "avx2x"), x86=True) == []  # whole flags
    assert extra_isas("native", "processor\t: 0\n", x86=True) == []
    assert extra_isas("native", ZEN4, x86=False) == []
    assert extra_isas("avx512_bf16, avx2", x86=True) == ["avx2", "avx512_bf16"]
    assert extra_isas("avx512,avx2,avx512", x86=True) == ["avx2", "avx512"]
    assert extra_isas("avx2,portable", x86=True) == ["avx2"]
    assert extra_isas("portable", x86=True) == extra_isas("portable", x86=False) == []


def test_the_build_setting_refuses_what_it_cannot_build_naming_the_choices() -> None:
    extra_isas = setup_script().extra_isas
    with pytest.raises(ValueError) as refused:
        extra_isas("avx2,sse9,AVX512", x86=True)
    assert str(refused.value) == (
        "PAGEDSERVE_CPU_ISAS=avx2,sse9,AVX512: unknown instruction set sse9, AVX512; choose "
        "all (the default), native, or a comma-separated list of avx2, avx512, avx512_bf16"
    )
    for setting in ("all,avx2", "native,avx512", "native,all"):
        with pytest.raises(ValueError, match=f"^PAGEDSERVE_CPU_ISAS={setting}: all and native "):
            extra_isas(setting, ZEN4, x86=True)
    with pytest.raises(ValueError, match=r"avx2: x86-64 only; this machine \(.*\) builds the "):
        extra_isas("avx2", x86=False)


def test_setup_py_fails_on_an_unknown_set_and_defines_a_macro_per_set_built() -> None:
    """The setting reaches setup.py's build, which fails before compiling anything on an
    unknown set; the extension defines the macro of each set it builds, the one
    dispatch.cpp and kernels.h test."""
    env = {**os.environ, "PAGEDSERVE_CPU_ISAS": "avx3"}
    failed = subprocess.run(
        [sys.executable, "setup.py", "--version"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert failed.returncode == 1
    assert "PAGEDSERVE_CPU_ISAS=avx3: unknown instruction set avx3; choose all" in failed.stderr
    setup = setup_script()
    macros = dict(setup.kernels_extension(["avx2", "avx512_bf16"]).define_macros)
    built = {name for name in macros if name.startswith("PAGEDSERVE_WITH_ISA_")}
    assert built == {"PAGEDSERVE_WITH_ISA_AVX2", "PAGEDSERVE_WITH_ISA_AVX512_BF16"}
    csrc = ROOT / "engine" / "ops" / "csrc"
    for isa in setup.EXTRA_ISAS:
        for source in ("dispatch.cpp", "kernels.h"):
            assert f"#ifdef {setup.isa_macro(isa)}\n" in (csrc / source).read_text(), source


def test_every_source_is_compiled_once() -> None:
    """Each C++ file of csrc is in the build once: a kernel (compiled per set) or an entry
    point, which entry_points.cpp includes (one unit; a new *_ops.cpp file it left out
    would register no ops)."""
    setup = setup_script()
    csrc = ROOT / "engine" / "ops" / "csrc"
    [unit] = setup.ENTRY_POINTS
    included = re.findall(r'^#include "(\w+\.cpp)"$', (csrc / unit).read_text(), re.MULTILINE)
    compiled = [unit, *included, *setup.KERNELS]
    assert len(compiled) == len(set(compiled)), compiled
    assert sorted(compiled) == sorted(p.name for p in csrc.glob("*.cpp"))
