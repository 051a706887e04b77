"""An engine's --cpu-isa (EngineArgs.cpu_isa): the worker selects the set before it builds
the model, so every native op and the weight layouts follow it, and refuses a set that
cannot run here, naming the choices. conftest.py puts the selection back on auto."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, EngineArgs, SamplingParams
from engine.config import KernelChoice
from engine.models.layers import TILED_BF16_ISAS, Linear
from engine.ops.loader import native_kernels
from engine.worker.cpu_kernels import resolve_kernels
from engine.worker.worker import check_cpu_kernels
from tests.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def tiled_layers(llm: LLM) -> list[bool]:
    model = llm.core.runner.model
    return [m.tiled is not None for m in model.modules() if isinstance(m, Linear)]


@pytest.mark.parametrize("cpu_isa", ["portable", "auto"])
def test_an_engine_runs_and_reports_the_set_it_was_given(tmp_path: Path, cpu_isa: str) -> None:
    kernels = native_kernels()
    llm = LLM(
        str(make_tiny_model("llama", tmp_path)), dtype="bfloat16", device="cpu", cpu_isa=cpu_isa
    )
    isa = kernels.best if cpu_isa == "auto" else cpu_isa
    assert torch.ops.pagedserve.cpu_isa() == isa
    how = "auto: best this CPU runs" if cpu_isa == "auto" else "forced by --cpu-isa"
    assert dict(llm.config.facts())["native kernels"] == f"{isa} ({how})"
    # The bf16 tile layout was decided with the selected set in force.
    layers = tiled_layers(llm)
    assert layers and all(tiled == (isa in TILED_BF16_ISAS) for tiled in layers), layers
    [output] = llm.generate([[5, 6, 7, 8]], GREEDY)
    assert len(output.outputs[0].token_ids) == 6
    llm.close()


def test_the_next_engine_on_auto_goes_back_to_the_best_set(tmp_path: Path) -> None:
    model = str(make_tiny_model("llama", tmp_path))
    LLM(model, dtype="float32", device="cpu", num_kv_blocks=32, cpu_isa="portable").close()
    assert native_kernels().isa == "portable"
    LLM(model, dtype="float32", device="cpu", num_kv_blocks=32).close()
    assert native_kernels().isa == native_kernels().best


def test_a_set_that_cannot_run_here_is_refused_naming_the_choices(tmp_path: Path) -> None:
    kernels = native_kernels()
    choices = f"{', '.join(kernels.supported)} (built: {', '.join(kernels.built)})"
    model = str(make_tiny_model("llama", tmp_path))
    with pytest.raises(ValueError) as refused:
        LLM(model, device="cpu", cpu_isa="avx1024")
    assert (
        str(refused.value)
        == f"--cpu-isa avx1024: this build has no avx1024; this CPU runs {choices}"
    )
    for isa in (isa for isa in kernels.built if isa not in kernels.supported):
        with pytest.raises(ValueError, match=f"^--cpu-isa {isa}: this CPU lacks {isa}; it runs "):
            check_cpu_kernels(EngineArgs(cpu_isa=isa))
    assert native_kernels().isa == kernels.best


def test_cuda_refuses_any_set_but_auto() -> None:
    """The native kernels do not run on CUDA: a set given there would be silently ignored."""
    cuda = torch.device("cuda")  # no GPU needed: refused before anything touches it
    assert resolve_kernels("auto", cuda) is None
    with pytest.raises(ValueError, match=r"^--cpu-isa avx2 picks the native CPU kernels, which"):
        resolve_kernels("avx2", cuda)


def test_the_facts_name_the_set_in_use_and_the_choices() -> None:
    built = ("avx512_bf16", "avx512", "avx2", "portable")
    forced = KernelChoice("avx2", True, built, ("avx2", "portable"))
    assert forced.facts() == [
        ("native kernels", "avx2 (forced by --cpu-isa)"),
        ("kernels built", "avx512_bf16 avx512 avx2 portable"),
        ("kernels this CPU runs", "avx2 portable"),
    ]
    assert KernelChoice("avx2", False, built, ("avx2",)).facts()[0][1] == (
        "avx2 (auto: best this CPU runs)"
    )
    unavailable = KernelChoice(None, reason="not built")
    assert unavailable.facts() == [("native kernels", "unavailable (not built)")]
