"""`--dtype auto` on the CPU: bfloat16 where the CPU or the native kernels compute it fast."""

from __future__ import annotations

import pytest
import torch

from engine.ops.loader import native_kernels
from engine.worker.worker import cpu_flags, cpu_prefers_bf16, resolve_dtype

ZEN3 = "flags : fpu sse2 avx fma avx2 f16c"
ZEN4 = ZEN3 + " avx512f avx512bw avx512_bf16 avx512_vnni"


@pytest.mark.parametrize(
    ("flags", "isa", "bf16"),
    [
        (ZEN4, "avx512_bf16", True),
        (ZEN4, None, True),  # the CPU's own bf16 dot products, kernels or not
        (ZEN3 + " amx_bf16", "portable", True),
        (ZEN3, "avx2", True),  # the AVX2 bf16 tile kernel
        (ZEN3, "portable", False),
        (ZEN3, None, False),  # no kernels: torch's bf16 matmul is slow here
        (ZEN3 + " avx512f", "avx512", False),
        ("flags : avx2 avx512_bf16x", "portable", False),  # whole flags only
    ],
)
def test_cpu_prefers_bf16(flags: str, isa: str | None, bf16: bool) -> None:
    assert cpu_prefers_bf16(flags, isa) is bf16


def test_auto_resolves_on_this_cpu() -> None:
    expected = cpu_prefers_bf16(cpu_flags(), native_kernels().isa)
    dtype = resolve_dtype("auto", torch.device("cpu"))
    assert dtype == (torch.bfloat16 if expected else torch.float32)
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int3", torch.device("cpu"))
