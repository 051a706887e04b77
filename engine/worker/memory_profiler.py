"""How many KV blocks fit on the GPU: profile one worst-case step, then do the arithmetic.

    budget = total * gpu_memory_utilization - peak_torch - non_torch
    blocks = budget // bytes_per_block - reserved_blocks

peak_torch is the most torch's allocator held during a dummy step of max_num_batched_tokens
tokens (weights + activations + the backend's workspace), not counting the temporary KV
cache that step writes into. non_torch is device memory in use outside torch's allocator:
the CUDA context, library handles, and other processes. CUDA graphs are captured after the
cache is allocated; their small pools come out of the (1 - utilization) headroom.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import create_backend
from engine.attention.backend import AttentionBackend, allocate_kv_cache
from engine.attention.metadata import build_attention_metadata
from engine.models.llama import DecoderModel
from engine.utils import cdiv


@dataclass(frozen=True)
class MemoryProfile:
    total_bytes: int
    peak_torch_bytes: int
    non_torch_bytes: int

    def kv_blocks(self, utilization: float, bytes_per_block: int, reserved_blocks: int = 0) -> int:
        """Blocks the KV cache manager may use; `reserved_blocks` more are allocated beside
        them. Raises ValueError when the model leaves no room at this utilization."""
        if not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
        budget = int(self.total_bytes * utilization) - self.peak_torch_bytes - self.non_torch_bytes
        blocks = budget // bytes_per_block - reserved_blocks
        if blocks < 1:
            gib = 1 << 30
            raise ValueError(
                f"no GPU memory left for the KV cache: {utilization:.2f} of "
                f"{self.total_bytes / gib:.1f} GiB minus {self.peak_torch_bytes / gib:.2f} GiB for "
                f"the model and {self.non_torch_bytes / gib:.2f} GiB outside torch; raise "
                "--gpu-memory-utilization or lower --max-num-batched-tokens"
            )
        return blocks


def profile_batch(
    num_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int
) -> tuple[list[int], list[int], list[list[int]]]:
    """A dummy step of fresh prompts, at most max_model_len long, holding num_tokens tokens
    (capped at what max_num_seqs prompts can hold), each on its own pages 0, 1, 2, ...
    Returns build_attention_metadata's (num_computed, num_new, block_ids)."""
    tokens = min(num_tokens, max_num_seqs * max_model_len)
    lengths = [max_model_len] * (tokens // max_model_len)
    if tokens % max_model_len:
        lengths.append(tokens % max_model_len)
    tables, first = [], 0
    for length in lengths:
        pages = cdiv(length, block_size)
        tables.append(list(range(first, first + pages)))
        first += pages
    return [0] * len(lengths), lengths, tables


def cache_and_backend(
    model: DecoderModel, backend_name: str, num_blocks: int, block_size: int
) -> tuple[torch.Tensor, AttentionBackend]:
    """A KV cache of `num_blocks` for `model`'s layers and heads (on its device, in its
    dtype), and a `backend_name` backend over it."""
    arch, param = model.arch, next(model.parameters())
    kv_cache = allocate_kv_cache(
        arch.num_layers,
        num_blocks,
        block_size,
        arch.num_kv_heads,
        arch.head_dim,
        param.dtype,
        param.device,
    )
    backend = create_backend(
        backend_name,
        kv_cache,
        arch.num_heads,
        arch.attention_scale,
        arch.layer_windows,
        model.layer_sinks(),
    )
    return kv_cache, backend


@torch.inference_mode()
def run_profile_step(
    model: DecoderModel,
    backend_name: str,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
) -> int:
    """Runs the dummy step through `backend_name` on a temporary KV cache, logits included
    for up to max_num_seqs rows (when the model has an LM head). Returns that cache's size
    in bytes (freed on return)."""
    param = next(model.parameters())
    computed, new, tables = profile_batch(
        max_num_batched_tokens, max_num_seqs, max_model_len, block_size
    )
    num_blocks = sum(len(t) for t in tables)
    kv_cache, backend = cache_and_backend(model, backend_name, num_blocks, block_size)
    md = build_attention_metadata(computed, new, tables, block_size, param.device)
    backend.plan(md)
    input_ids = torch.zeros(md.num_tokens, dtype=torch.long, device=param.device)
    hidden = model(input_ids, md.positions, backend)  # (T, hidden_size)
    if model.has_lm_head:
        model.compute_logits(hidden[-min(max_num_seqs, md.num_tokens) :]).softmax(-1)
    return kv_cache.numel() * kv_cache.element_size()


def profile_gpu_memory(
    model: DecoderModel,
    backend_name: str,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
) -> MemoryProfile:
    """Measures one dummy step on the model's CUDA device (see the module docstring)."""
    device = next(model.parameters()).device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    scratch = run_profile_step(
        model, backend_name, max_num_batched_tokens, max_num_seqs, max_model_len, block_size
    )
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(total - free - torch.cuda.memory_reserved(device), 0)
    torch.cuda.empty_cache()
    return MemoryProfile(total, peak, non_torch)
