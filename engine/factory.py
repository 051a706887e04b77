"""From user-facing EngineArgs to a ready EngineCore: every derived value is decided here."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.attention import resolve_backend_name
from engine.attention.backend import kv_cache_bytes_per_block
from engine.config import CacheConfig, SchedulerConfig
from engine.core import EngineCore
from engine.cuda_graphs import CudaGraphConfig, capture_sizes
from engine.gpu_memory import MemoryProfile, profile_gpu_memory
from engine.kv_cache import KVCacheManager, cdiv
from engine.model_runner import ModelRunner
from engine.models.arch import ModelArch
from engine.models.loader import load_model, resolve_model_path
from engine.profiling import StepProfiler
from engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30


@dataclass(frozen=True)
class EngineArgs:
    """What a user may set. None means "derive it" (see `create_engine`)."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    # CUDA only: run decode steps eagerly instead of replaying captured CUDA graphs.
    enforce_eager: bool = False
    num_threads: int | None = None
    profile: bool = False
    # Tests: verify the KV block pool after every step (slow; never in production).
    check_invariants: bool = False


@dataclass(frozen=True)
class EngineConfig:
    """Everything decided: the engine runs from this alone."""

    model_path: Path
    gguf_file: str | None
    device: torch.device
    dtype: torch.dtype
    arch: ModelArch
    cache: CacheConfig
    scheduler: SchedulerConfig
    attention_backend: str
    num_threads: int
    # Batch sizes of the captured decode graphs; empty when steps run eagerly.
    cuda_graph_sizes: tuple[int, ...] = ()


@dataclass
class Engine:
    core: EngineCore
    tokenizer: Any
    config: EngineConfig
    profiler: StepProfiler


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested, but CUDA is not available")
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"unknown device {name!r}; choose auto, cpu or cuda")
    return torch.device(name)


def cpu_supports_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_supports_bf16() else torch.float32


def available_cpus() -> int:
    """CPUs this process may use: affinity, capped by a cgroup v2 CPU quota."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    count = count or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            count = min(count, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return count


def create_engine(args: EngineArgs) -> Engine:
    """Loads the model and builds the scheduler, KV cache and runner."""
    from transformers import AutoTokenizer

    if args.model is None:
        from engine.models.default_model import prepare_default_model

        model_path: str | Path = prepare_default_model()
    else:
        model_path = args.model
    folder, gguf_file = resolve_model_path(model_path)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    num_threads = args.num_threads or available_cpus()
    if device.type == "cpu":
        torch.set_num_threads(num_threads)
    backend = resolve_backend_name(args.attention_backend, device, dtype)
    model, arch = load_model(folder / gguf_file if gguf_file else folder, dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)

    max_model_len = _max_model_len(args, arch)
    scheduler_config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens
        or (512 if device.type == "cpu" else 8192),
        max_model_len=max_model_len,
    )
    cuda_graphs = _cuda_graph_config(args, device, backend, max_model_len)

    def profile() -> MemoryProfile:
        return profile_gpu_memory(
            model,
            backend,
            scheduler_config.max_num_batched_tokens,
            scheduler_config.max_num_seqs,
            max_model_len,
            args.block_size,
        )

    cache_config = CacheConfig(
        block_size=args.block_size,
        num_blocks=_num_kv_blocks(
            args,
            arch,
            dtype,
            max_model_len,
            reserved_blocks=0 if cuda_graphs is None else 1,
            gpu_profile=profile if device.type == "cuda" else None,
        ),
        enable_prefix_caching=args.enable_prefix_caching,
    )
    config = EngineConfig(
        folder,
        gguf_file,
        device,
        dtype,
        arch,
        cache_config,
        scheduler_config,
        backend,
        num_threads,
        cuda_graphs.sizes if cuda_graphs else (),
    )
    logger.info(
        "engine: %s on %s in %s, %d KV blocks of %d tokens, max_model_len %d, backend %s, "
        "CUDA graphs for decode batches of %s",
        folder.name,
        device,
        dtype,
        cache_config.num_blocks,
        cache_config.block_size,
        max_model_len,
        backend,
        list(config.cuda_graph_sizes) or "none",
    )
    kv_manager = KVCacheManager(
        cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
    )
    profiler = StepProfiler(enabled=args.profile)
    runner = ModelRunner(model, arch, cache_config, backend, profiler, cuda_graphs)
    core = EngineCore(Scheduler(scheduler_config, kv_manager), runner, args.check_invariants)
    return Engine(core, tokenizer, config, profiler)


def _max_model_len(args: EngineArgs, arch: ModelArch) -> int:
    limit = arch.max_position_embeddings
    if arch.sliding_window is not None:
        limit = min(limit, arch.sliding_window)
    if args.max_model_len is None:
        return limit
    if args.max_model_len > limit:
        raise ValueError(
            f"max_model_len {args.max_model_len} exceeds what the model supports ({limit}"
            + (", its sliding window" if arch.sliding_window == limit else "")
            + ")"
        )
    return args.max_model_len


def _cuda_graph_config(
    args: EngineArgs, device: torch.device, backend: str, max_model_len: int
) -> CudaGraphConfig | None:
    """Graphs for decode-only steps on CUDA with FlashInfer, unless --enforce-eager."""
    if device.type != "cuda" or args.enforce_eager:
        return None
    if backend != "flashinfer":
        logger.info("CUDA graphs need the flashinfer attention backend; decoding eagerly")
        return None
    return CudaGraphConfig(capture_sizes(args.max_num_seqs), max_model_len)


def _num_kv_blocks(
    args: EngineArgs,
    arch: ModelArch,
    dtype: torch.dtype,
    max_model_len: int,
    reserved_blocks: int,
    gpu_profile: Callable[[], MemoryProfile] | None,
) -> int:
    """Explicit count, else what the memory budget holds beside `reserved_blocks`; never fewer
    than one full-length request needs. On GPU (`gpu_profile` given) without an explicit
    --kv-cache-memory, the budget comes from --gpu-memory-utilization after a profiling step."""
    needed = cdiv(max_model_len, args.block_size)
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks
    per_block = kv_cache_bytes_per_block(
        arch.num_layers, args.block_size, arch.num_kv_heads, arch.head_dim, dtype
    )
    if args.kv_cache_memory is not None:
        fits = args.kv_cache_memory // per_block - reserved_blocks
    elif gpu_profile is not None:
        fits = gpu_profile().kv_blocks(args.gpu_memory_utilization, per_block, reserved_blocks)
    else:
        fits = DEFAULT_CPU_KV_CACHE_BYTES // per_block - reserved_blocks
    # More blocks than every sequence at full length could use only wastes memory.
    num_blocks = min(fits, args.max_num_seqs * needed)
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache budget holds {num_blocks} blocks, fewer than the {needed} one request "
            f"of max_model_len={max_model_len} needs; lower --max-model-len or raise the budget"
        )
    return int(num_blocks)
