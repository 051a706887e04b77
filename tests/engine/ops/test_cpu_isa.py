"""Choosing the native kernels' instruction set (the engine's --cpu-isa): select_cpu_isa
switches the set every native op runs, process-wide, and refuses a set this build lacks
or this CPU cannot run, naming the choices. conftest.py puts it back on auto after each
test."""

from __future__ import annotations

import platform

import pytest
import torch

from engine.models.layers import tile_bf16_weight
from engine.models.quantized import pack_tiles, quantize_int8
from engine.ops import loader
from engine.ops.loader import NativeKernels, native_kernels, select_cpu_isa
from tests.isas import CPU_LACKS, isa_params

ops = torch.ops.pagedserve
X86 = platform.machine().lower() in ("x86_64", "amd64")


def test_the_module_lists_every_set_it_holds_and_those_this_cpu_runs() -> None:
    kernels = native_kernels()
    assert kernels.built == (
        ("avx512_bf16", "avx512", "avx2", "portable") if X86 else ("portable",)
    ), "the tests run the build of every set: PAGEDSERVE_CPU_ISAS unset (docs/install.md)"
    assert kernels.built == tuple(ops.built_isas())
    assert kernels.supported == tuple(isa for isa in kernels.built if isa in kernels.supported)
    assert kernels.supported[-1] == "portable"
    assert kernels.best == kernels.supported[0] == kernels.isa


def test_isa_params_cover_every_built_set_and_skip_only_what_this_cpu_lacks() -> None:
    params = isa_params()
    assert [p.id for p in params] == list(native_kernels().built)
    for param in params:
        (isa,) = param.values
        reasons = [mark.kwargs["reason"] for mark in param.marks]
        assert reasons == ([] if isa in native_kernels().supported else [CPU_LACKS + isa])


def outputs(isa: str | None) -> dict[str, torch.Tensor]:
    """One output of each kind of op, in instruction set `isa`; None: the selected set, as
    the engine calls them."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 576, generator=g) * 3).bfloat16()
    bf16_weight = tile_bf16_weight(torch.randn(96, 576, generator=g).bfloat16())
    quant_weight = pack_tiles(quantize_int8(torch.randn(96, 576, generator=g)))
    norm = torch.empty_like(x)
    ops.rms_norm(norm, x, torch.ones(576, dtype=torch.bfloat16), 1e-6, isa)
    silu = torch.empty(5, 288)
    ops.silu_and_mul(silu, x.float(), isa)
    return {
        "bf16_linear": ops.bf16_linear(x, bf16_weight, 96, isa),
        "quant_linear": ops.quant_linear(x, *quant_weight.kernel_args(), isa=isa),
        "rms_norm": norm,
        "silu_and_mul": silu,
    }


@pytest.mark.parametrize("isa", isa_params())
def test_a_selected_set_runs_every_op(isa: str) -> None:
    select_cpu_isa(isa)
    assert ops.cpu_isa() == native_kernels().isa == isa
    selected, expected = outputs(None), outputs(isa)
    for name, output in selected.items():
        assert torch.equal(output, expected[name]), name
    select_cpu_isa("auto")
    assert native_kernels().isa == native_kernels().best


def test_the_sets_give_different_bits_so_the_selection_shows() -> None:
    """Where this CPU runs several sets, some op's bits differ between them: the test above
    tells them apart, rather than passing whichever set ran."""
    supported = native_kernels().supported
    if len(supported) == 1:
        assert supported == ("portable",)
        return
    first, last = outputs(supported[0]), outputs(supported[-1])
    differ = [name for name in first if not torch.equal(first[name], last[name])]
    print(f"{supported[0]} and {supported[-1]} differ in {differ}")
    assert differ


def choices() -> str:
    kernels = native_kernels()
    return f"{', '.join(kernels.supported)} (built: {', '.join(kernels.built)})"


def test_a_set_this_build_lacks_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError) as refused:
        select_cpu_isa("sse9")
    assert (
        str(refused.value) == f"--cpu-isa sse9: this build has no sse9; this CPU runs {choices()}"
    )
    assert native_kernels().isa == native_kernels().best  # a refusal changes nothing
    with pytest.raises(RuntimeError, match="this build has no sse9 kernels"):
        ops.select_cpu_isa("sse9")


def test_a_set_this_cpu_lacks_is_refused_naming_the_choices() -> None:
    """Every built set this CPU cannot run; on a CPU that runs them all, there is none."""
    kernels = native_kernels()
    for isa in (isa for isa in kernels.built if isa not in kernels.supported):
        with pytest.raises(ValueError) as refused:
            select_cpu_isa(isa)
        assert str(refused.value) == f"--cpu-isa {isa}: this CPU lacks {isa}; it runs {choices()}"
        with pytest.raises(RuntimeError, match=f"this CPU cannot run the {isa} kernels"):
            ops.select_cpu_isa(isa)
    assert native_kernels().isa == kernels.best


def test_without_the_kernels_only_auto_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = NativeKernels(None, reason="_C.abi3.so does not load")
    monkeypatch.setattr(loader, "native_kernels", lambda: broken)
    select_cpu_isa("auto")
    with pytest.raises(ValueError, match=r"^--cpu-isa portable: the native CPU kernels are "):
        select_cpu_isa("portable")
