"""The native CPU kernels' build: csrc/ (paged attention and the fused elementwise ops of
engine.ops.native_ops), registered as torch.ops.pagedserve.*.

The extension is JIT-compiled with torch's cpp_extension the first time it is
needed, for the CPU it runs on (-march=native), and cached under torch's extension
directory (TORCH_EXTENSIONS_DIR when set). The cache entry's name carries a fingerprint
of what -march=native means on this machine, so a cache shared between machines never
loads a binary built for another CPU. Without a C++ compiler or ninja, or if the build
fails, `native_kernels_available()` says so and `auto` falls back to the torch backend.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("paged_attention_cpu.cpp", "elementwise_cpu.cpp", "quant_linear_cpu.cpp")
HEADERS = ("attention_common.h", "attention_avx512.h", "attention_portable.h")
_MAX_REASON_LINES = 30
_OPENMP_LIBS = ("libgomp*.so*", "libomp*.so*", "libiomp5*.so*")


def _arch_flags() -> list[str]:
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return ["-march=native"]
    if machine in ("aarch64", "arm64"):
        return ["-mcpu=native"]
    return []


def _openmp_flags() -> tuple[list[str], list[str]]:
    """(cflags, ldflags) that run the extension's at::parallel_for on torch's thread pool.

    With torch's OpenMP backend, at::parallel_for is inlined into the extension as an
    OpenMP region: without -fopenmp it would run on one thread. Linking the OpenMP runtime
    torch itself loaded (its wheel bundles one) keeps a single pool, sized by
    torch.set_num_threads, instead of a second runtime with its own threads.
    """
    if platform.system() != "Linux" or "backend: OpenMP" not in torch.__config__.parallel_info():
        return [], []
    torch_lib = Path(torch.__file__).parent / "lib"
    bundled = sorted(p for pattern in _OPENMP_LIBS for p in torch_lib.glob(pattern))
    if not bundled:  # torch uses the system's runtime, which -fopenmp links too
        return ["-fopenmp"], ["-fopenmp"]
    return ["-fopenmp"], [f"-L{torch_lib}", f"-l:{bundled[0].name}"]


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def _cpu_fingerprint(compiler: str) -> str:
    """What the native arch flags expand to here (the target CPU and its features)."""
    probe = [compiler, *_arch_flags(), "-###", "-x", "c++", "-c", os.devnull, "-o", os.devnull]
    try:
        expanded = subprocess.run(probe, capture_output=True, text=True, timeout=60).stderr
    except (OSError, subprocess.SubprocessError):
        expanded = ""
    # gcc lists -march=<cpu> and -m<feature> flags; clang "-target-cpu" and "-target-feature"
    # pairs. Everything else in the output (temporary file names) varies from run to run.
    tokens = expanded.replace('"', " ").split()
    kept = [
        " ".join(tokens[i : i + 2]) if tok in ("-target-cpu", "-target-feature") else tok
        for i, tok in enumerate(tokens)
        if tok.startswith("-m") or tok in ("-target-cpu", "-target-feature")
    ]
    flags = " ".join(sorted(set(kept)))
    if not flags:  # unknown compiler output: fall back to the kernel's view of the CPU
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
            flags = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
        except OSError:
            flags = platform.processor()
    return flags


def _extension_name(compiler: str, flags: list[str]) -> str:
    """Unique per source text, flags, compiler, torch version and CPU: a cached build is
    reused only when it was built from exactly these sources for exactly this CPU."""
    digest = hashlib.sha256()
    versions = f"{torch.__version__} {sys.version_info[:2]}"  # it links libtorch_python
    for part in (compiler, versions, _cpu_fingerprint(compiler), *flags):
        digest.update(part.encode() + b"\0")
    for source in (*SOURCES, *HEADERS):
        digest.update((CSRC / source).read_bytes())
    return f"pagedserve_cpu_{digest.hexdigest()[:16]}"


@contextmanager
def _ninja_on_path() -> Iterator[None]:
    """torch looks for `ninja` on PATH; the PyPI wheel's binary may only be in its package."""
    if shutil.which("ninja") is not None:
        yield
        return
    try:
        import ninja
    except ImportError:
        yield
        return
    old_path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, old_path])
    try:
        yield
    finally:
        os.environ["PATH"] = old_path


def _build_dir(name: str) -> Path:
    """torch's extension root (TORCH_EXTENSIONS_DIR when set) / name."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / name


def _build_and_load() -> None:
    """Compiles (or reuses the cached build of) the extension and registers its ops."""
    from torch.utils import cpp_extension

    if platform.system() == "Windows":
        raise RuntimeError("the native CPU kernels are built with gcc or clang flags only")
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++/clang++)")
    openmp_cflags, ldflags = _openmp_flags()
    cflags = ["-O3", "-fno-math-errno", *_arch_flags(), *openmp_cflags]
    name = _extension_name(compiler, cflags + ldflags)
    build_dir = _build_dir(name)
    if not (build_dir / f"{name}.so").exists():
        logger.warning("compiling the native CPU kernels into %s (once; under a minute)", build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with _ninja_on_path():
        if not cpp_extension.is_ninja_available():
            raise RuntimeError("ninja is not installed (pip install ninja)")
        cpp_extension.load(
            name=name,
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cflags=cflags,
            extra_ldflags=ldflags,
            build_directory=str(build_dir),
            is_python_module=False,
        )
    isa = torch.ops.pagedserve.cpu_isa()
    logger.info("native CPU kernels %s (%s) ready in %.1fs", name, isa, time.perf_counter() - start)


@functools.cache
def native_kernels_available() -> bool:
    """Builds or loads the extension once per process; False (with a warning) if it fails.

    The result is cached because loading registers the ops in this process for good.
    """
    try:
        _build_and_load()
    except Exception as exc:  # a compiler error is a RuntimeError, a missing tool an OSError
        # Compiler output can run to pages; its tail names the first error often enough.
        reason = "\n".join(str(exc).splitlines()[-_MAX_REASON_LINES:])
        logger.warning("native CPU attention kernels are unavailable: %s", reason)
        return False
    return True
