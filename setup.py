"""Builds the native CPU kernels (engine/ops/csrc) into the module engine/ops/_C, against
the torch installed in the build environment. Everything else is in pyproject.toml.

    pip install --no-build-isolation .      (or -e ., or pip wheel --no-build-isolation .)

The kernels link against libtorch, so they must be built with the torch they will run
with: an isolated build environment would bring its own torch. One binary serves every
CPU of its architecture: the kernels are compiled once per instruction set and chosen at
run time (engine/ops/csrc/kernels.h); never with -march=native.
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

ENTRY_POINTS = (
    "dispatch.cpp",
    "attention_ops.cpp",
    "elementwise_ops.cpp",
    "quant_ops.cpp",
    "bf16_linear_ops.cpp",
    "decoder_ops.cpp",
    "lora_ops.cpp",
    "moe_ops.cpp",
)
KERNELS = (
    "attention_kernels.cpp",
    "elementwise_kernels.cpp",
    "quant_kernels.cpp",
    "bf16_linear_kernels.cpp",
    "lora_kernels.cpp",
)
BASELINE_ISA = "isa_portable"
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
# The instruction sets compiled beside the baseline one, with their flags (kernels.h). Each
# is a superset of the one before, and the link keeps this order: an inline function the
# linker merges keeps the copy of the smallest set that has one.
EXTRA_ISAS = (
    {
        "isa_avx2": _AVX2,
        "isa_avx512": _AVX512,
        "isa_avx512_bf16": [*_AVX512, "-mavx512bf16"],
    }
    if platform.machine().lower() in ("x86_64", "amd64")
    else {}
)
_OPENMP_LIBS = ("libgomp*.so*", "libomp*.so*", "libiomp5*.so*")


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
    baseline flags, and KERNELS once more per extra instruction set with its -m flags. The
    extra objects are linked after the baseline ones (see kernels.h for why)."""

    def build_extension(self, ext: cpp_extension.setuptools.Extension) -> None:
        baseline_macros = [m for m in ext.define_macros if m[0] != "PAGEDSERVE_ISA"]
        objects = []
        for namespace, flags in EXTRA_ISAS.items():
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


def kernels_extension() -> cpp_extension.setuptools.Extension:
    openmp_cflags, ldflags = openmp_flags()
    macros = [
        ("PAGEDSERVE_ISA", BASELINE_ISA),
        ("PAGEDSERVE_SOURCES_SHA256", sources.sources_sha256()),
    ]
    if EXTRA_ISAS:
        macros.append(("PAGEDSERVE_WITH_X86_ISAS", None))
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


ninja_on_path()
setup(
    ext_modules=[kernels_extension()],
    cmdclass={"build_ext": BuildKernels},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
