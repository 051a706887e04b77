"""Multi-LoRA serving in the engine: greedy tokens equal PEFT's merged model in float32, for
a batch that mixes three adapters and the base model, and through the adapter limit, slot
and host-cache eviction, chunked prefill, prefix hits and preemption; adapters never share
cached blocks; bad adapters are refused by name."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.lora import LoRAError, LoRARequest
from tests.engine.test_correctness import hf_greedy, make_prompts, tiny_llm
from tests.isas import isa_params
from tests.tiny_models import make_lora_adapter, make_tiny_model, peft_merged_greedy

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# Adapter name -> (rank, targets, extra LoraConfig settings): q/v only; every layer, with
# rsLoRA scaling; the MLP's and o_proj with another alpha for down_proj.
ADAPTERS = {
    "qv": (4, ["q_proj", "v_proj"], {}),
    "all": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            {"use_rslora": True}),
    "mlp": (2, ["o_proj", "gate_proj", "up_proj", "down_proj"],
            {"alpha_pattern": {"down_proj": 4.0}}),
}  # fmt: skip


@dataclass(frozen=True)
class LoRACase:
    base: Path
    loras: dict[str, LoRARequest]
    prompts: list[list[int]]
    # (prompt index, adapter name or None) -> greedy tokens
    reference: dict[tuple[int, str | None], list[int]]


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> LoRACase:
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_model("llama", root / "base")
    prefix = make_prompts(5, [2 * 16 + 3])[0]
    prompts = [prefix + tail for tail in make_prompts(6, [4, 9])] + make_prompts(7, [21])
    loras, reference = {}, {}
    for i, (name, (rank, targets, extra)) in enumerate(ADAPTERS.items()):
        path = make_lora_adapter(base, root / name, 10 + i, rank, targets, **extra)
        loras[name] = LoRARequest(name, i + 1, str(path))
        outputs = peft_merged_greedy(base, path, prompts, PARAMS.max_tokens)
        reference |= {(p, name): out for p, out in enumerate(outputs)}
    outputs = hf_greedy(base, prompts, PARAMS.max_tokens)
    reference |= {(p, None): out for p, out in enumerate(outputs)}
    return LoRACase(base, loras, prompts, reference)


def run(llm, case: LoRACase, jobs: list[tuple[int, str | None]]) -> list[list[int]]:
    loras = [None if name is None else case.loras[name] for _, name in jobs]
    outputs = llm.generate([case.prompts[p] for p, _ in jobs], PARAMS, lora_request=loras)
    return [o.outputs[0].token_ids for o in outputs]


def test_adapters_change_the_output(case: LoRACase) -> None:
    for name in ADAPTERS:
        assert any(case.reference[(p, name)] != case.reference[(p, None)] for p in range(3))


def test_one_step_mixes_three_adapters_and_the_base_model(case: LoRACase) -> None:
    llm = tiny_llm(case.base, enable_lora=True, max_loras=3, max_lora_rank=8)
    # The layers run as the native decoder op, which applies the adapters itself.
    assert llm.core.runner.model.fused_layers is not None
    jobs = [(p, name) for p in range(3) for name in [*ADAPTERS, None]]
    assert run(llm, case, jobs) == [case.reference[job] for job in jobs]
    # The same prompt's blocks were never shared between adapters: each request that could
    # have hit another adapter's blocks computed its own.
    again = llm.generate(case.prompts[:1], PARAMS, lora_request=case.loras["qv"])
    assert again[0].num_cached_tokens == 32  # its own adapter's blocks do hit


def test_one_slot_chunked_preempted_with_a_small_host_cache(case: LoRACase) -> None:
    """One adapter at a time (the scheduler holds the others back), two in host memory
    (the third is read again), 16-token chunks and a cache small enough to preempt."""
    llm = tiny_llm(
        case.base,
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=2,
        max_lora_rank=8,
        max_num_batched_tokens=16,
        num_kv_blocks=8,
        max_model_len=64,
    )
    jobs = [(p, name) for name in [*ADAPTERS, None, "qv"] for p in range(3)]
    assert run(llm, case, jobs) == [case.reference[job] for job in jobs]
    assert llm.core.scheduler.total_preemptions > 0


def test_prefix_cache_keys_carry_the_adapter(case: LoRACase) -> None:
    llm = tiny_llm(case.base, enable_lora=True, max_lora_rank=8)
    base = llm.generate(case.prompts[:1], PARAMS)
    assert base[0].num_cached_tokens == 0
    adapted = llm.generate(case.prompts[:1], PARAMS, lora_request=case.loras["all"])
    assert adapted[0].num_cached_tokens == 0  # not the base model's blocks
    assert adapted[0].outputs[0].token_ids == case.reference[(0, "all")]
    reloaded = LoRARequest("all", 9, case.loras["all"].lora_path)  # loaded again: a new id
    again = llm.generate(case.prompts[:1], PARAMS, lora_request=reloaded)
    assert again[0].num_cached_tokens == 0


def test_an_engine_without_lora_refuses_adapters(case: LoRACase) -> None:
    llm = tiny_llm(case.base)
    with pytest.raises(LoRAError, match="without --enable-lora"):
        llm.generate(case.prompts[:1], PARAMS, lora_request=case.loras["qv"])


def _edit_adapter(src: str, dst: Path, config: dict[str, object]) -> str:
    dst.mkdir()
    for f in Path(src).iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    settings = json.loads((dst / "adapter_config.json").read_text()) | config
    (dst / "adapter_config.json").write_text(json.dumps(settings))
    return str(dst)


def test_bad_adapters_are_refused_by_name(case: LoRACase, tmp_path: Path) -> None:
    llm = tiny_llm(case.base, enable_lora=True, max_lora_rank=4)
    core = llm.core
    with pytest.raises(LoRAError, match="rank 8 exceeds --max-lora-rank 4"):
        core.add_lora(case.loras["all"])
    with pytest.raises(LoRAError, match=r"no adapter_config\.json"):
        core.add_lora(LoRARequest("missing", 5, str(tmp_path / "nowhere")))
    dora = _edit_adapter(case.loras["qv"].lora_path, tmp_path / "dora", {"use_dora": True})
    with pytest.raises(LoRAError, match="use_dora=True is not supported"):
        core.add_lora(LoRARequest("dora", 6, dora))
    extra = {"modules_to_save": ["lm_head"]}
    saved = _edit_adapter(case.loras["qv"].lora_path, tmp_path / "saved", extra)
    with pytest.raises(LoRAError, match="modules_to_save"):
        core.add_lora(LoRARequest("saved", 7, saved))
    embed = _edit_adapter(
        case.loras["qv"].lora_path, tmp_path / "embed", {"target_modules": ["embed_tokens"]}
    )
    with pytest.raises(LoRAError, match="target module 'embed_tokens' is not supported"):
        core.add_lora(LoRARequest("embed", 8, embed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", isa_params())
def test_native_lora_kernel_against_float64(isa: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    slots, max_rank, k, rows = 3, 8, 72, 11
    col_offsets = [0, 24, 40]  # two output slices: columns 0..24 and 24..40
    blocks, n = len(col_offsets) - 1, col_offsets[-1]
    a = torch.randn(slots, blocks * max_rank, k, dtype=dtype)
    bt = torch.zeros(slots, blocks * max_rank, n, dtype=dtype)
    ranks = torch.tensor([8, 3, 5])
    for slot, rank in enumerate(ranks.tolist()):  # past the rank and the slice: zero
        for b in range(blocks):
            rows_b = slice(b * max_rank, b * max_rank + rank)
            cols_b = slice(col_offsets[b], col_offsets[b + 1])
            bt[slot, rows_b, cols_b] = torch.randn(rank, cols_b.stop - cols_b.start).to(dtype)
            a[slot, b * max_rank + rank : (b + 1) * max_rank] = 0
    x = torch.randn(rows, k, dtype=dtype)
    y = torch.randn(rows, n, dtype=dtype)
    bounds, slot_of = [0, 6, 6, 7, 8, 10], [2, 0, 1]  # rows 7 and 10 stay the base's
    expected = y.double()
    for i, slot in enumerate(slot_of):
        s, e = bounds[2 * i], bounds[2 * i + 1]
        expected[s:e] += x[s:e].double() @ a[slot].double().t() @ bt[slot].double()
    torch.ops.pagedserve.lora_apply(y, x, a, bt, ranks, col_offsets, bounds, slot_of, isa)
    tolerance = 1e-5 if dtype == torch.float32 else 0.02
    assert (y.double() - expected).abs().max().item() < tolerance * expected.abs().max().item()
    untouched = torch.tensor([7, 10])
    assert torch.equal(y[untouched].double(), expected[untouched])


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_adapters_add_to_a_quantized_layer(method: str) -> None:
    """A quantized layer's output plus exactly its adapters' products, row by row: the
    adapter does not care how the base weight is stored."""
    from engine.models.layers import Linear
    from engine.models.lora_adapter import LoRAPart
    from engine.models.lora_layers import LoRASlots, LoRAStep
    from engine.models.quantized import quantize_int4, quantize_int8

    torch.manual_seed(1)
    layer = Linear(64, 48)
    quantize = quantize_int8 if method == "int8" else quantize_int4
    layer.quantize(quantize(torch.randn(48, 64)))
    step = LoRAStep()
    slots = LoRASlots(64, (16, 32), 2, 4, step, torch.float32, torch.device("cpu"))
    parts = [
        LoRAPart(0, torch.randn(3, 64), torch.randn(16, 3)),
        LoRAPart(None, torch.randn(4, 64), torch.randn(48, 4)),
    ]
    slots.load(0, parts[:1])
    slots.load(1, parts[1:])
    layer.lora = slots
    x = torch.randn(6, 64)
    base = layer(x)  # no segments this step: the base output alone
    step.set([1, -1, 0], [2, 3, 1])  # rows 0-1: slot 1; 2-4: the base; 5: slot 0
    adapted = layer(x)
    expected = base.clone()
    expected[0:2] += x[0:2] @ parts[1].a.t() @ parts[1].b.t()
    expected[5:6, 0:16] += x[5:6] @ parts[0].a.t() @ parts[0].b.t()
    torch.testing.assert_close(adapted, expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(adapted[2:5], base[2:5])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mixed_adapters_on_a_gpu(case: LoRACase) -> None:
    """On CUDA (torch's segment GEMMs; float32 on the torch attention backend, as
    FlashInfer has no float32 kernels): three adapters and the base model in one step."""
    llm = tiny_llm(
        case.base,
        device="cuda",
        attention_backend="torch",
        enable_lora=True,
        max_loras=3,
        max_lora_rank=8,
    )
    jobs = [(p, name) for p in range(3) for name in [*ADAPTERS, None]]
    assert run(llm, case, jobs) == [case.reference[job] for job in jobs]


def test_host_cache_keeps_what_requests_use(case: LoRACase, tmp_path: Path) -> None:
    """One adapter in host memory: loading another drops it, a request for it reads it
    again when it arrives, and one whose directory is gone is refused then, not mid-step;
    an adapter removed while a request uses it stays until that request ends."""
    import shutil

    llm = tiny_llm(case.base, enable_lora=True, max_lora_rank=8, max_cpu_loras=1)
    manager = llm.core.runner.lora
    llm.core.add_lora(case.loras["qv"])
    llm.core.add_lora(case.loras["all"])
    assert manager.resident() == [case.loras["all"].lora_int_id]
    assert run(llm, case, [(1, "qv")]) == [case.reference[(1, "qv")]]
    moved = LoRARequest("moved", 11, shutil.copytree(case.loras["mlp"].lora_path, tmp_path / "m"))
    llm.core.add_lora(moved)
    llm.core.add_lora(case.loras["qv"])  # drops "moved" from host memory
    shutil.rmtree(moved.lora_path)
    with pytest.raises(LoRAError, match=r"no adapter_config\.json"):
        llm.generate(case.prompts[:1], PARAMS, lora_request=moved)
    assert not llm.core.has_unfinished_requests()


def test_attention_adapters_on_a_mixture_of_experts(tmp_path: Path) -> None:
    """Qwen3-MoE, whose layers (sparse MLPs included) run as the native decoder op: an
    adapter on q/v/o equals PEFT's merged model, beside the base model in one step."""
    base = make_tiny_model("qwen3_moe", tmp_path / "base")
    path = make_lora_adapter(base, tmp_path / "attn", 3, 4, ["q_proj", "v_proj", "o_proj"])
    prompts = make_prompts(8, [9, 23])
    expected = peft_merged_greedy(base, path, prompts, PARAMS.max_tokens)
    expected += hf_greedy(base, prompts, PARAMS.max_tokens)
    llm = tiny_llm(base, enable_lora=True)
    assert llm.core.runner.model.fused_layers is not None
    lora = LoRARequest("attn", 1, str(path))
    outputs = llm.generate(prompts * 2, PARAMS, lora_request=[lora, lora, None, None])
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert expected[:2] != expected[2:]
