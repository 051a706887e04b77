"""The FlashInfer backend on CPU: backend selection, and its contract with FlashInfer.

A recording stand-in for `flashinfer` (tests/fake_flashinfer.py) is injected through the
backend's constructor; it binds every call to FlashInfer's real signatures and checks what
the real kernels require. For steps built by the real Scheduler, InputBatch and metadata
builder, the test checks that plan() receives exactly the metadata the torch backend
consumed, that run() receives the right tensors, and that FlashInfer's documented
semantics applied to those arguments give the torch backend's output.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types

import numpy as np
import pytest
import torch

from engine.attention.backend import allocate_kv_cache
from engine.attention.flashinfer_backend import (
    CudaGraphDecodeAttention,
    FlashInferAttentionBackend,
    flashinfer_available,
    host_page_table,
    select_gpu_backend,
)
from engine.attention.metadata import AttentionMetadata, build_attention_metadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import SchedulerConfig
from engine.kv_cache import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ModelRunnerOutput, Scheduler
from engine.worker.cuda_graphs import pad_decode_batch
from engine.worker.input_batch import InputBatch
from tests.fake_flashinfer import Call, make_fake_flashinfer
from tests.flashinfer_api import FlashInferApi, flashinfer_api, installed_api

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK, NUM_BLOCKS = 4, 2, 64, 2, 16, 48
DTYPE = torch.bfloat16
SCALE = HEAD_DIM**-0.5


@pytest.fixture
def cuda_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_selection_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert flashinfer_available() == (False, "CUDA is not available")
    fallback = select_gpu_backend("auto", "cuda", DTYPE)
    assert fallback.name == "torch"
    assert fallback.reason == "auto: FlashInfer is unavailable: CUDA is not available"
    with pytest.raises(ValueError, match="'flashinfer' is unavailable: CUDA is not available"):
        select_gpu_backend("flashinfer", "cuda", DTYPE)


def test_selection_when_flashinfer_does_not_import(
    cuda_present: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail
    ok, reason = flashinfer_available("cuda", DTYPE)
    assert not ok and "import flashinfer" in reason and ".[gpu]" in reason
    assert select_gpu_backend("auto", "cuda", DTYPE).name == "torch"
    with pytest.raises(ValueError, match="import flashinfer"):
        select_gpu_backend("flashinfer", "cuda", DTYPE)


def test_selection_when_flashinfer_imports(
    cuda_present: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    assert flashinfer_available("cuda", DTYPE) == (True, "")
    assert select_gpu_backend("auto", "cuda", DTYPE).name == "flashinfer"
    assert select_gpu_backend("flashinfer", "cuda:0", torch.float16).name == "flashinfer"
    assert select_gpu_backend("torch", "cuda", DTYPE).name == "torch"
    # FlashInfer has no float32 kernels, and runs only on CUDA devices.
    assert select_gpu_backend("auto", "cuda", torch.float32).name == "torch"
    with pytest.raises(ValueError, match="float16 and bfloat16"):
        select_gpu_backend("flashinfer", "cuda", torch.float32)
    with pytest.raises(ValueError, match="only on CUDA devices"):
        select_gpu_backend("flashinfer", "cpu", DTYPE)


def test_backend_rejects_a_float32_cache() -> None:
    fake, _ = make_fake_flashinfer()
    kv_cache = allocate_kv_cache(LAYERS, 4, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    with pytest.raises(ValueError, match="float16 and bfloat16"):
        FlashInferAttentionBackend(kv_cache, HEADS, SCALE, flashinfer=fake)


def scheduled_steps() -> list[AttentionMetadata]:
    """Metadata of six steps from the real Scheduler: prefills, chunked prefill mixed with
    decodes, decode-only steps, and a prefix-cache hit mixed with decodes."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    sched = Scheduler(config, KVCacheManager(NUM_BLOCKS, BLOCK, enable_caching=True))
    input_batch = InputBatch(eos_token_ids=())
    rng = np.random.default_rng(0)
    prompts = {rid: rng.integers(3, 200, n).tolist() for rid, n in (("a", 20), ("b", 30))}
    prompts["c"] = rng.integers(3, 200, 70).tolist()
    prompts["d"] = [*prompts["c"][:40], 7, 8]  # shares two full blocks with c
    arrivals = {0: "ab", 1: "c", 4: "d"}
    steps = []
    for step in range(6):
        for rid in arrivals.get(step, ""):
            params = SamplingParams(max_tokens=20, ignore_eos=True)
            sched.add_request(Request(rid, prompts[rid], params))
        so = sched.schedule()
        batch = input_batch.update(so)
        steps.append(
            build_attention_metadata(batch.num_computed, batch.num_new, batch.block_ids, BLOCK)
        )
        sampled = [batch.requests[r].request.request_id for r in batch.sample_rows]
        sched.update_from_output(so, ModelRunnerOutput(dict.fromkeys(sampled, 5)))
    return steps


def test_the_steps_cover_every_kind() -> None:
    steps = scheduled_steps()
    assert [md.is_decode_only for md in steps] == [False, False, False, True, False, True]
    assert [md.num_reqs for md in steps] == [2, 3, 3, 3, 4, 4]
    assert steps[4].host.num_computed[-1] == 32  # d: two cached blocks, computed by c
    assert set(steps[1].host.query_lens.tolist()) == {1, 62}  # decodes beside a chunk


def test_host_page_table_equals_the_metadata() -> None:
    for md in scheduled_steps():
        qo, kv, last = host_page_table(md)
        assert torch.equal(qo, md.qo_indptr) and qo.dtype == torch.int32
        assert torch.equal(kv, md.kv_indptr) and kv.dtype == torch.int32
        assert torch.equal(last, md.kv_last_page_len) and last.dtype == torch.int32


def check_plan(call: Call, md: AttentionMetadata) -> None:
    """plan()'s arguments are the torch backend's metadata, FlashInfer's CSR page table."""
    if call.wrapper == "prefill":
        qo, kv, indices, last, *geometry = call.args
        assert torch.equal(qo, md.qo_indptr)
        assert call.kwargs == {
            "causal": True,
            "sm_scale": SCALE,
            "window_left": -1,
            "q_data_type": DTYPE,
            "kv_data_type": DTYPE,
        }
    else:
        kv, indices, last, *geometry = call.args
        assert call.kwargs == {
            "q_data_type": DTYPE,
            "kv_data_type": DTYPE,
            "sm_scale": SCALE,
            "window_left": -1,
        }
    assert torch.equal(kv, md.kv_indptr)
    assert indices is md.kv_indices
    assert torch.equal(last, md.kv_last_page_len)
    assert geometry == [HEADS, KV_HEADS, HEAD_DIM, BLOCK]


def check_runs(calls: list[Call], wrapper: str, kv_cache: torch.Tensor, num_tokens: int) -> None:
    assert [(c.wrapper, c.method) for c in calls] == [(wrapper, "run")] * LAYERS
    for layer, call in enumerate(calls):
        q, (k_cache, v_cache) = call.args
        assert q.shape == (num_tokens, HEADS, HEAD_DIM) and q.dtype == DTYPE
        # The layer's K and V planes of our cache, as FlashInfer's NHD (k_cache, v_cache).
        assert k_cache.data_ptr() == kv_cache[layer, 0].data_ptr()
        assert v_cache.data_ptr() == kv_cache[layer, 1].data_ptr()
        assert k_cache.shape == v_cache.shape == (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)


def assert_bf16_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """A few bf16 ulps: the torch backend rounds its probabilities to bf16 before P @ V."""
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=2e-2)


def new_cache() -> torch.Tensor:
    return allocate_kv_cache(LAYERS, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, DTYPE, "cpu")


def test_flashinfer_contract_matches_the_torch_backend() -> None:
    fake, calls = make_fake_flashinfer()
    fi_cache, torch_cache = new_cache(), new_cache()
    backend = FlashInferAttentionBackend(fi_cache, HEADS, SCALE, flashinfer=fake)
    reference = TorchAttentionBackend(torch_cache, HEADS, SCALE)
    workspace = calls[0].arguments["float_workspace_buffer"]
    assert workspace.dtype == torch.uint8 and workspace.numel() == 128 << 20
    assert [(c.wrapper, c.method, c.arguments["kv_layout"]) for c in calls] == [
        ("prefill", "init", "NHD"),
        ("decode", "init", "NHD"),
    ]
    assert not calls[0].arguments["use_cuda_graph"] and not calls[1].arguments["use_cuda_graph"]
    assert not calls[1].arguments["use_tensor_cores"]  # 2 query heads per KV head
    assert calls[1].arguments["float_workspace_buffer"] is workspace  # one for both wrappers
    torch.manual_seed(0)
    for step, md in enumerate(scheduled_steps()):
        calls.clear()
        backend.plan(md)
        reference.plan(md)
        [plan_call] = calls
        assert plan_call.method == "plan"
        assert plan_call.wrapper == ("decode" if md.is_decode_only else "prefill")
        check_plan(plan_call, md)
        calls.clear()
        max_diff = 0.0
        for layer in range(LAYERS):
            q = torch.randn(md.num_tokens, HEADS, HEAD_DIM, dtype=DTYPE)
            k, v = torch.randn(2, md.num_tokens, KV_HEADS, HEAD_DIM, dtype=DTYPE)
            out = backend.forward(layer, q, k, v)
            expected = reference.forward(layer, q, k, v)
            assert out.shape == (md.num_tokens, HEADS, HEAD_DIM) and out.dtype == DTYPE
            max_diff = max(max_diff, (out.float() - expected.float()).abs().max().item())
            assert_bf16_close(out, expected)
        check_runs(calls, plan_call.wrapper, fi_cache, md.num_tokens)
        print(f"step {step} ({plan_call.wrapper}): max abs diff vs torch {max_diff:.2e}")
        assert torch.equal(fi_cache, torch_cache)  # K/V written to the same slots


def test_graph_decode_attention_pads_into_the_scratch_block() -> None:
    """A padded decode step through the CUDA-graph attention (fake FlashInfer, on CPU):
    the real rows equal the torch backend's, the padding writes only the scratch block."""
    fake, calls = make_fake_flashinfer()
    scratch, size = NUM_BLOCKS - 1, 8
    graph_cache, torch_cache = new_cache(), new_cache()
    graph_cache.normal_()
    torch_cache.copy_(graph_cache)
    indptr, indices = torch.zeros(size + 1, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
    last, slots = torch.zeros(size, dtype=torch.int32), torch.zeros(size, dtype=torch.long)
    workspace = torch.zeros(16, dtype=torch.uint8)
    attention = CudaGraphDecodeAttention(
        graph_cache, HEADS, SCALE, (indptr, indices, last, slots), workspace, flashinfer=fake
    )
    init = calls[0].arguments
    assert init["use_cuda_graph"] and not init["use_tensor_cores"]
    assert init["float_workspace_buffer"] is workspace and init["kv_layout"] == "NHD"
    assert init["paged_kv_indptr_buffer"] is indptr and init["paged_kv_indices_buffer"] is indices
    assert init["paged_kv_last_page_len_buffer"] is last
    computed, tables = [20, 33, 5], [[3, 9], [4, 0, 7], [11]]
    md = build_attention_metadata(computed, [1, 1, 1], tables, BLOCK)
    padded = build_attention_metadata(*pad_decode_batch(computed, tables, size, scratch), BLOCK)
    attention.plan(padded)
    assert torch.equal(slots, padded.slot_mapping)  # the graph's persistent slot mapping
    reference = TorchAttentionBackend(torch_cache, HEADS, SCALE)
    reference.plan(md)
    q = torch.randn(size, HEADS, HEAD_DIM, dtype=DTYPE)
    k, v = torch.randn(2, size, KV_HEADS, HEAD_DIM, dtype=DTYPE)
    out = attention.forward(0, q, k, v)
    expected = reference.forward(0, q[:3], k[:3], v[:3])
    max_diff = (out[:3].float() - expected.float()).abs().max().item()
    print(f"padded graph decode: max abs diff vs torch {max_diff:.2e}")
    assert_bf16_close(out[:3], expected)
    assert torch.equal(graph_cache[:, :, :scratch], torch_cache[:, :, :scratch])
    assert not torch.equal(graph_cache[0, :, scratch], torch_cache[0, :, scratch])
    with pytest.raises(ValueError, match="graph of batch size 8"):
        attention.plan(md)


def run_every_kind_of_call(fake: types.ModuleType, kv_heads: int = KV_HEADS) -> None:
    """The eager backend through the scheduled steps (prefill and decode wrappers), and a
    CUDA-graph decode step: every FlashInfer call the backend makes."""
    cache = allocate_kv_cache(LAYERS, NUM_BLOCKS, BLOCK, kv_heads, HEAD_DIM, DTYPE, "cpu")
    backend = FlashInferAttentionBackend(cache, HEADS, SCALE, flashinfer=fake)
    for md in scheduled_steps():
        backend.plan(md)
        q = torch.randn(md.num_tokens, HEADS, HEAD_DIM, dtype=DTYPE)
        k, v = torch.randn(2, md.num_tokens, kv_heads, HEAD_DIM, dtype=DTYPE)
        backend.forward(0, q, k, v)
    size, int32 = 4, torch.int32
    buffers = (torch.zeros(size + 1, dtype=int32), torch.zeros(64, dtype=int32),
               torch.zeros(size, dtype=int32), torch.zeros(size, dtype=torch.long))  # fmt: skip
    graph = CudaGraphDecodeAttention(cache, HEADS, SCALE, buffers, backend.workspace, fake)
    padded = pad_decode_batch([20, 33], [[3, 9], [4, 0, 7]], size, NUM_BLOCKS - 1)
    graph.plan(build_attention_metadata(*padded, BLOCK))
    q = torch.randn(size, HEADS, HEAD_DIM, dtype=DTYPE)
    k, v = torch.randn(2, size, kv_heads, HEAD_DIM, dtype=DTYPE)
    graph.forward(0, q, k, v)


def test_every_call_binds_to_flashinfers_real_signatures() -> None:
    """Against the installed flashinfer where it imports, else the recorded release."""
    api = flashinfer_api()
    print(f"FlashInfer signatures: {api.source}")
    assert api.source.startswith("installed") == (installed_api() is not None)
    for method, signature in api.signatures.items():  # else any keyword would bind
        kinds = [p.kind for p in signature.parameters.values()]
        assert inspect.Parameter.VAR_KEYWORD not in kinds, method
    fake, calls = make_fake_flashinfer(api)
    run_every_kind_of_call(fake)
    assert {(c.wrapper, c.method) for c in calls} == {
        (wrapper, method) for wrapper in ("prefill", "decode") for method in ("init", "plan", "run")
    }
    classes = {"prefill": "BatchPrefillWithPagedKVCacheWrapper",
               "decode": "BatchDecodeWithPagedKVCacheWrapper"}  # fmt: skip
    for call in calls:
        method = "__init__" if call.method == "init" else call.method
        api.bind(f"{classes[call.wrapper]}.{method}", object(), *call.args, **call.kwargs)


def test_a_drifted_signature_fails_the_binding() -> None:
    """A keyword FlashInfer renamed (here: use_tensor_cores dropped from decode __init__)
    makes the backend's call raise, as it would against that FlashInfer."""
    api = flashinfer_api()
    init = api.signatures["BatchDecodeWithPagedKVCacheWrapper.__init__"]
    kept = [p for p in init.parameters.values() if p.name != "use_tensor_cores"]
    drifted = FlashInferApi("drifted", api.signatures | {
        "BatchDecodeWithPagedKVCacheWrapper.__init__": init.replace(parameters=kept)
    })  # fmt: skip
    fake, _ = make_fake_flashinfer(drifted)
    with pytest.raises(TypeError, match="use_tensor_cores"):
        FlashInferAttentionBackend(new_cache(), HEADS, SCALE, flashinfer=fake)


def test_int64_page_tables_are_refused() -> None:
    fake, _ = make_fake_flashinfer()
    backend = FlashInferAttentionBackend(new_cache(), HEADS, SCALE, flashinfer=fake)
    md = scheduled_steps()[0]
    wide = dataclasses.replace(md, kv_indices=md.kv_indices.long())
    with pytest.raises(
        AssertionError, match=r"kv_indices: FlashInfer takes int32, not torch\.int64"
    ):
        backend.plan(wide)
    buffers = (torch.zeros(5, dtype=torch.int64), torch.zeros(64, dtype=torch.int32),
               torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.long))  # fmt: skip
    with pytest.raises(AssertionError, match="indptr_buffer: FlashInfer takes int32"):
        CudaGraphDecodeAttention(new_cache(), HEADS, SCALE, buffers, backend.workspace, fake)


def test_head_sizes_and_decode_ratios_flashinfer_lacks_are_refused() -> None:
    fake, _ = make_fake_flashinfer()
    small = allocate_kv_cache(LAYERS, NUM_BLOCKS, BLOCK, KV_HEADS, 16, DTYPE, "cpu")
    with pytest.raises(AssertionError, match="no FlashInfer kernels for head_dim 16"):
        FlashInferAttentionBackend(small, HEADS, 0.25, flashinfer=fake).plan(scheduled_steps()[0])
    # 6 query heads per KV head: CUDA-core decode has no such kernel, tensor cores do.
    decode = fake.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(16, dtype=torch.uint8))
    md = scheduled_steps()[3]
    _, kv_indptr, last = host_page_table(md)
    with pytest.raises(AssertionError, match="CUDA-core decode has no group size 6"):
        decode.plan(kv_indptr, md.kv_indices, last, 12, 2, HEAD_DIM, BLOCK, q_data_type=DTYPE)
    fake, calls = make_fake_flashinfer()
    cache = allocate_kv_cache(LAYERS, NUM_BLOCKS, BLOCK, 2, HEAD_DIM, DTYPE, "cpu")
    backend = FlashInferAttentionBackend(cache, 12, SCALE, flashinfer=fake)
    assert calls[1].arguments["use_tensor_cores"]
    backend.plan(md)
    q = torch.randn(md.num_tokens, 12, HEAD_DIM, dtype=DTYPE)
    k, v = torch.randn(2, md.num_tokens, 2, HEAD_DIM, dtype=DTYPE)
    assert backend.forward(0, q, k, v).shape == q.shape


def test_the_cache_dtype_must_be_the_planned_kv_data_type() -> None:
    fake, _ = make_fake_flashinfer()
    md = scheduled_steps()[0]
    wrapper = fake.BatchPrefillWithPagedKVCacheWrapper(torch.zeros(16, dtype=torch.uint8))
    qo, kv, last = host_page_table(md)
    wrapper.plan(qo, kv, md.kv_indices, last, HEADS, KV_HEADS, HEAD_DIM, BLOCK, causal=True,
                 q_data_type=DTYPE, kv_data_type=torch.float16)  # fmt: skip
    cache = new_cache()
    q = torch.randn(md.num_tokens, HEADS, HEAD_DIM, dtype=DTYPE)
    with pytest.raises(AssertionError, match="bfloat16"):
        wrapper.run(q, (cache[0, 0], cache[0, 1]))


def test_the_workspace_is_zeroed(monkeypatch: pytest.MonkeyPatch) -> None:
    """FlashInfer requires a zeroed workspace; torch.empty gives whatever memory held, so
    here it gives garbage on purpose."""
    fake, _ = make_fake_flashinfer()
    real_empty = torch.empty

    def garbage(*args: object, **kwargs: object) -> torch.Tensor:
        return real_empty(*args, **kwargs).fill_(0xAB)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "empty", garbage)
    backend = FlashInferAttentionBackend(new_cache(), HEADS, SCALE, flashinfer=fake)
    assert not bool(backend.workspace.any())
    with pytest.raises(AssertionError, match="initialised to 0"):
        FlashInferAttentionBackend(
            new_cache(), HEADS, SCALE, fake, torch.empty(16, dtype=torch.uint8)
        )
