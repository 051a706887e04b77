"""The native CPU paged-attention kernel against dense attention and the torch backend, in
every instruction set this CPU runs (the op's `isa` argument)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.attention import create_backend, resolve_backend
from engine.attention.backend import allocate_kv_cache
from engine.attention.metadata import AttentionMetadata, build_attention_metadata
from engine.attention.native_backend import NativeCpuAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.ops.loader import NativeKernels, native_kernels
from tests.engine.attention.test_torch_backend import CASES, dense_reference
from tests.isas import CPU_LACKS, isa_params
from tests.threads import torch_threads

# (computed, new) per request; "chunked" continues prompts that already have history.
NATIVE_CASES = CASES | {
    "chunked": [(37, 25), (64, 64), (5, 50), (0, 100)],
    "long": [(0, 300), (250, 1), (120, 1)],
}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
LAYER = 1
# Keys per online-softmax step (kChunk in engine/ops/csrc/kernels.h): shared prefixes and
# windowed walks start on whole chunks.
KEY_CHUNK = 32
# Every instruction set this build holds and this CPU runs (no skip: an empty list fails).
# Kernel tests run over every set built (isa_params), those this CPU lacks skipped.
ISAS = list(native_kernels().supported)


@pytest.fixture(autouse=True)
def _two_threads_at_least() -> Iterator[None]:
    """The kernels plan their work items by thread count and run them in parallel: at least
    two threads, also in a test worker pinned to one CPU (tests/conftest.py)."""
    with torch_threads(max(2, torch.get_num_threads())):
        yield


@dataclass
class PagedCase:
    requests: list[tuple[int, int]]
    kv_cache: torch.Tensor  # (layers, 2, blocks, block_size, kv_heads, head_dim)
    metadata: AttentionMetadata
    q: torch.Tensor  # (num_tokens, heads, head_dim)
    k: torch.Tensor  # (num_tokens, kv_heads, head_dim): this step's keys
    v: torch.Tensor
    histories: list[torch.Tensor]  # per request (computed + new, 2, kv_heads, head_dim)


def make_case(
    requests: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    shared_prefix: int = 0,
    share_pages: bool = True,
) -> PagedCase:
    """Random unit-variance K/V history already in the cache on scattered blocks.

    The first `shared_prefix` keys of every request are the same; with `share_pages`, their
    full pages are the first request's blocks, as the prefix cache lays them out, and
    without, each request has its own copy.
    """
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    pages = [-(-(c + n) // block_size) for c, n in requests]
    num_blocks = sum(pages) + 3
    kv_cache = allocate_kv_cache(2, num_blocks, block_size, num_kv_heads, head_dim, dtype, "cpu")
    free_blocks = [int(b) for b in rng.permutation(num_blocks)]
    tables = [[free_blocks.pop() for _ in range(p)] for p in pages]
    histories = [
        torch.randn(c + n, 2, num_kv_heads, head_dim, generator=gen).to(dtype) for c, n in requests
    ]
    for table, hist in zip(tables[1:], histories[1:], strict=True):
        hist[:shared_prefix] = histories[0][:shared_prefix]
        if share_pages:
            table[: shared_prefix // block_size] = tables[0][: shared_prefix // block_size]
    flat = kv_cache[LAYER].view(2, -1, num_kv_heads, head_dim)
    for (computed, _), table, hist in zip(requests, tables, histories, strict=True):
        pos = torch.arange(computed)
        slots = torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size
        flat[:, slots + pos % block_size] = hist[:computed].transpose(0, 1)
    md = build_attention_metadata(
        [c for c, _ in requests], [n for _, n in requests], tables, block_size
    )
    q = torch.randn(md.num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.cat([h[c:, 0] for (c, _), h in zip(requests, histories, strict=True)])
    v = torch.cat([h[c:, 1] for (c, _), h in zip(requests, histories, strict=True)])
    return PagedCase(requests, kv_cache, md, q, k, v, histories)


def max_diff_to_dense(case: PagedCase, out: torch.Tensor) -> float:
    scale = case.q.shape[-1] ** -0.5
    max_diff, start = 0.0, 0
    for (computed, new), hist in zip(case.requests, case.histories, strict=True):
        ref = dense_reference(case.q[start : start + new], hist[:, 0], hist[:, 1], computed, scale)
        diff = (out[start : start + new].double() - ref).abs().max().item()
        max_diff, start = max(max_diff, diff), start + new
    return max_diff


def run_native(case: PagedCase, isa: str | None = None) -> torch.Tensor:
    """The backend's step: writes this step's K/V, then attends with the CPU's best kernels.
    With `isa`, the attention is then run again with that instruction set's kernels."""
    scale = case.q.shape[-1] ** -0.5
    backend = NativeCpuAttentionBackend(case.kv_cache, case.q.shape[1], scale)
    backend.plan(case.metadata)
    out = backend.forward(LAYER, case.q, case.k, case.v)
    if isa is None:
        return out
    md, (k_cache, v_cache) = case.metadata, case.kv_cache[LAYER]
    out = torch.empty_like(case.q)
    torch.ops.pagedserve.paged_attention(
        out, case.q, k_cache, v_cache, md.qo_indptr, md.kv_indptr, md.kv_indices,
        md.kv_last_page_len, scale, isa,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("case", sorted(NATIVE_CASES))
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (8, 2), (4, 4)])
def test_native_matches_dense_attention(
    dtype: torch.dtype, block_size: int, case: str, num_heads: int, num_kv_heads: int, isa: str
) -> None:
    pc = make_case(NATIVE_CASES[case], num_heads, num_kv_heads, 64, block_size, dtype)
    out = run_native(pc, isa)
    max_diff = max_diff_to_dense(pc, out)
    print(f"{isa} {case} {dtype} bs={block_size} heads={num_heads}/{num_kv_heads}: {max_diff:.2e}")
    assert out.dtype == dtype
    assert max_diff < TOLERANCE[dtype]


# 48 has no AVX-512 instantiation: the AVX-512 sets run their portable kernel for it.
@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [16, 32, 48, 80, 96, 128, 256])
def test_native_head_sizes_and_dtypes(dtype: torch.dtype, head_dim: int, isa: str) -> None:
    pc = make_case(NATIVE_CASES["chunked"] + CASES["mixed"], 6, 2, head_dim, 16, dtype, seed=1)
    max_diff = max_diff_to_dense(pc, run_native(pc, isa))
    print(f"{isa} head_dim={head_dim} {dtype}: {max_diff:.2e}")
    assert max_diff < TOLERANCE[dtype]


# Enough decodes that every thread gets several items: the kernels then take each
# decode's KV heads in one work item, reading a key's heads side by side (on up to 16
# threads), with a prefill beside them.
MANY_DECODES = [(int(c), 1) for c in np.random.default_rng(5).integers(1, 300, size=64)]


def run_alone(case: PagedCase, r: int, isa: str) -> torch.Tensor:
    """Request r's attention output, with the request alone in the batch (the same pages)."""
    md, (k_cache, v_cache) = case.metadata, case.kv_cache[LAYER]
    q0, q1 = md.qo_indptr[r].item(), md.qo_indptr[r + 1].item()
    p0, p1 = md.kv_indptr[r].item(), md.kv_indptr[r + 1].item()
    q = case.q[q0:q1]
    out = torch.empty_like(q)
    torch.ops.pagedserve.paged_attention(
        out, q, k_cache, v_cache, torch.tensor([0, q1 - q0], dtype=torch.int32),
        torch.tensor([0, p1 - p0], dtype=torch.int32), md.kv_indices[p0:p1].contiguous(),
        md.kv_last_page_len[r : r + 1].contiguous(), q.shape[-1] ** -0.5, isa,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 8, 32), (8, 4, 128)])
def test_a_decode_in_a_large_batch_matches_it_alone(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, isa: str
) -> None:
    pc = make_case([*MANY_DECODES, (30, 70)], heads, kv_heads, head_dim, 16, dtype, seed=4)
    out = run_native(pc, isa)
    max_diff = max_diff_to_dense(pc, out)
    print(f"{isa} {heads}/{kv_heads}x{head_dim} {dtype}: {max_diff:.2e} from dense")
    assert max_diff < TOLERANCE[dtype]
    for r in (0, 17, 63, 64):  # decodes, and the prefill
        q0, q1 = pc.metadata.qo_indptr[r].item(), pc.metadata.qo_indptr[r + 1].item()
        assert torch.equal(out[q0:q1], run_alone(pc, r, isa)), f"request {r}"


# Decodes long enough that their keys are split into parts (from 512 keys, parts of about
# 128, at most 8, each over all the KV heads an item takes) and merged, beside short decodes
# (one just under the threshold) and a prefill chunk.
LONG_DECODES = [(510, 1), (511, 1), (900, 1), (40, 1), (4100, 1), (30, 70), (9000, 1)]


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [8, 16, 48])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (8, 8)])
def test_long_decodes_in_parts_match_dense_attention(
    dtype: torch.dtype, block_size: int, heads: int, kv_heads: int, isa: str
) -> None:
    pc = make_case(LONG_DECODES, heads, kv_heads, 64, block_size, dtype, seed=8)
    out = run_native(pc, isa)
    max_diff = max_diff_to_dense(pc, out)
    print(f"{isa} {dtype} bs={block_size} {heads}/{kv_heads}: {max_diff:.2e} from dense")
    assert max_diff < TOLERANCE[dtype]
    for r in range(len(LONG_DECODES)):
        q0, q1 = pc.metadata.qo_indptr[r].item(), pc.metadata.qo_indptr[r + 1].item()
        assert torch.equal(out[q0:q1], run_alone(pc, r, isa)), f"request {r}"


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_long_decode_among_many_matches_it_alone(dtype: torch.dtype, isa: str) -> None:
    """Among enough decodes, the kernels take a decode's KV heads in one item: a long
    decode's parts then cover all its heads, with the same result as alone."""
    requests = MANY_DECODES[:24] + LONG_DECODES
    pc = make_case(requests, 9, 3, 64, 16, dtype, seed=9)
    out = run_native(pc, isa)
    assert max_diff_to_dense(pc, out) < TOLERANCE[dtype]
    for r in range(24, len(requests)):
        q0, q1 = pc.metadata.qo_indptr[r].item(), pc.metadata.qo_indptr[r + 1].item()
        assert torch.equal(out[q0:q1], run_alone(pc, r, isa)), f"request {r}"


def test_the_backend_runs_the_cpus_best_instruction_set() -> None:
    pc = make_case(NATIVE_CASES["chunked"], 9, 3, 64, 16, torch.bfloat16, seed=2)
    out = run_native(pc)
    assert torch.equal(out, run_native(pc, ISAS[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_avx512_sets_agree_bit_for_bit_outside_bf16(dtype: torch.dtype) -> None:
    """AVX512_BF16 changes only bf16 dot products: float32 and float16 give the same bits
    with and without it (on a CPU that runs both; elsewhere there is nothing to compare)."""
    if "avx512_bf16" not in ISAS:
        pytest.skip(f"{CPU_LACKS}avx512_bf16")
    sets = [isa for isa in ISAS if isa.startswith("avx512")]
    pc = make_case(NATIVE_CASES["chunked"] + CASES["mixed"], 8, 2, 64, 16, dtype, seed=5)
    outs = [run_native(pc, isa) for isa in sets]
    print(f"compared {sets}")
    assert all(torch.equal(outs[0], out) for out in outs[1:])


def shared_prefixes(md: AttentionMetadata, block_size: int) -> list[list[int]]:
    """The kernel's plan: (first request, end request, keys) of each shared prefix it reads
    once for all the requests of the run."""
    runs = torch.ops.pagedserve.shared_prefixes(
        md.qo_indptr, md.kv_indptr, md.kv_indices, md.kv_last_page_len, block_size
    )
    return runs.tolist()


# (computed, new) per request, and the keys all of them share: decodes behind one long
# system prompt, and a mix with a chunk of prefill that starts just after the prefix.
SHARED_CASES = {
    "decodes": ([(800 + 7 * i, 1) for i in range(8)], 800),
    "mixed": ([(300, 1), (290, 12), (310, 1), (288, 40), (301, 1)], 288),
}


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("case", sorted(SHARED_CASES))
def test_shared_prefix_pages_are_read_once_with_the_same_result(
    dtype: torch.dtype, block_size: int, case: str, isa: str
) -> None:
    """Requests on the same prefix pages share one pass over them. The answer is the one
    each request gets from its own copy of the pages, bit for bit in every set (same
    chunks, same order), and close to dense attention. Only a decode long enough to be
    split into parts on its own pages (kSplitMinKeys, 512) rounds differently there."""
    requests, prefix = SHARED_CASES[case]
    shared = make_case(requests, 9, 3, 64, block_size, dtype, 7, prefix, share_pages=True)
    private = make_case(requests, 9, 3, 64, block_size, dtype, 7, prefix, share_pages=False)
    # Whole pages and whole chunks of the kernel's KEY_CHUNK keys.
    align = math.lcm(block_size, KEY_CHUNK)
    expected_keys = prefix // align * align
    assert shared_prefixes(shared.metadata, block_size) == [[0, len(requests), expected_keys]]
    assert shared_prefixes(private.metadata, block_size) == []
    out, reference = run_native(shared, isa), run_native(private, isa)
    max_diff = max_diff_to_dense(shared, out)
    print(f"{isa} {case} {dtype} bs={block_size}: {max_diff:.2e} from dense")
    assert max_diff < TOLERANCE[dtype]
    if all(new > 1 or computed + 1 < 512 for computed, new in requests):
        assert torch.equal(out, reference)
    else:
        assert (out.double() - reference.double()).abs().max().item() < TOLERANCE[dtype]


def test_shared_prefix_runs() -> None:
    """Which consecutive requests the kernel groups, and over how many keys."""
    block_size = 16

    def plan(requests: list[tuple[int, int, list[int]]]) -> list[list[int]]:
        """requests: (computed, new, pages)."""
        md = build_attention_metadata(
            [c for c, _, _ in requests], [n for _, n, _ in requests],
            [pages for _, _, pages in requests], block_size,
        )  # fmt: skip
        return shared_prefixes(md, block_size)

    a, b = list(range(0, 40)), list(range(100, 140))  # two prompts of 40 pages
    decode = (600, 1)  # 37.5 pages seen: 37 whole pages, 18 whole chunks of 32 keys
    assert plan([(*decode, a), (*decode, a)]) == [[0, 2, 36 * 16]]
    # Two prompts, two runs; a lone request shares nothing.
    assert plan([(*decode, a), (*decode, a), (*decode, b), (*decode, b), (*decode, a)]) == [
        [0, 2, 36 * 16],
        [2, 4, 36 * 16],
    ]
    # A run shares what all its requests have in common, and what every row of each sees:
    # the prefill chunk's queries start at key 130, so only 8 whole pages are in the past.
    diverged = a[:20] + list(range(200, 220))
    assert plan([(*decode, a), (*decode, diverged), (130, 50, a[:12])]) == [[0, 3, 8 * 16]]
    # Fewer than 128 shared keys are not worth a pass of their own.
    assert plan([(*decode, a), (*decode, a[:7] + b[7:])]) == []
    # A request with no rows this step ends the run.
    assert plan([(*decode, a), (*decode, a), (600, 0, a), (*decode, a), (*decode, a)]) == [
        [0, 2, 36 * 16],
        [3, 5, 36 * 16],
    ]


def test_native_matches_torch_backend_and_writes_the_same_cache() -> None:
    requests = CASES["mixed"] + NATIVE_CASES["chunked"]
    native_case = make_case(requests, 9, 3, 64, 16, torch.float32, seed=3)
    torch_case = make_case(requests, 9, 3, 64, 16, torch.float32, seed=3)
    out = run_native(native_case)
    reference = TorchAttentionBackend(torch_case.kv_cache, 9, 64**-0.5)
    reference.plan(torch_case.metadata)
    expected = reference.forward(LAYER, torch_case.q, torch_case.k, torch_case.v)
    max_diff = (out - expected).abs().max().item()
    print(f"native vs torch backend: {max_diff:.2e}")
    assert max_diff < 1e-5
    assert torch.equal(native_case.kv_cache, torch_case.kv_cache)


def test_non_contiguous_queries_are_accepted() -> None:
    pc = make_case(CASES["mixed"], 4, 2, 32, 16, torch.float32, seed=4)
    qkv = torch.cat([pc.q.flatten(1), torch.zeros(pc.q.shape[0], 7)], dim=1)
    q = qkv[:, : pc.q[0].numel()].view_as(pc.q)  # token stride 4 * 32 + 7
    backend = NativeCpuAttentionBackend(pc.kv_cache, 4, 32**-0.5)
    backend.plan(pc.metadata)
    assert max_diff_to_dense(pc, backend.forward(LAYER, q, pc.k, pc.v)) < 1e-5


def test_kernel_rejects_page_ids_outside_the_cache() -> None:
    pc = make_case(CASES["decode"], 4, 2, 32, 16, torch.float32)
    md = pc.metadata
    bad_indices = md.kv_indices.clone()
    bad_indices[0] = pc.kv_cache.shape[2]
    k_cache, v_cache = pc.kv_cache[LAYER]
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.pagedserve.paged_attention(
            torch.empty_like(pc.q), pc.q, k_cache, v_cache, md.qo_indptr, md.kv_indptr,
            bad_indices, md.kv_last_page_len, 1.0,
        )  # fmt: skip


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_kernels_share_torchs_openmp_runtime() -> None:
    """A second OpenMP runtime would bring its own threads, deaf to torch.set_num_threads."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    paths = {Path(line.split()[-1]) for line in maps}
    runtimes = {p for p in paths if p.name.startswith(("libgomp", "libomp", "libiomp"))}
    assert len(runtimes) <= 1, runtimes


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.attention as attention

    auto = resolve_backend("auto", "cpu")
    assert (auto.name, auto.reason) == ("cpu-native", "auto: the native CPU kernels load")
    assert resolve_backend("torch", "cpu").name == "torch"
    kv_cache = allocate_kv_cache(1, 4, 16, 2, 32, torch.float32, "cpu")
    assert create_backend("auto", kv_cache, 4, 1.0).name == "cpu-native"
    assert create_backend("torch", kv_cache, 4, 1.0).name == "torch"
    with pytest.raises(ValueError, match="only on the CPU"):
        resolve_backend("cpu-native", "cuda")
    broken = NativeKernels(None, reason="_C.abi3.so does not load (undefined symbol)")
    monkeypatch.setattr(attention, "native_kernels", lambda: broken)
    fallback = resolve_backend("auto", "cpu")
    assert fallback.name == "torch"
    assert fallback.reason == f"auto: the native CPU kernels are unavailable: {broken.reason}"
    with pytest.raises(ValueError, match=r"'cpu-native' is unavailable: _C\.abi3\.so does not"):
        resolve_backend("cpu-native", "cpu")


def test_greedy_tokens_match_the_torch_backend(tmp_path: Path) -> None:
    from engine import LLM, SamplingParams
    from tests.tiny_models import make_tiny_model

    model = make_tiny_model("llama", tmp_path / "llama")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (5, 23, 40, 1, 17, 64)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "cpu-native"):
        llm = LLM(
            str(model),
            dtype="float32",
            device="cpu",
            attention_backend=backend,
            max_num_batched_tokens=16,
            num_kv_blocks=64,
        )
        assert llm.config.device.attention_backend == backend
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["cpu-native"] == tokens["torch"]
