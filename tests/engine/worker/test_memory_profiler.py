"""KV sizing on GPU without a GPU: the block arithmetic with made-up numbers, the dummy
profiling step (run on CPU), and the worker's use of both."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineArgs
from engine.models.loader import load_model
from engine.worker.memory_profiler import MemoryProfile, profile_batch, run_profile_step
from engine.worker.worker import kv_blocks_for_budget
from tests.tiny_models import make_tiny_model

GIB, MIB = 1 << 30, 1 << 20


def test_kv_blocks_arithmetic() -> None:
    profile = MemoryProfile(total_bytes=80 * GIB, peak_torch_bytes=20 * GIB, non_torch_bytes=GIB)
    # int(80 GiB * 0.9) = 72 GiB; 72 - 20 - 1 = 51 GiB of 2 MiB blocks.
    assert profile.kv_blocks(0.9, 2 * MIB) == 51 * 512
    assert profile.kv_blocks(0.9, 2 * MIB, reserved_blocks=1) == 51 * 512 - 1
    assert profile.kv_blocks(1.0, 3 * MIB) == (59 * GIB) // (3 * MIB)
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        profile.kv_blocks(0.25, 2 * MIB)  # 20 GiB share < 21 GiB in use
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        profile.kv_blocks(1.5, 2 * MIB)


def test_profile_batch_splits_tokens_into_max_len_prompts() -> None:
    computed, new, tables = profile_batch(8192, max_num_seqs=64, max_model_len=3000, block_size=16)
    assert computed == [0, 0, 0] and new == [3000, 3000, 2192]
    assert [len(t) for t in tables] == [188, 188, 137]
    flat = [b for t in tables for b in t]
    assert flat == list(range(len(flat)))  # every page its own block
    # The scheduler never holds more than max_num_seqs prompts of max_model_len.
    _, new, _ = profile_batch(10_000, max_num_seqs=2, max_model_len=1000, block_size=16)
    assert new == [1000, 1000]
    assert profile_batch(100, max_num_seqs=8, max_model_len=4096, block_size=16)[1] == [100]


def test_profile_step_runs_on_cpu(tmp_path: Path) -> None:
    model, arch = load_model(make_tiny_model("llama", tmp_path), torch.float32, "cpu")
    scratch = run_profile_step(
        model, "torch", max_num_batched_tokens=300, max_num_seqs=4, max_model_len=128, block_size=16
    )
    blocks = 8 + 8 + 3  # prompts of 128, 128 and 44 tokens
    per_block = 2 * arch.num_layers * 16 * arch.num_kv_heads * arch.head_dim * 4
    assert scratch == blocks * per_block


def test_worker_sizes_the_gpu_cache_from_the_profile(tmp_path: Path) -> None:
    _, arch = load_model(make_tiny_model("llama", tmp_path), torch.float32, "cpu")
    per_block = 2 * arch.num_layers * 16 * arch.num_kv_heads * arch.head_dim * 2  # bf16
    profile = MemoryProfile(total_bytes=1000 * per_block, peak_torch_bytes=0, non_torch_bytes=0)
    calls = []

    def gpu_profile() -> MemoryProfile:
        calls.append(1)
        return profile

    args = EngineArgs(gpu_memory_utilization=0.5, max_num_seqs=1000)
    blocks = kv_blocks_for_budget(args, [arch], None, 256, torch.bfloat16, 256, 1, gpu_profile)
    assert blocks == 500 - 1  # one block reserved for the CUDA graphs' padding
    assert calls == [1]
    # A full-length limit still caps it; an explicit count skips the profile.
    capped = kv_blocks_for_budget(
        EngineArgs(max_num_seqs=2), [arch], None, 256, torch.bfloat16, 256, 0, gpu_profile
    )
    assert capped == 2 * 16
    explicit = EngineArgs(num_kv_blocks=7)
    assert kv_blocks_for_budget(explicit, [arch], None, 64, torch.bfloat16, 64, 1, gpu_profile) == 7
    assert calls == [1, 1]
