"""Parameters over every instruction set of the native kernels, for kernel tests.

Each set the build holds is a test case: one this CPU runs runs, and one it cannot run is
reported as skipped with the reason (`-rs`), so an AVX-512 test that never ran on an AVX2
machine shows as such rather than not existing. conftest.py lets exactly these skips
through (CPU_LACKS), and fails every other skip outside GPU tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from _pytest.mark.structures import ParameterSet

# The start of the reason an instruction set's test is skipped with.
CPU_LACKS = "this CPU lacks "


def isa_params() -> list[ParameterSet]:
    """pytest.param(isa, id=isa) for every set the build holds, best first; those this CPU
    cannot run carry a skip mark. Empty when the native kernels are unavailable, which
    pytest reports as an empty parameter set: a skip that conftest.py fails."""
    from engine.ops.loader import native_kernels

    kernels = native_kernels()
    return [
        pytest.param(
            isa,
            id=isa,
            marks=() if isa in kernels.supported else pytest.mark.skip(reason=CPU_LACKS + isa),
        )
        for isa in kernels.built
    ]
