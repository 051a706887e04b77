"""The native CPU kernels' instruction set an engine runs (--cpu-isa): chosen, and refused
where it cannot run, before the model is built, since the dtype and the weight layouts
follow the set. The choice is process-wide (engine/ops/loader.py)."""

from __future__ import annotations

import torch

from engine.config import KernelChoice
from engine.ops.loader import check_cpu_isa, native_kernels, select_cpu_isa


def check_kernels(cpu_isa: str, device: torch.device) -> None:
    """Raises ValueError, naming the choices, when the set `cpu_isa` cannot run on `device`
    here: on CUDA, any but auto (the native kernels would be silently unused)."""
    if device.type == "cpu":
        check_cpu_isa(cpu_isa)
    elif cpu_isa != "auto":
        raise ValueError(
            f"--cpu-isa {cpu_isa} picks the native CPU kernels, which do not run on "
            f"{device.type}; leave it auto"
        )


def resolve_kernels(cpu_isa: str, device: torch.device) -> KernelChoice | None:
    """On the CPU, makes every native op of this process run the instruction set `cpu_isa`
    asks for (before the model is built: dtype and weight layouts follow the set) and says
    which; None on CUDA. Raises ValueError as check_kernels does."""
    check_kernels(cpu_isa, device)
    if device.type != "cpu":
        return None
    select_cpu_isa(cpu_isa)
    kernels = native_kernels()
    forced = cpu_isa != "auto"
    return KernelChoice(kernels.isa, forced, kernels.built, kernels.supported, kernels.reason)
