"""Tensor parallelism over NCCL, one GPU per rank (run by hand on a host with two GPUs:
see docs/gpu.md). Without two CUDA GPUs every test here is skipped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine import LLM
from tests.engine.test_correctness import (
    LENGTHS,
    MAX_TOKENS,
    engine_tokens,
    hf_greedy,
    make_prompts,
)
from tests.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA GPUs",
    ),
]


def test_nccl_two_ranks_match_transformers(tmp_path: Path) -> None:
    """float32 with the torch attention backend (FlashInfer has no float32 kernels), the KV
    cache sized by profiling every rank (no --num-kv-blocks), chunked and batched."""
    path = make_tiny_model("qwen2", tmp_path, hidden_size=256, intermediate_size=512)
    prompts = make_prompts(1, LENGTHS)
    reference = hf_greedy(path, prompts, MAX_TOKENS)
    llm = LLM(
        str(path),
        device="cuda",
        dtype="float32",
        attention_backend="torch",
        gpu_memory_utilization=0.3,
        max_model_len=256,
        max_num_batched_tokens=64,
        tensor_parallel_size=2,
    )
    try:
        assert dist.get_backend() == "nccl"
        assert llm.config.device.cuda_graph_sizes == ()
        assert engine_tokens(llm, prompts) == reference
    finally:
        llm.close()
