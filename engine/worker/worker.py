"""The device side of the engine: where it runs, the loaded weights, the KV cache's size and
the model runner. The device-dependent decisions of the configuration are made here."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from engine.attention import resolve_backend
from engine.attention.backend import kv_cache_bytes_per_block
from engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineArgs,
    ModelConfig,
    QuantConfig,
    SchedulerConfig,
    resolve_lora_config,
    resolve_model_config,
    resolve_quant_config,
    runtime_facts,
)
from engine.cpu_share import cpu_limit, own_cgroup_cpu_dir
from engine.kv_cache.groups import KVCacheGroups, blocks_for_one_request
from engine.models.arch import ModelArch
from engine.models.layers import TILED_BF16_ISAS
from engine.models.llama import DecoderModel
from engine.models.loader import load_model
from engine.models.parallel import Shard, TensorParallelDecoder, shard_arch
from engine.ops.loader import native_kernels, select_cpu_isa
from engine.spec_decode import SpeculativeConfig, parse_speculative_config
from engine.utils import cdiv
from engine.worker.cpu_kernels import check_kernels, resolve_kernels
from engine.worker.cuda_graphs import CudaGraphConfig, capture_sizes
from engine.worker.draft_runner import DraftModelRunner
from engine.worker.lora_manager import LoRAManager
from engine.worker.memory_profiler import MemoryProfile, profile_gpu_memory
from engine.worker.model_runner import ModelRunner
from engine.worker.step_profiler import StepProfiler
from engine.worker.tensor_parallel import TensorParallelGroup, TensorParallelRunner

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested, but CUDA is not available")
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"unknown device {name!r}; choose auto, cpu or cuda")
    return torch.device(name)


def cpu_prefers_bf16(cpu_flags: str, native_isa: str | None) -> bool:
    """Whether bfloat16 is the CPU's fast dtype: it has bf16 dot products (AVX512_BF16,
    AMX), or the native kernels run a bfloat16 tile kernel on it (AVX2: float32 FMAs on
    weights widened in registers). On AVX2 (2 threads), a SmolLM2-135M decode step took
    18.5 ms in bfloat16 against 56.8 in float32, and the Q4_1 model's 12.8 against 14.0
    (bfloat16 rows take the quantized kernel's integer path); prefill was 5-20% slower."""
    flags = set(cpu_flags.split())
    return bool(flags & {"avx512_bf16", "amx_bf16"}) or native_isa in TILED_BF16_ISAS


def cpu_flags() -> str:
    """The flags lines of /proc/cpuinfo; empty where there is none."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    bf16 = cpu_prefers_bf16(cpu_flags(), native_kernels().isa)
    return torch.bfloat16 if bf16 else torch.float32


def available_cpus(group: tuple[Path, str] | None = None) -> int:
    """CPUs this process may use: its affinity, capped by its cgroup's CFS quota rounded to
    the nearest whole CPU (at least 1). `group`: the cgroup directory and its version
    (own_cgroup_cpu_dir); by default this process's.

    Rounded, not floored: under a 1.5-CPU quota the default model served 94-120 tok/s 16 at
    once on 2 threads (three runs) and 84 on 1, with the single-stream ITL p99 near its
    quiet value either way (benchmarks/shared_cpu.py; docs/benchmarks.md)."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    count = count or 1
    group = group or own_cgroup_cpu_dir()
    limit = None if group is None else cpu_limit(*group)
    if limit is None:
        return count
    return max(1, min(count, int(limit + 0.5)))


def check_cpu_kernels(args: EngineArgs) -> None:
    """Raises ValueError, naming the choices, when an engine made from `args` would refuse
    its --cpu-isa here; selects nothing. A server calls it to refuse the setting before it
    starts, rather than when the model loads."""
    if args.cpu_isa != "auto":
        check_kernels(args.cpu_isa, resolve_device(args.device))


def resolve_device_config(args: EngineArgs, arch: ModelArch) -> DeviceConfig:
    """Device, dtype, attention backend, native kernels and threads: what runs here. Loads
    the native CPU kernels (on CPU), selecting their instruction set for the whole process,
    and may import flashinfer (on CUDA); raises ValueError for settings this machine cannot
    run."""
    device = resolve_device(args.device)
    check_parallel_devices(args.tensor_parallel_size, device)
    kernels = resolve_kernels(args.cpu_isa, device)
    dtype = resolve_dtype(args.dtype, device)
    backend = resolve_backend(args.attention_backend, device, dtype, arch.attention_sinks)
    sizes, graphs_off = cuda_graph_plan(args, device, backend.name, arch)
    # Each rank runs on its own cores.
    threads = args.num_threads or max(1, available_cpus() // args.tensor_parallel_size)
    return DeviceConfig(
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        attention_backend=backend.name,
        attention_reason=backend.reason,
        native_kernels=kernels,
        num_threads=threads,
        cuda_graph_sizes=sizes,
        cuda_graphs_off=graphs_off,
    )


def check_parallel_devices(size: int, device: torch.device) -> None:
    """Raises ValueError when `size` ranks cannot each have a device of their own."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be positive, got {size}")
    if device.type == "cuda" and size > torch.cuda.device_count():
        raise ValueError(
            f"--tensor-parallel-size {size} needs {size} GPUs; "
            f"{torch.cuda.device_count()} are visible"
        )


def load_shard(
    args: EngineArgs, model: ModelConfig, device: DeviceConfig, rank: int, size: int
) -> TensorParallelDecoder:
    """Rank `rank`'s shard of the model's float weights, on its device (in a rank's own
    process, with the native kernels rank 0 chose)."""
    kernels = device.native_kernels
    if kernels is not None and kernels.isa is not None:
        select_cpu_isa(kernels.isa)
    shard = Shard(rank, size)

    def cut(full: DecoderModel) -> DecoderModel:
        return TensorParallelDecoder.from_full(full, shard, None)

    dtype, target = DTYPES[device.dtype], torch.device(device.device)
    loaded, _ = load_model(model.weights, dtype, target, QuantConfig(), shard=cut)
    assert isinstance(loaded, TensorParallelDecoder)
    return loaded


def cuda_graph_plan(
    args: EngineArgs, device: torch.device, backend: str, arch: ModelArch
) -> tuple[tuple[int, ...], str]:
    """(the decode batch sizes to capture, why none) on CUDA; ((), "") elsewhere."""
    if device.type != "cuda":
        return (), ""
    if args.enforce_eager:
        return (), "off (--enforce-eager)"
    if arch.is_moe:
        # Each step's expert batch sizes are read on the host, which a graph cannot replay.
        return (), "off (mixture-of-experts routing runs eagerly)"
    if args.tensor_parallel_size > 1:
        return (), "off (tensor parallelism runs eagerly)"
    if backend != "flashinfer":
        logger.info("CUDA graphs need the flashinfer attention backend; decoding eagerly")
        return (), "off (they need the flashinfer attention backend)"
    return capture_sizes(args.max_num_seqs), ""


def describe_setup(args: EngineArgs) -> list[tuple[str, str]]:
    """What an engine made from `args` would run on this machine (config.runtime_facts),
    without loading the weights. Raises ValueError for a setting that cannot run here."""
    model = resolve_model_config(args)
    device = resolve_device_config(args, model.arch)
    quant = resolve_quant_config(args, model, device.device_type)
    return runtime_facts(device, quant)


class Worker:
    """Loads the model on construction; then sizes the KV cache and builds the runner.

    With --tensor-parallel-size N > 1 it starts N - 1 worker processes (see
    tensor_parallel.py), holds shard 0 itself, and its runner keeps the workers in step.
    """

    def __init__(self, args: EngineArgs, model: ModelConfig) -> None:
        self.device_config = resolve_device_config(args, model.arch)
        self.model_config = model
        self.device = torch.device(self.device_config.device)
        self.dtype = DTYPES[self.device_config.dtype]
        self.quant_config = resolve_quant_config(args, model, self.device.type)
        self.lora_config = resolve_lora_config(args)
        if model.gguf is not None and self.quant_config.method == "none":
            logger.info(
                "serving %s's weights in %s (--quantization none)", model.gguf.name, self.dtype
            )
        self.tp_group: TensorParallelGroup | None = None
        self.arch = model.arch  # this rank's shapes
        if args.tensor_parallel_size > 1:
            self.model: DecoderModel = self._load_shard(args)
        else:
            lm_head = model.pooler is None  # an embedding model has none
            self.model, _ = load_model(
                model.weights, self.dtype, self.device, self.quant_config, lm_head=lm_head
            )
        # Speculative decoding's draft model (draft_model), loaded beside the target.
        self.speculative = parse_speculative_config(args.speculative_config)
        self.draft_config: ModelConfig | None = None
        self.draft_model: DecoderModel | None = None
        if self.speculative is not None and self.speculative.method == "draft_model":
            self.draft_config = resolve_draft_config(args, self.speculative, model)
            draft_args = draft_engine_args(args, self.speculative)
            quant = resolve_quant_config(draft_args, self.draft_config, self.device.type)
            self.draft_model, _ = load_model(
                self.draft_config.weights, self.dtype, self.device, quant
            )
            logger.info(
                "speculative decoding: draft model %s (%s weights)",
                self.draft_config.name,
                quant.method,
            )

    def _load_shard(self, args: EngineArgs) -> TensorParallelDecoder:
        size = args.tensor_parallel_size
        self.arch = shard_arch(self.model_config.arch, size)  # refuses what cannot shard
        group = TensorParallelGroup(args, self.model_config, self.device_config, size)
        self.tp_group = group
        try:
            model = load_shard(args, self.model_config, self.device_config, 0, size)
            group.wait_loaded()
        except BaseException:
            group.close()
            raise

        def announce_logits(hidden: torch.Tensor) -> None:
            group.send("logits", tuple(hidden.shape))
            group.broadcast(hidden.contiguous())

        model.before_logits = announce_logits
        logger.info("tensor parallel: %d ranks, this process holds shard 0", size)
        return model

    def kv_cache_groups(self, args: EngineArgs) -> KVCacheGroups | None:
        """The KV cache groups of a hybrid model (sliding layers beside full ones), which
        free the sliding layers' blocks out of their window (engine/kv_cache/groups.py);
        None for a model whose layers attend alike, and where the runner keeps one table
        for all: with --disable-hybrid-kv-cache-manager, on a GPU (FlashInfer's plans and
        the CUDA graphs take one) and with tensor parallelism (its workers get one table a
        step)."""
        groups = KVCacheGroups.for_layers(self.arch.layer_windows)
        if not groups.hybrid or args.disable_hybrid_kv_cache_manager:
            return None
        if self.device.type != "cpu" or self.tp_group is not None:
            logger.info(
                "KV cache: one block table for the sliding and the full layers (hybrid "
                "groups run on one CPU rank): the sliding layers keep their whole history"
            )
            return None
        return groups

    @property
    def _graph_scratch_blocks(self) -> int:
        """CUDA graphs' padding rows write one scratch block the KV manager never sees."""
        return 1 if self.device_config.cuda_graph_sizes else 0

    def num_kv_blocks(
        self, args: EngineArgs, scheduler: SchedulerConfig, groups: KVCacheGroups | None
    ) -> int:
        """Explicit count, else what the memory budget holds beside the scratch block; never
        fewer than one full-length request needs. On GPU without an explicit
        --kv-cache-memory, the budget comes from --gpu-memory-utilization after a profiling
        step. A hybrid model's `groups` (kv_cache_groups) size its blocks and requests."""
        gpu_profile = None
        if self.device.type == "cuda":

            def gpu_profile() -> MemoryProfile:
                limits = (
                    scheduler.max_num_batched_tokens,
                    scheduler.max_num_seqs,
                    scheduler.max_model_len,
                    args.block_size,
                )
                if self.tp_group is None:
                    return profile_gpu_memory(
                        self.model, self.device_config.attention_backend, *limits
                    )
                return self._profile_all_ranks(limits)

        archs = [self.arch]
        if self.draft_config is not None:
            archs.append(self.draft_config.arch)  # its cache has as many blocks
        return kv_blocks_for_budget(
            args,
            archs,
            groups,
            scheduler.max_num_batched_tokens,
            self.dtype,
            scheduler.max_model_len,
            self._graph_scratch_blocks,
            gpu_profile,
        )

    def _profile_all_ranks(self, limits: tuple[int, int, int, int]) -> MemoryProfile:
        """Every rank runs the dummy step on its shard (its collectives need them all);
        ranks hold equal shares, so rank 0's measure stands for each."""
        assert self.tp_group is not None and isinstance(self.model, TensorParallelDecoder)
        self.tp_group.send("profile", *limits)
        announce, self.model.before_logits = self.model.before_logits, None
        try:
            return profile_gpu_memory(self.model, self.device_config.attention_backend, *limits)
        finally:
            self.model.before_logits = announce

    def create_runner(self, cache: CacheConfig, profile: bool = False) -> ModelRunner:
        graphs = None
        if self.device_config.cuda_graph_sizes:
            sizes = self.device_config.cuda_graph_sizes
            graphs = CudaGraphConfig(sizes, self.model_config.max_model_len)
        runner_args = (self.model, self.arch, cache, self.device_config)
        if self.tp_group is not None:
            self.tp_group.send("kv_cache", cache.num_blocks, cache.block_size)
            return TensorParallelRunner(
                *runner_args, StepProfiler(profile, self.device), group=self.tp_group
            )
        profiler = StepProfiler(profile, self.device)
        lora = None
        if self.lora_config is not None:
            lora = LoRAManager(self.model, self.arch, self.lora_config)
        drafter = None
        if self.draft_model is not None:
            assert self.draft_config is not None and self.speculative is not None
            drafter = DraftModelRunner(
                self.draft_model,
                self.draft_config.arch,
                cache,
                self.device_config,
                self.speculative.num_speculative_tokens,
                self.arch.vocab_size,
            )
        return ModelRunner(*runner_args, profiler, graphs, self.model_config.pooler, lora, drafter)


def draft_engine_args(args: EngineArgs, spec: SpeculativeConfig) -> EngineArgs:
    """The settings a draft model loads with: its own path and quantization, generating."""
    return dataclasses.replace(
        args,
        model=spec.draft_model,
        quantization=spec.draft_quantization,
        quantize_lm_head=None,
        task="generate",
        max_model_len=None,
    )


def resolve_draft_config(
    args: EngineArgs, spec: SpeculativeConfig, target: ModelConfig
) -> ModelConfig:
    """The draft model's configuration; raises ValueError for a draft that cannot serve
    beside `target`: a shorter context than the target's max_model_len, or sliding windows
    on either model (their KV blocks are freed by the target's window only). That both
    share a tokenizer is checked where the tokenizers load (EngineCore.from_args)."""
    draft = resolve_model_config(draft_engine_args(args, spec))
    if draft.max_model_len < target.max_model_len:
        raise ValueError(
            f"the draft model {draft.name} holds {draft.max_model_len} tokens, fewer than "
            f"max_model_len={target.max_model_len}; lower --max-model-len"
        )
    if any(target.arch.layer_windows) or any(draft.arch.layer_windows):
        raise ValueError(
            "speculative decoding with a draft model does not run with sliding-window "
            "attention (in the target or the draft model)"
        )
    return draft


def kv_blocks_for_budget(
    args: EngineArgs,
    archs: Sequence[ModelArch],
    groups: KVCacheGroups | None,
    max_chunk: int,
    dtype: torch.dtype,
    max_model_len: int,
    reserved_blocks: int,
    gpu_profile: Callable[[], MemoryProfile] | None,
) -> int:
    """The number of KV blocks the scheduler may hand out (see Worker.num_kv_blocks). With
    hybrid `groups`, the first arch's block holds one K/V pair a slot, not a layer, and a
    request holds blocks in every group."""
    needed = cdiv(max_model_len, args.block_size)
    if groups is not None:
        needed = blocks_for_one_request(groups.windows, args.block_size, max_model_len, max_chunk)
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks
    # K/V pairs a block holds per model: a layer's each, or the target's slots with groups.
    pairs = [arch.num_layers for arch in archs]
    if groups is not None:
        pairs[0] = groups.num_slots
    per_block = sum(
        kv_cache_bytes_per_block(n, args.block_size, arch.num_kv_heads, arch.head_dim, dtype)
        for n, arch in zip(pairs, archs, strict=True)
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
