"""FlashInfer on a real GPU: kernels against the torch backend, greedy decoding against
transformers, CUDA-graph decode against eager decode (on CUDA cores and, above 4 query
heads per KV head, on tensor cores), and every sampling feature on CUDA logits.

Skipped without CUDA. With CUDA, FlashInfer must import: if it does not, every test here
fails (a GPU machine that silently skips its GPU tests checks nothing).

FlashInfer has no float32 kernels, so the engine runs float16 here (10 mantissa bits
against bfloat16's 7, for the tightest comparison FlashInfer allows) while transformers,
the reference, runs float32. Greedy outputs may then part only where the reference's two
best logits are within rounding noise; `assert_greedy_matches` allows exactly that.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, EngineHooks, SamplingParams
from engine.attention.backend import allocate_kv_cache
from engine.attention.flashinfer_backend import FlashInferAttentionBackend, flashinfer_available
from engine.attention.metadata import build_attention_metadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.utils import cdiv
from engine.worker.cuda_graphs import pad_decode_batch
from engine.worker.sampler import Sampler, SamplingRow
from tests.engine.attention.test_torch_backend import dense_reference
from tests.engine.test_correctness import LENGTHS, make_prompts
from tests.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module", autouse=True)
def _flashinfer_runs() -> None:
    available, reason = flashinfer_available()
    assert available, f"CUDA is present but FlashInfer cannot run: {reason}"


CASES = {
    "prefill": [(0, 9), (0, 70), (0, 1)],
    "decode": [(12, 1), (3, 1), (400, 1), (0, 1)],
    "mixed": [(20, 1), (0, 13), (7, 60), (333, 1), (16, 16)],
}
# (heads, kv_heads, head_dim): MHA, GQA 4 and GQA 6 (decode on tensor cores above 4).
SHAPES = [(8, 8, 64), (32, 8, 128), (12, 2, 64)]
# Logit gap below which float16 against float32 may legitimately pick another token.
NEAR_TIE = 0.05


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
def test_flashinfer_matches_torch_backend(
    block_size: int, case: str, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    dtype, device, layer, scale = torch.bfloat16, "cuda", 1, head_dim**-0.5
    caches = [
        allocate_kv_cache(2, 128, block_size, num_kv_heads, head_dim, dtype, device)
        for _ in range(2)
    ]
    flashinfer = FlashInferAttentionBackend(caches[0], num_heads, scale)
    reference = TorchAttentionBackend(caches[1], num_heads, scale)
    requests = CASES[case]
    free_blocks = list(rng.permutation(128))
    tables = [[int(free_blocks.pop()) for _ in range(cdiv(c + n, block_size))] for c, n in requests]
    histories = [torch.randn(c + n, 2, num_kv_heads, head_dim, dtype=dtype) for c, n in requests]
    for cache in caches:  # the already-computed history, as earlier steps would have written
        flat = cache[layer].view(2, -1, num_kv_heads, head_dim)
        for (computed, _), table, hist in zip(requests, tables, histories, strict=True):
            slots = [table[p // block_size] * block_size + p % block_size for p in range(computed)]
            flat[:, slots] = hist[:computed].transpose(0, 1).to(device)
    md = build_attention_metadata(
        [c for c, _ in requests], [n for _, n in requests], tables, block_size, device
    )
    q = torch.randn(md.num_tokens, num_heads, head_dim, dtype=dtype)
    k = torch.cat([h[c:, 0] for (c, _), h in zip(requests, histories, strict=True)])
    v = torch.cat([h[c:, 1] for (c, _), h in zip(requests, histories, strict=True)])
    outs = []
    for backend in (flashinfer, reference):
        backend.plan(md)
        outs.append(backend.forward(layer, q.to(device), k.to(device), v.to(device)).cpu())
    exact = torch.cat(
        [
            dense_reference(q[s : s + n], h[:, 0], h[:, 1], c, scale)
            for s, (c, n), h in zip(md.qo_indptr[:-1].tolist(), requests, histories, strict=True)
        ]
    )
    fi_err = (outs[0].double() - exact).abs().max().item()
    torch_err = (outs[1].double() - exact).abs().max().item()
    between = (outs[0].float() - outs[1].float()).abs().max().item()
    print(
        f"{case} block_size={block_size} heads={num_heads}/{num_kv_heads} d={head_dim}: "
        f"flashinfer vs float64 {fi_err:.2e}, torch vs float64 {torch_err:.2e}, "
        f"flashinfer vs torch {between:.2e}"
    )
    assert torch.equal(caches[0], caches[1])  # both wrote the step's K/V to the same slots
    assert fi_err < 2e-2 and between < 3e-2  # bf16 output: a few ulps of values up to ~4


def make_gpu_model(kind: str, path: Path, heads: int = 4, kv_heads: int = 2) -> Path:
    """tests/tiny_models' model with head_dim 64, a size FlashInfer has kernels for."""
    return make_tiny_model(
        kind,
        path,
        hidden_size=64 * heads,
        intermediate_size=128 * heads,
        head_dim=64,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )


def hf_greedy_with_margins(
    model_dir: Path, prompts: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy tokens in float32 on the GPU, and at each generated position the
    gap between the reference's two best logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    tokens, margins = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(
            ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        with torch.inference_mode():
            logits = model(out).logits[0, len(prompt) - 1 : -1].float()  # (max_tokens, vocab)
        top2 = logits.topk(2, dim=-1).values
        tokens.append(out[0, len(prompt) :].tolist())
        margins.append((top2[:, 0] - top2[:, 1]).tolist())
    return tokens, margins


def assert_greedy_matches(
    ours: list[list[int]], reference: list[list[int]], margins: list[list[float]]
) -> None:
    exact = 0
    for i, (a, b, gaps) in enumerate(zip(ours, reference, margins, strict=True)):
        split = next((t for t, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if split is None:
            exact += 1
            continue
        assert gaps[split] < NEAR_TIE, (
            f"prompt {i} parts from transformers at token {split}, where its top-2 logit gap "
            f"is {gaps[split]:.3f} (not a near tie): ours {a}, transformers {b}"
        )
    print(f"{exact}/{len(ours)} prompts equal to transformers token for token")
    assert exact >= len(ours) // 2


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def gpu_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = make_gpu_model(request.param, tmp_path_factory.mktemp(request.param))
    prompts = make_prompts(1, LENGTHS)
    return path, prompts, hf_greedy_with_margins(path, prompts, 12)


def gpu_llm(path: Path, **kwargs: object) -> LLM:
    options: dict[str, object] = dict(
        device="cuda",
        dtype="float16",
        attention_backend="flashinfer",
        block_size=16,
        num_kv_blocks=256,
        max_model_len=256,
    )
    options.update(kwargs)
    return LLM(str(path), hooks=EngineHooks(check_invariants=True), **options)


@pytest.mark.parametrize(
    "mode",
    [
        "cuda-graphs",
        "eager",
        "chunked-prefill",
        "preempted",
        "synchronous",
        "ngram",
        "draft-model",
    ],
)
def test_greedy_matches_transformers(gpu_model, mode: str) -> None:
    """Async scheduling is on by default on CUDA; "synchronous" and speculative decoding
    (n-gram drafts, the model as its own draft model) turn it off."""
    path, prompts, (reference, margins) = gpu_model
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    draft = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    kwargs: dict[str, object] = {
        "cuda-graphs": {},
        "eager": {"enforce_eager": True},
        "chunked-prefill": {"max_num_batched_tokens": 16},
        "preempted": {"num_kv_blocks": 10, "max_model_len": 160},
        "synchronous": {"async_scheduling": False},
        "ngram": {"speculative_config": json.dumps(ngram)},
        "draft-model": {"speculative_config": json.dumps(draft)},
    }[mode]
    llm = gpu_llm(path, **kwargs)
    assert llm.config.device.attention_backend == "flashinfer"
    assert bool(llm.config.device.cuda_graph_sizes) == (mode != "eager")
    assert llm.core.async_scheduling == (
        mode in ("cuda-graphs", "eager", "chunked-prefill", "preempted")
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert_greedy_matches(ours, reference, margins)
    if mode == "preempted":
        assert llm.core.scheduler.total_preemptions > 0


def test_async_scheduling_keeps_stops_logprobs_and_seeds(gpu_model) -> None:
    """With async scheduling on CUDA: a request that stops on a token ends on its first
    occurrence (the row the next step ran for it is dropped), length-limited requests with
    logprobs get one entry a token, greedy tokens are transformers' up to near ties, and
    a second run gives the same outputs, seeded samples included."""
    path, prompts, (reference, margins) = gpu_model
    stop = reference[0][2]
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop]),
        SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=10, ignore_eos=True),
    ] * 2
    llm = gpu_llm(path)
    assert llm.core.async_scheduling

    def run() -> list[tuple[list[int], str | None, list[float]]]:
        outputs = llm.generate(prompts[: len(params)], params)
        return [
            (c.token_ids, c.finish_reason, [lp.logprob for lp in c.logprobs or []])
            for c in (o.outputs[0] for o in outputs)
        ]

    first, second = run(), run()
    assert [(t, r) for t, r, _ in first] == [(t, r) for t, r, _ in second]
    for (tokens, reason, logprobs), param, ref, gaps in zip(
        first, params, reference, margins, strict=False
    ):
        if param.stop_token_ids and reason == "stop":
            assert tokens.index(stop) == len(tokens) - 1
        if param.temperature == 0.0:
            n = len(tokens)
            assert_greedy_matches([tokens], [ref[:n]], [gaps[:n]])
        if param.logprobs:
            assert reason == "length" and len(tokens) == len(logprobs) == 3
    assert first[0][1] == "stop" or stop not in first[0][0]


def test_mixture_of_experts_matches_transformers(tmp_path: Path) -> None:
    """A Qwen3-MoE on CUDA (its experts run eagerly, so no CUDA graphs): greedy tokens as
    transformers' in float32, up to near ties."""
    path = make_gpu_model("qwen3_moe", tmp_path)
    prompts = make_prompts(1, LENGTHS)
    reference, margins = hf_greedy_with_margins(path, prompts, 12)
    llm = gpu_llm(path)
    assert not llm.config.device.cuda_graph_sizes
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert_greedy_matches(ours, reference, margins)


def test_tensor_core_decode_with_cuda_graphs_matches_transformers(tmp_path: Path) -> None:
    """6 query heads per KV head: decode runs on tensor cores (CUDA-core decode has no
    kernel for that ratio), captured in CUDA graphs; greedy tokens against transformers."""
    path = make_gpu_model("llama", tmp_path, heads=12, kv_heads=2)
    prompts = make_prompts(1, LENGTHS)
    reference, margins = hf_greedy_with_margins(path, prompts, 12)
    llm = gpu_llm(path)
    runner = llm.core.runner
    assert runner.graphs is not None and runner.backend.tensor_cores
    assert all(graph.attention.tensor_cores for graph in runner.graphs._graphs.values())
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert_greedy_matches(ours, reference, margins)


@pytest.mark.parametrize(
    ("heads", "kv_heads"), [(4, 2), (12, 2)], ids=["cuda-cores", "tensor-cores"]
)
def test_cuda_graph_decode_matches_eager(tmp_path: Path, heads: int, kv_heads: int) -> None:
    """One decode step through each captured graph size (padded) and through the eager
    FlashInfer path, on the same random KV history: same hidden states, and the padding
    writes only the scratch block."""
    num_blocks = 512
    path = make_gpu_model("llama", tmp_path, heads, kv_heads)
    llm = gpu_llm(path, num_kv_blocks=num_blocks, max_num_seqs=16)
    runner = llm.core.runner
    assert runner.graphs is not None and runner.graphs.sizes == (1, 2, 4, 8, 16)
    assert runner.backend.tensor_cores == (heads // kv_heads > 4)
    assert runner.kv_cache.shape[2] == num_blocks + 1  # the scratch block
    torch.manual_seed(0)
    runner.kv_cache.normal_()  # stands in for the K/V of earlier steps
    rng = np.random.default_rng(0)
    for n in (1, 3, 8, 13):
        computed = rng.integers(0, 120, n).tolist()
        blocks = iter(rng.permutation(num_blocks).tolist())
        tables = [[next(blocks) for _ in range(cdiv(c + 1, 16))] for c in computed]
        ids = torch.from_numpy(rng.integers(3, 256, n)).cuda()
        untouched = sorted(set(range(num_blocks)) - {b for t in tables for b in t})
        before = runner.kv_cache[:, :, untouched].clone()
        with torch.inference_mode():
            size = runner.graphs.graph_size([1] * n)
            assert size is not None and size >= n
            padded = pad_decode_batch(computed, tables, size, runner.graphs.scratch_block)
            padded_md = build_attention_metadata(*padded, 16, "cuda")
            padded_ids = torch.nn.functional.pad(ids, (0, size - n))
            graph_hidden = runner.graphs.run(padded_md, padded_ids, n).clone()
            assert torch.equal(runner.kv_cache[:, :, untouched], before)
            md = build_attention_metadata(computed, [1] * n, tables, 16, "cuda")
            runner.backend.plan(md)
            eager_hidden = runner.model(ids, md.positions, runner.backend)
        max_diff = (graph_hidden.float() - eager_hidden.float()).abs().max().item()
        print(f"decode batch {n} (graph {runner.graphs.sizes}): max abs diff {max_diff:.2e}")
        torch.testing.assert_close(graph_hidden, eager_hidden, atol=1e-2, rtol=1e-2)


def test_kv_cache_fills_the_gpu_memory_utilization(tmp_path: Path) -> None:
    """No --num-kv-blocks: the profiled budget decides. The device ends up about
    utilization * total in use, most of it KV cache. (A huge max_num_seqs lifts the cap of
    max_num_seqs full-length requests; eager, so nothing is captured; 256-token blocks keep
    the block pool to some 10^5 blocks.)"""
    utilization, gib = 0.2, 1 << 30
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info()
    llm = gpu_llm(
        make_gpu_model("llama", tmp_path),
        num_kv_blocks=None,
        gpu_memory_utilization=utilization,
        block_size=256,
        max_num_seqs=1_000_000,
        enforce_eager=True,
    )
    kv_cache = llm.core.runner.kv_cache
    kv_bytes = kv_cache.numel() * kv_cache.element_size()
    used = total - torch.cuda.mem_get_info()[0]
    share = utilization * total
    print(
        f"{llm.config.cache.num_blocks} blocks, {kv_bytes / gib:.2f} GiB of KV cache; device "
        f"{used / gib:.2f} GiB in use of {total / gib:.2f} GiB (share {share / gib:.2f})"
    )
    assert kv_cache.shape[2] == llm.config.cache.num_blocks  # no scratch block when eager
    assert used <= share + gib / 2
    assert kv_bytes >= share - (total - free_before) - 2 * gib


# --- Sampling on CUDA logits -----------------------------------------------------------------

VOCAB = 1000


def sampling_rows(params: list[SamplingParams], rng: np.random.Generator) -> list[SamplingRow]:
    """Rows with prompts and outputs drawn from the vocabulary, so penalties have work."""
    return [
        SamplingRow(
            p, rng.integers(0, VOCAB, 12).tolist(), rng.integers(0, VOCAB, 7).tolist(), (2,)
        )
        for p in params
    ]


def test_deterministic_sampling_features_match_the_cpu() -> None:
    """Greedy with logit bias, penalties and min_tokens, with logprobs: on CUDA logits the
    same tokens, ranks and top ids as on the CPU, logprobs within float32 noise."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.0, logit_bias={7: 30.0, 9: -100.0}, logprobs=0),
        SamplingParams(temperature=0.0, repetition_penalty=1.7, logprobs=3),
        SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.8),
        # min_tokens masks the stop id 2; max_tokens (16 by default) must leave room for it.
        SamplingParams(temperature=0.0, min_tokens=20, max_tokens=32, logprobs=2),
    ]
    rows = sampling_rows(params, rng)
    logits = torch.randn(len(rows), VOCAB) * 3
    logits[4, 2] = 50.0  # the stop token would win but for min_tokens
    cpu = Sampler(VOCAB)(logits, rows)
    gpu = Sampler(VOCAB)(logits.cuda(), rows)
    print(f"tokens: cpu {cpu.token_ids}, cuda {gpu.token_ids}")
    assert gpu.token_ids == cpu.token_ids
    assert gpu.token_ids[1] == 7 and gpu.token_ids[4] != 2
    for ours, theirs in zip(gpu.logprobs, cpu.logprobs, strict=True):
        assert (ours is None) == (theirs is None)
        if ours is None or theirs is None:
            continue
        assert (ours.token_id, ours.rank) == (theirs.token_id, theirs.rank)
        assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]
        assert abs(ours.logprob - theirs.logprob) < 1e-4
        assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(ours.top, theirs.top, strict=True))


def cuda_frequencies(logits: list[float], params: SamplingParams, n: int = 40000) -> torch.Tensor:
    torch.manual_seed(0)
    batch = torch.tensor([logits] * n, device="cuda")
    rows = [SamplingRow(params, [0], [], ())] * n
    tokens = Sampler(len(logits))(batch, rows).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=len(logits)).double() / n


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        (SamplingParams(temperature=0.5), [0, 1, 2, 3, 4]),
        (SamplingParams(temperature=1.0, top_p=0.7), [0, 1]),
        (SamplingParams(temperature=1.0, top_k=3), [0, 1, 2]),
        (SamplingParams(temperature=1.0, min_p=0.2), [0, 1, 2]),
    ],
    ids=["temperature", "top_p", "top_k", "min_p"],
)
def test_random_sampling_on_cuda_draws_from_the_filtered_softmax(
    params: SamplingParams, kept: list[int]
) -> None:
    logits = [2.0, 1.0, 0.5, 0.0, -1.0]
    scaled = torch.tensor(logits, dtype=torch.float64) / params.temperature
    expected = torch.zeros(len(logits), dtype=torch.float64)
    expected[kept] = scaled[kept].softmax(-1)
    observed = cuda_frequencies(logits, params)
    diff = (observed - expected).abs().max().item()
    print(f"observed {observed.tolist()} expected {expected.tolist()} max diff {diff:.4f}")
    assert diff < 0.012


def test_seeded_sampling_does_not_depend_on_the_device() -> None:
    """A seeded request's noise is drawn on the CPU, so CUDA logits give the CPU's tokens."""
    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, top_k=50, min_p=0.01, seed=1000 + i)
        for i in range(32)
    ]
    rows = sampling_rows(params, rng)
    logits = torch.randn(len(rows), VOCAB) * 2
    cpu = Sampler(VOCAB)(logits, rows).token_ids
    gpu = Sampler(VOCAB)(logits.cuda(), rows).token_ids
    again = Sampler(VOCAB)(logits.cuda(), rows).token_ids
    assert gpu == again == cpu
    assert len(set(gpu)) > 1  # the seeds differ, so do the draws
