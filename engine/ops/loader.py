"""Loading the native CPU kernels: the module engine/ops/_C that installing the package
builds (setup.py), whose ops register as torch.ops.pagedserve.*.

Nothing is compiled at run time. The module is refused, with the reason, when it is
missing (a checkout that was never built), cannot load, was built against another torch,
or was built from other sources than the csrc/ beside it (a checkout edited since its
last build). Then `auto` runs the torch attention backend and the torch elementwise ops,
and the error log says so.

Every native op runs the kernels of one instruction set, process-wide: the best this CPU
runs, unless select_cpu_isa (the engine's --cpu-isa) picked another that it runs.
"""

from __future__ import annotations

import functools
import importlib.machinery
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.ops.sources import CSRC, sources_sha256

logger = logging.getLogger(__name__)

MODULE_DIR = Path(__file__).resolve().parent
_REBUILD = (
    "rebuild it against this torch: pip install --no-build-isolation [-e] . (or make install)"
)


class NativeKernelsError(RuntimeError):
    """The native kernels cannot be used; the message says why."""


@dataclass(frozen=True)
class NativeKernels:
    """What the native kernels offer this process, or why there are none."""

    best: str | None  # the best set this CPU runs ("avx2", ...); None when unavailable
    supported: tuple[str, ...] = ()  # the sets this build holds and this CPU runs, best first
    reason: str = ""  # why unavailable
    built: tuple[str, ...] = ()  # every set this build holds, best first

    @property
    def available(self) -> bool:
        return self.best is not None

    @property
    def isa(self) -> str | None:
        """The set every native op runs now: `best`, or what select_cpu_isa picked. Asked
        of the module each time, as the selection may change; None when unavailable."""
        return str(torch.ops.pagedserve.cpu_isa()) if self.available else None

    def describe(self) -> str:
        isa = self.isa
        return isa if isa is not None else f"unavailable ({self.reason})"


def module_path(directory: Path = MODULE_DIR) -> Path:
    """The built module's file; raises NativeKernelsError when the package has none."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = directory / f"_C{suffix}"
        if path.exists():
            return path
    raise NativeKernelsError(f"the package was installed without its built module _C; {_REBUILD}")


def check_build_info(info: dict[str, str], csrc: Path = CSRC) -> None:
    """Raises NativeKernelsError when the module was built for another torch, or from other
    sources than `csrc` (when the sources are there: a checkout, not an installed wheel)."""
    running = torch.__version__.split("+")[0]
    if info["torch"] != running:
        raise NativeKernelsError(
            f"built against torch {info['torch']}, running {running}; {_REBUILD}"
        )
    if csrc.is_dir() and info["sources_sha256"] != sources_sha256(csrc):
        raise NativeKernelsError(
            f"built from other sources than {csrc} (edited since the build); {_REBUILD}"
        )


def _load() -> NativeKernels:
    path = module_path()
    try:
        torch.ops.load_library(str(path))
    except OSError as error:
        raise NativeKernelsError(f"{path.name} does not load ({error}); {_REBUILD}") from error
    ops = torch.ops.pagedserve
    check_build_info(dict(ops.build_info()))
    supported = tuple(ops.supported_isas())
    return NativeKernels(supported[0], supported, built=tuple(ops.built_isas()))


@functools.cache
def native_kernels() -> NativeKernels:
    """Loads the module once per process (loading registers its ops for good) and says
    what it offers; `isa` says which set runs now. Logs an error when the kernels cannot be
    used."""
    try:
        kernels = _load()
    except NativeKernelsError as error:
        logger.error("native CPU kernels unavailable: %s", error)
        return NativeKernels(None, reason=str(error))
    logger.info(
        "native CPU kernels: this CPU runs %s (built: %s)",
        ", ".join(kernels.supported),
        ", ".join(kernels.built),
    )
    return kernels


def check_cpu_isa(name: str) -> None:
    """Raises ValueError, naming the choices, unless select_cpu_isa(name) can run here:
    "auto", or a set this build holds and this CPU runs (any set but "auto" when the kernels
    are unavailable)."""
    if name == "auto":
        return
    kernels = native_kernels()
    if not kernels.available:
        raise ValueError(
            f"--cpu-isa {name}: the native CPU kernels are unavailable ({kernels.reason})"
        )
    if name not in kernels.supported:
        if name in kernels.built:
            problem = f"this CPU lacks {name}; it runs"
        else:
            problem = f"this build has no {name}; this CPU runs"
        raise ValueError(
            f"--cpu-isa {name}: {problem} {', '.join(kernels.supported)} "
            f"(built: {', '.join(kernels.built)})"
        )


def select_cpu_isa(name: str) -> None:
    """Makes every native op of this process run the kernels of instruction set `name`
    from now on; "auto" runs the best this CPU runs. Switch between steps, never while
    kernels run. Raises ValueError as check_cpu_isa does."""
    check_cpu_isa(name)
    if native_kernels().available:
        torch.ops.pagedserve.select_cpu_isa(name)
