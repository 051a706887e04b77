"""Builds the native CPU kernels (engine/ops/csrc) into the module engine/ops/_C, against
the torch installed in the build environment. Everything else is in pyproject.toml.

    pip install --no-build-isolation .      (or -e ., or pip wheel --no-build-isolation .)

The kernels link against libtorch, so they must be built with the torch they will run
with: an isolated build environment would bring its own torch. One binary serves every
CPU of its architecture: the kernels are compiled once per instruction set and chosen at
run time (engine/ops/csrc/kernels.h); never with -march=native.

PAGEDSERVE_CPU_ISAS picks the extra sets compiled beside the portable one (extra_isas):
unset or `all`, every set, so the wheel runs at its best anywhere; `native`, those this
build machine's CPU runs (a faster build, for this machine only); or a comma-separated list.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import sys
from pathlib import Path

from setuptools import setup

try:
    from torch.utils import cpp_extension
except ImportError:
    sys.exit(
        "pagedserve compiles its CPU kernels against the installed torch: install torch "
        "first, then `pip install --no-build-isolation .` (see the README)"
    )

ROOT = Path(__file__).parent.resolve()
# engine/ops/sources.py alone (stdlib only), without importing the engine package.
_spec = importlib.util.spec_from_file_location("sources", ROOT / "engine" / "ops" / "sources.py")
assert _spec is not None and _spec.loader is not None
sources = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sources)
CSRC: Path = sources.CSRC

# The entry points: entry_points.cpp includes every *_ops.cpp file, dispatch.cpp and
# thread_pool.cpp, one translation unit that parses torch's headers once (see its comment).
ENTRY_POINTS = ("entry_points.cpp",)
KERNELS = (
    "attention_kernels.cpp",
    "elementwise_kernels.cpp",
    "quant_kernels.cpp",
    "bf16_linear_kernels.cpp",
    "lora_kernels.cpp",
)
BASELINE_ISA = "isa_portable"
X86 = platform.machine().lower() in ("x86_64", "amd64")
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
# The instruction sets an x86-64 build may compile beside the baseline one, by the names
# dispatch.cpp gives them, with their -m flags (kernels.h). Each is a superset of the one
# before, and the link keeps this order: an inline function the linker merges keeps the copy
# of the smallest set that has one.
EXTRA_ISAS = {
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512_bf16": [*_AVX512, "-mavx512bf16"],
}
# The /proc/cpuinfo flags of a CPU that runs each set: its -m flags, as dispatch.cpp's
# has_* checks them from CPUID.
_AVX2_CPU = {"avx2", "fma", "f16c"}
_AVX512_CPU = _AVX2_CPU | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
CPU_FLAGS = {"avx2": _AVX2_CPU, "avx512": _AVX512_CPU, "avx512_bf16": _AVX512_CPU | {"avx512_bf16"}}
ISAS_SETTING = "PAGEDSERVE_CPU_ISAS"
_OPENMP_LIBS = ("libgomp*.so*", "libomp*.so*", "libiomp5*.so*")


def cpuinfo_flags(cpuinfo: str) -> set[str]:
    """The flags of the first CPU in /proc/cpuinfo's text (x86: its `flags` line)."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return set(value.split())
    return set()


def extra_isas(setting: str | None, cpuinfo: str | None = None, x86: bool = X86) -> list[str]:
    """The extra instruction sets to build beside the portable one, smallest first (the link
    order), for the value `setting` of PAGEDSERVE_CPU_ISAS:

    - unset, blank or `all`: every set of the architecture (none off x86-64), so the module
      runs at its best on any CPU;
    - `native`: the sets this machine's CPU runs, from the flags of /proc/cpuinfo (read
      when `cpuinfo` is None): a faster build for this machine alone;
    - a comma-separated list of set names, in any order (`portable`, always built, adds
      nothing).

    Raises ValueError, naming the choices, for an unknown name, for `all` or `native`
    beside other names, for an x86-64 set off x86-64, and for `native` without
    /proc/cpuinfo.
    """
    names = [name.strip() for name in (setting or "").split(",") if name.strip()] or ["all"]
    choices = f"all (the default), native, or a comma-separated list of {', '.join(EXTRA_ISAS)}"
    unknown = [n for n in names if n not in ("all", "native", "portable", *EXTRA_ISAS)]
    if unknown:
        raise ValueError(
            f"{ISAS_SETTING}={setting}: unknown instruction set {', '.join(unknown)}; "
            f"choose {choices}"
        )
    if len(names) > 1 and ("all" in names or "native" in names):
        raise ValueError(f"{ISAS_SETTING}={setting}: all and native stand alone; choose {choices}")
    if names == ["all"]:
        return list(EXTRA_ISAS) if x86 else []
    if names == ["native"]:
        if not x86:
            return []
        if cpuinfo is None:
            try:
                cpuinfo = Path("/proc/cpuinfo").read_text()
            except OSError as error:
                raise ValueError(
                    f"{ISAS_SETTING}=native reads the CPU's flags from /proc/cpuinfo, which "
                    f"is unreadable here ({error}); name the sets instead: {choices}"
                ) from error
        flags = cpuinfo_flags(cpuinfo)
        return [isa for isa, needed in CPU_FLAGS.items() if needed <= flags]
    wanted = [isa for isa in EXTRA_ISAS if isa in names]
    if wanted and not x86:
        raise ValueError(
            f"{ISAS_SETTING}={setting}: {', '.join(wanted)}: x86-64 only; this machine "
            f"({platform.machine()}) builds the portable set alone"
        )
    return wanted


def isa_macro(isa: str) -> str:
    """The macro that tells kernels.h and dispatch.cpp the build holds extra set `isa`."""
    return f"PAGEDSERVE_WITH_ISA_{isa.upper()}"


def openmp_flags() -> tuple[list[str], list[str]]:
    """(cflags, ldflags) that run the kernels' at::parallel_for on torch's thread pool.

    With torch's OpenMP backend, at::parallel_for is inlined into the extension as an
    OpenMP region: without -fopenmp it would run on one thread. Linking the OpenMP runtime
    torch itself loads (its wheel bundles one) keeps a single pool, sized by
    torch.set_num_threads, instead of a second runtime with its own threads.
    """
    import torch

    if platform.system() != "Linux" or "backend: OpenMP" not in torch.__config__.parallel_info():
        return [], []
    torch_lib = Path(torch.__file__).parent / "lib"
    bundled = sorted(p for pattern in _OPENMP_LIBS for p in torch_lib.glob(pattern))
    if not bundled:  # torch uses the system's runtime, which -fopenmp links too
        return ["-fopenmp"], ["-fopenmp"]
    return ["-fopenmp"], [f"-L{torch_lib}", f"-l:{bundled[0].name}"]


class BuildKernels(cpp_extension.BuildExtension):
    """Compiles the extension's own sources (entry points and the baseline kernels) with the
    baseline flags, and KERNELS once more per extra instruction set with its -m flags: the
    sets whose macro the extension defines (kernels_extension), so the objects linked and
    dispatch.cpp's table name the same sets. The extra objects are linked after the baseline
    ones, smallest set first (see kernels.h for why)."""

    def build_extension(self, ext: cpp_extension.setuptools.Extension) -> None:
        baseline_macros = [m for m in ext.define_macros if m[0] != "PAGEDSERVE_ISA"]
        defined = {name for name, _ in ext.define_macros}
        objects = []
        for isa, flags in EXTRA_ISAS.items():
            if isa_macro(isa) not in defined:
                continue
            namespace = f"isa_{isa}"
            objects += self.compiler.compile(
                [str(CSRC / name) for name in KERNELS],
                output_dir=os.path.join(self.build_temp, namespace),
                macros=[*baseline_macros, ("PAGEDSERVE_ISA", namespace)],
                include_dirs=ext.include_dirs,
                extra_postargs={"cxx": [*ext.extra_compile_args["cxx"], *flags]},
                depends=ext.depends,
            )
        ext.extra_objects = objects
        super().build_extension(ext)


def kernels_extension(isas: list[str]) -> cpp_extension.setuptools.Extension:
    """The module engine/ops/_C, with the portable kernels and those of the extra sets
    `isas` (extra_isas)."""
    openmp_cflags, ldflags = openmp_flags()
    macros: list[tuple[str, str | None]] = [
        ("PAGEDSERVE_ISA", BASELINE_ISA),
        ("PAGEDSERVE_SOURCES_SHA256", sources.sources_sha256()),
    ]
    macros += [(isa_macro(isa), None) for isa in isas]
    return cpp_extension.CppExtension(
        "engine.ops._C",
        [str((CSRC / name).relative_to(ROOT)) for name in (*ENTRY_POINTS, *KERNELS)],
        define_macros=macros,
        # -g0: the interpreter's CFLAGS may ask for debug info, which would fill the wheel.
        extra_compile_args={"cxx": ["-O3", "-g0", "-fno-math-errno", *openmp_cflags]},
        extra_link_args=ldflags,
        depends=[str(p.relative_to(ROOT)) for p in sorted(CSRC.iterdir())],
        py_limited_api=True,
    )


def ninja_on_path() -> None:
    """torch builds in parallel with `ninja` from PATH; the PyPI wheel's binary may sit only
    in its package (a venv's bin/ is not on PATH under `.venv/bin/python -m pip`)."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return  # torch then compiles one file at a time
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


# Run by pip and `python setup.py`; a test imports the helpers above without building.
if __name__ == "__main__":
    try:
        isas = extra_isas(os.environ.get(ISAS_SETTING))
    except ValueError as error:
        sys.exit(str(error))
    ninja_on_path()
    setup(
        ext_modules=[kernels_extension(isas)],
        cmdclass={"build_ext": BuildKernels},
        options={"bdist_wheel": {"py_limited_api": "cp310"}},
    )
