"""The built kernel module: it loads (a failure here fails the suite, never skips it), it
runs the best instruction set this CPU has, it is refused when it does not match this
torch or these sources, and its baseline code runs on any CPU of its architecture."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from engine.ops.loader import (
    MODULE_DIR,
    NativeKernelsError,
    check_build_info,
    module_path,
    native_kernels,
)
from engine.ops.sources import CSRC, sources_sha256

X86 = platform.machine().lower() in ("x86_64", "amd64")
AVX2_FLAGS = ("avx2", "fma", "f16c")
AVX512_FLAGS = (*AVX2_FLAGS, "avx512f", "avx512bw", "avx512vl", "avx512dq")
# Mnemonics of AVX512_BF16, which only the avx512_bf16 set may contain.
BF16_MNEMONICS = ("vdpbf16ps", "vcvtneps2bf16", "vcvtne2ps2bf16")


def test_the_native_kernels_load() -> None:
    kernels = native_kernels()
    assert kernels.available, kernels.reason
    assert kernels.isa == kernels.supported[0]
    assert module_path().parent == MODULE_DIR


def cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    line = next(ln for ln in cpuinfo.splitlines() if ln.startswith("flags"))
    return set(line.partition(":")[2].split())


def test_the_cpu_runs_its_best_instruction_set() -> None:
    """What the kernels found in CPUID, against what the kernel reports in /proc/cpuinfo."""
    flags = cpu_flags() if X86 else set()
    expected = ["portable"]
    if set(AVX2_FLAGS) <= flags:
        expected.insert(0, "avx2")
    if set(AVX512_FLAGS) <= flags:
        expected.insert(0, "avx512")
        if "avx512_bf16" in flags:
            expected.insert(0, "avx512_bf16")
    print(f"supported: {native_kernels().supported}")
    assert list(native_kernels().supported) == expected
    assert torch.ops.pagedserve.cpu_isa() == expected[0]


def test_build_info_matches_this_torch_and_these_sources() -> None:
    info = dict(torch.ops.pagedserve.build_info())
    assert info["torch"] == torch.__version__.split("+")[0]
    assert info["sources_sha256"] == sources_sha256()
    assert info["isas"] == ("avx512_bf16 avx512 avx2 portable" if X86 else "portable"), (
        "the tests run the build of every set: PAGEDSERVE_CPU_ISAS unset (docs/install.md)"
    )
    check_build_info(info)


def test_an_unknown_instruction_set_is_refused() -> None:
    x = torch.ones(2, 16)
    with pytest.raises(RuntimeError, match="this build has no sse9 kernels"):
        torch.ops.pagedserve.rms_norm(torch.empty_like(x), x, torch.ones(16), 1e-6, "sse9")


def test_a_module_from_other_sources_or_for_another_torch_is_refused(tmp_path: Path) -> None:
    info = dict(torch.ops.pagedserve.build_info())
    edited = tmp_path / "csrc"
    shutil.copytree(CSRC, edited)
    kernel = edited / "attention_item.h"
    kernel.write_text(kernel.read_text().replace("kChunk % W == 0", "kChunk % W == 1"))
    with pytest.raises(NativeKernelsError, match="built from other sources"):
        check_build_info(info, edited)
    with pytest.raises(NativeKernelsError, match=r"built against torch 2\.0\.0, running"):
        check_build_info(info | {"torch": "2.0.0"})
    with pytest.raises(NativeKernelsError, match="installed without its built module"):
        module_path(tmp_path)


def functions_using(disassembly: str, instruction: re.Pattern[str]) -> dict[str, set[str]]:
    """Function name (demangled where objdump can) -> its instructions matching the pattern
    (searched in "mnemonic operands"), by mnemonic."""
    found: dict[str, set[str]] = {}
    function = ""
    for line in disassembly.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
        if header:
            function = header.group(1)
            continue
        fields = line.split("\t")
        if len(fields) >= 2 and fields[1].strip() and instruction.search(fields[1]):
            found.setdefault(function, set()).add(fields[1].split()[0])
    return found


def test_each_instruction_set_holds_only_its_instructions() -> None:
    """The baseline code (entry points, dispatch, portable kernels, and any inline function
    the linker merged across objects) has no VEX/EVEX instruction, so the module runs on any
    x86-64 CPU; the avx2 set touches no AVX-512 register; only the avx512_bf16 set has
    AVX512_BF16 instructions. Other targets build the portable set alone."""
    if not X86:
        assert native_kernels().supported == ("portable",)
        return
    objdump = shutil.which("objdump")
    assert objdump, "objdump (binutils, installed with the C++ compiler) is needed"
    disassembly = subprocess.run(
        [objdump, "-d", "-C", "--no-show-raw-insn", str(module_path())],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # Names are matched mangled or not: objdump leaves some clones (.cold) mangled.
    vex = functions_using(disassembly, re.compile(r"^v"))
    outside = {f: m for f, m in vex.items() if "isa_avx" not in f}
    assert outside == {}, f"AVX instructions outside the AVX sets: {outside}"
    assert any("pagedserve::isa_avx2::" in f for f in vex)
    avx512 = functions_using(disassembly, re.compile(r"%zmm|%k[0-7]"))
    assert avx512 and all("isa_avx512" in f for f in avx512), avx512
    bf16 = functions_using(disassembly, re.compile("^(" + "|".join(BF16_MNEMONICS) + ")\\b"))
    assert bf16 and all("isa_avx512_bf16" in f for f in bf16), bf16
