"""Engine configuration: what a user may set (EngineArgs) and what the engine decided.

EngineArgs is the one place engine defaults live; the CLI's engine flags are generated from
its fields (their `help` metadata included). The frozen configs below are derived once, by
`resolve_model_config` here and by the worker for device-specific values, and never patched
afterwards. Pure Python: the device-dependent decisions happen in engine.worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.kv_cache.groups import KVCacheGroups
from engine.lora.request import LoRAConfig, parse_lora_modules
from engine.models.arch import ModelArch
from engine.models.hf_config import (
    eos_token_ids,
    find_gguf_weights,
    load_hf_config,
    resolve_model_path,
)
from engine.pooling import TASKS, PoolerConfig, read_pooler_config, resolve_task
from engine.spec_decode import SpeculativeConfig, parse_speculative_config

# With a dense copy of the weights (--quantization-dense-copy), steps with more rows than
# this use it in engine/models (dequantizing on every step costs milliseconds per layer:
# benchmarks/quant_kernels.py). Here, so that the flags' help and `pagedserve info` say it.
# The quantized kernel reads a third of the dense copy's bytes, and a step's weights
# stream from memory: offline decode steps of the default Q4_1
# model on a 2-core Zen 5 VM, this at 4 against 8 (separate processes, alternating, two
# rounds of three), 6 streams 10.5-12.4 against 7.0-8.7 ms, 8 streams 12.0-12.5 against
# 8.8-10.9 ms, with the AVX-512 BF16, AVX-512 and AVX2 kernels alike; at 12 streams the two
# paths were even and at 16 the dense copy won (15.1-16.5 against 17.3-18.4 ms).
DENSE_COPY_ROWS = 8


DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4")
ATTENTION_BACKENDS = ("auto", "torch", "cpu-native", "flashinfer")
# The step's token budget when --max-num-batched-tokens is not given. On the CPU a step's
# prefill tokens are most of its time, so the budget bounds the ITL of the requests decoding
# beside it: in a sweep of 128/256/512 (docs/benchmarks.md), 256 halved the ITL p99 at 16
# and 64 concurrent streams against 512 for about 3% of output tok/s; 128 cost 12%.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 256, "cuda": 8192}
# The most prompt tokens, all prefills together, in a step that also decodes, when
# --long-prefill-token-threshold is not given: the cap until the time a prompt token takes
# is known (DEFAULT_PREFILL_TIME_BESIDE_DECODES). On the CPU a step's prefill tokens set the
# ITL of the streams decoding beside them (16 decodes took 50 ms a step on a 2-core AVX2
# machine, and each prefill token 2 ms more): in mixed_load.py's sweep (docs/benchmarks.md),
# 64 per request took the ITL p99 to 0.41x of chunks of the whole budget (256) at 16 streams
# of 200-token prompts and to 0.43x beside 1-2k-token prompts, for 0-3% of output tok/s. A
# step with no decodes keeps the whole budget, so a prompt that arrives alone is not slowed
# by smaller steps. On GPU, and for embeddings (no decodes), none: vLLM's default applies.
DEFAULT_PREFILL_CHUNK_BESIDE_DECODES = {"cpu": 64, "cuda": 0}
# The same cap in time (--prefill-time-beside-decodes), once the steps have shown what a
# prompt token and a step of decodes take: a multiple of the latter. 64 tokens were 19 ms on
# a Zen 5 VM but 86-115 ms on a Zen 3 one, whose step of 16 decodes took 50-60 ms; there, in
# mixed_load.py's sweep (docs/benchmarks.md), 1 put the ITL p99 at 16 streams under
# llama-server's, where 64 tokens a request did not. GPU: none.
DEFAULT_PREFILL_TIME_BESIDE_DECODES = {"cpu": 1.0, "cuda": 0.0}


def _arg(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class EngineArgs:
    """What a user may set. None means "derive it" (the help text says from what)."""

    model: str | None = _arg(
        None,
        "local Hugging Face model directory or .gguf file (default: the bundled "
        "SmolLM2-135M-Instruct)",
        positional=True,
    )
    task: str = _arg(
        "generate",
        "what the model serves: generate (completions, chat) or embed (/v1/embeddings: the "
        "final hidden state of a prompt's last token, L2-normalised, as Qwen3-Embedding pools; "
        "a sentence-transformers directory's modules.json and 1_Pooling/config.json must say "
        "the same); auto is embed when the directory has a modules.json",
        choices=TASKS,
    )
    dtype: str = _arg("auto", "weights and KV cache dtype", choices=DTYPES)
    device: str = _arg("auto", "auto, cpu or cuda")
    block_size: int = _arg(16, "tokens per KV cache block")
    max_num_seqs: int = _arg(64, "most requests in one step")
    max_num_batched_tokens: int | None = _arg(
        None, "token budget of one step (default: 256 on CPU, 8192 on GPU)"
    )
    max_num_partial_prefills: int = _arg(
        1,
        "requests whose prompt is part-way through chunked prefill at once, as vLLM's flag: "
        "a prefill chunk that leaves its prompt unfinished needs one of these slots, one that "
        "finishes it does not (so short prompts are never held back by it)",
    )
    max_long_partial_prefills: int = _arg(
        1,
        "of --max-num-partial-prefills, those with more than --long-prefill-token-threshold "
        "tokens still to prefill; a long prompt that finds them taken waits, and shorter "
        "prompts behind it go first (vLLM's flag); at most --max-num-partial-prefills",
    )
    long_prefill_token_threshold: int | None = _arg(
        None,
        "most prompt tokens one request prefills in a step, and the length above which a "
        "prefill counts as long (vLLM's flag); 0 caps nothing but the step budget. Default: "
        "vLLM's, 0, or 4 percent of --max-model-len with --max-num-partial-prefills above 1; "
        "and on CPU, but for --task embed, 64 in a step that also decodes, where a step's "
        "prefill tokens set the ITL of the streams decoding beside them",
    )
    prefill_time_beside_decodes: float | None = _arg(
        None,
        "in a step that also decodes, cap its prompt tokens, all prefills together, at those "
        "that take about this many times as long as its decodes alone, both as recent steps' "
        "times show them (at least 32 tokens), so that a stream decoding beside prefills waits "
        "about 1 + this times a step of decodes for its token; 0 turns it off. Default: on "
        "CPU 1 (until the steps have shown their times, 64 tokens), but for --task embed, with "
        "--long-prefill-token-threshold or with --async-scheduling; on GPU 0",
    )
    max_model_len: int | None = _arg(None, "longest prompt plus output (default: the model's)")
    num_kv_blocks: int | None = _arg(None, "KV cache blocks (overrides the memory budgets)")
    kv_cache_memory: int | None = _arg(
        None, "KV cache bytes on CPU, e.g. 4GiB (default 4GiB)", unit="bytes"
    )
    gpu_memory_utilization: float = _arg(0.9, "share of GPU memory for the engine")
    enable_prefix_caching: bool = _arg(True, "automatic prefix caching")
    disable_hybrid_kv_cache_manager: bool = _arg(
        False,
        "give a model with sliding-window layers beside full ones (Gemma 3, gpt-oss) one "
        "block table for all its layers, as vLLM's flag: the sliding layers then keep their "
        "whole history (by default they free what leaves their window, on the CPU)",
    )
    attention_backend: str = _arg(
        "auto", "paged attention implementation", choices=ATTENTION_BACKENDS
    )
    enforce_eager: bool = _arg(False, "CUDA only: run decode steps without CUDA graphs")
    async_scheduling: bool | None = _arg(
        None,
        "schedule and launch each step before the last one's output is applied, so that on a "
        "GPU the host's work overlaps the device's (default: on for CUDA, off on CPU, where "
        "the forward pass runs on the same cores and nothing overlaps)",
    )
    speculative_config: str | None = _arg(
        None,
        "speculative decoding, as vLLM's --speculative-config: a JSON object such as "
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 5} (drafts from the request\'s own earlier tokens; prompt_lookup '
        'bounds default to 2 and 5) or {"method": "suffix", "num_speculative_tokens": 4} '
        "(drafts from suffix tries over the request's tokens and recent requests' outputs; "
        'vLLM\'s suffix_decoding_* keys) or {"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 4} (greedy drafts from a smaller model of the same '
        'tokenizer, with its own KV cache; optional "quantization" as --quantization); '
        "greedy output is unchanged and sampled output keeps its distribution; turns async "
        "scheduling off",
    )
    num_threads: int | None = _arg(None, "torch CPU threads (default: the CPUs available)")
    cpu_isa: str = _arg(
        "auto",
        "instruction set of the native CPU kernels, process-wide: auto (the best this CPU "
        "runs) or a set the build holds and this CPU runs (avx512_bf16, avx512, avx2, "
        "portable), to step down from a kernel that is wrong on this CPU",
    )
    quantization: str = _arg(
        "auto",
        "weight-only quantization: int8 (per channel) or int4 (groups) made at load time; gguf "
        "runs a GGUF file's Q4_0/Q4_1/Q8_0 weights as stored; none serves float weights; auto "
        "is gguf when the model has a GGUF file (CPU), else none",
        choices=QUANTIZATIONS,
    )
    quantization_group_size: int = _arg(32, "int4 group size", choices=(32, 64))
    quantize_lm_head: bool | None = _arg(
        None,
        "int8/int4 also quantize the LM head (default: int8 does, in groups of 32, which cost "
        "no accuracy measured on the default model; int4 does not)",
    )
    quantization_dense_copy: bool = _arg(
        True,
        "quantized weights also kept dequantized in --dtype, for steps of more than "
        f"{DENSE_COPY_ROWS} tokens "
        "(prefill, batched decode), where a dense GEMM is faster; costs the float weights' "
        "memory on top of the quantized ones",
    )
    tensor_parallel_size: int = _arg(
        1,
        "shard the model over this many worker processes (Megatron-style; gloo on CPU, NCCL "
        "on GPU, one GPU each); float weights only",
    )
    engine_in_process: bool = _arg(
        False,
        "run the engine core (scheduler, KV cache, model) in the server's process, sharing "
        "its GIL with the HTTP side; by default it runs in a process of its own",
    )
    kv_events_config: str | None = _arg(
        None,
        "KV cache events for prefix-aware routers, as vLLM's --kv-events-config: a JSON "
        'object such as {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
        '"topic": "kv@POD@MODEL"}',
    )
    enable_lora: bool = _arg(
        False,
        "serve LoRA adapters (PEFT directories): those of --lora-modules, and those loaded at "
        "run time with POST /v1/load_lora_adapter; a request names an adapter as its model",
    )
    lora_modules: list[str] = field(
        default_factory=list,
        metadata={
            "help": "LoRA adapters served from the start, as vLLM's --lora-modules: name=path, "
            'or a JSON object {"name": ..., "path": ..., "base_model_name": ...}'
        },
    )
    max_loras: int = _arg(1, "LoRA adapters one step runs at most (their weights' slots)")
    max_lora_rank: int = _arg(16, "the highest LoRA rank served")
    max_cpu_loras: int | None = _arg(
        None, "LoRA adapters kept loaded in host memory (default: --max-loras)"
    )


@dataclass(frozen=True)
class EngineHooks:
    """Instrumentation for tests and benchmarks, in one place; production sets none of it."""

    # Verify the KV block pool after every step (slow).
    check_invariants: bool = False
    # Fault injection: the step after this many raises.
    fail_after_steps: int | None = None
    # Fault injection: every step first sleeps this long (a slow or stalled device).
    step_delay: float = 0.0
    # Accumulate where step time goes (see engine.worker.step_profiler).
    profile: bool = False


@dataclass(frozen=True)
class ModelConfig:
    path: Path  # a Hugging Face directory (config.json, tokenizer, weights or the GGUF file)
    # Set when the model is a bare .gguf file: config and tokenizer come from it.
    gguf_file: str | None
    arch: ModelArch
    max_model_len: int
    # A GGUF file holding the weights: the model file itself, or the one in the directory.
    gguf: Path | None = None
    # Set when the engine serves embeddings (--task embed): how it pools.
    pooler: PoolerConfig | None = None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def task(self) -> str:
        """What the engine serves (--task, resolved): embed or generate."""
        return "generate" if self.pooler is None else "embed"

    @property
    def weights(self) -> Path:
        return self.path / self.gguf_file if self.gguf_file else self.path


@dataclass(frozen=True)
class QuantConfig:
    """Weight-only quantization as the engine runs it (see engine/models/quantized.py)."""

    method: str = "none"  # "none", "gguf", "int8" or "int4"
    group_size: int = 32  # int4 only
    lm_head: bool = False  # int8/int4: the LM head too
    dense_copy: bool = False  # also the weights dequantized, for steps of many tokens

    def describe(self) -> str:
        copy = f", dense copy for steps of over {DENSE_COPY_ROWS} tokens" if self.dense_copy else ""
        if self.method == "int4":
            head = ", LM head too" if self.lm_head else ""
            return f"int4 (groups of {self.group_size}){head}{copy}"
        if self.method == "int8":
            head = ", LM head too (groups of 32)" if self.lm_head else ""
            return f"int8 (per channel){head}{copy}"
        return f"GGUF as stored{copy}" if self.method == "gguf" else "none"


@dataclass(frozen=True)
class KernelChoice:
    """The native CPU kernels' instruction set the engine runs (--cpu-isa), and the sets
    it could have run; decided by the worker."""

    isa: str | None  # the set every native op runs; None when the kernels are unavailable
    forced: bool = False  # by --cpu-isa, rather than the best this CPU runs
    built: tuple[str, ...] = ()  # every set the build holds, best first
    supported: tuple[str, ...] = ()  # the built sets this CPU runs, best first
    reason: str = ""  # why the kernels are unavailable

    def facts(self) -> list[tuple[str, str]]:
        if self.isa is None:
            return [("native kernels", f"unavailable ({self.reason})")]
        how = "forced by --cpu-isa" if self.forced else "auto: best this CPU runs"
        return [
            ("native kernels", f"{self.isa} ({how})"),
            ("kernels built", " ".join(self.built)),
            ("kernels this CPU runs", " ".join(self.supported)),
        ]


@dataclass(frozen=True)
class DeviceConfig:
    """Decided by the worker from EngineArgs and the machine."""

    device: str  # "cpu", "cuda" or "cuda:N"
    dtype: str  # "float32", "bfloat16" or "float16"
    attention_backend: str  # concrete: "torch", "cpu-native" or "flashinfer"
    attention_reason: str  # why that backend ("requested", "auto: ...")
    native_kernels: KernelChoice | None  # CPU: the native kernels; None on CUDA
    num_threads: int  # CPU: torch threads for steps big enough to use them
    # Batch sizes of the captured decode graphs; empty when steps run eagerly.
    cuda_graph_sizes: tuple[int, ...] = ()
    cuda_graphs_off: str = ""  # CUDA: why there are no graphs ("" when there are)

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    def facts(self) -> list[tuple[str, str]]:
        """What runs here, as (name, value) pairs: `pagedserve info` prints one per line,
        the engine's startup log line joins them."""
        facts = [
            ("device", self.device),
            ("dtype", self.dtype),
            ("attention", f"{self.attention_backend} ({self.attention_reason})"),
        ]
        if self.native_kernels is not None:
            facts.extend(self.native_kernels.facts())
        facts.append(("torch threads", str(self.num_threads)))
        if self.device_type == "cpu":
            facts.append(("huge pages", _huge_pages_fact()))
        if self.device_type == "cuda":
            graphs = f"decode batches {list(self.cuda_graph_sizes)}"
            facts.append(("CUDA graphs", graphs if self.cuda_graph_sizes else self.cuda_graphs_off))
        return facts


def _huge_pages_fact() -> str:
    """Whether the CPU's weights and KV cache sit in huge pages (engine/ops/hugepages.py)."""
    from engine.ops.hugepages import huge_pages

    mode = huge_pages()
    if mode in ("madvise", "always"):
        return f"weights and KV cache (transparent huge pages: {mode})"
    return f"none (transparent huge pages: {mode}; 4 KiB pages)"


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduling step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    # Schedule and launch step N+1 before step N's output is applied (see EngineCore).
    async_scheduling: bool = False
    # LoRA adapters running at once at most (--max-loras); 0 without LoRA.
    max_loras: int = 0
    # KV slots held beyond a sampling request's scheduled tokens, for a draft model to
    # write its drafts' keys and values (speculative decoding with draft_model); else 0.
    num_lookahead_tokens: int = 0
    # Chunked prefill's limits, as vLLM's flags of the same names (see PrefillSlots).
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0  # 0: no cap but the budget, and no prefill is long
    # The most prompt tokens, all prefills together, in a step that also decodes (0: none
    # but the above); a default of the device, where the threshold was not given.
    prefill_chunk_beside_decodes: int = 0
    # The same cap in time, as a multiple of a step of decodes alone (Scheduler.
    # prefill_tokens_beside_decodes); prefill_chunk_beside_decodes until that is known. 0: off.
    prefill_time_beside_decodes: float = 0.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        check_partial_prefills(
            self.max_num_partial_prefills,
            self.max_long_partial_prefills,
            self.long_prefill_token_threshold,
            self.max_model_len,
        )
        check_prefill_time(self.prefill_time_beside_decodes, self.async_scheduling)

    def describe_prefill_limits(self) -> str:
        """The partial-prefill limits for the startup line, "" where they are vLLM's defaults
        (the budget alone chunks prompts)."""
        parts = []
        if self.long_prefill_token_threshold:
            parts.append(f"prefill chunks of at most {self.long_prefill_token_threshold} tokens")
        if self.prefill_time_beside_decodes:
            until = self.prefill_chunk_beside_decodes or "no cap"
            parts.append(
                f"prompt tokens of {self.prefill_time_beside_decodes:g}x the decodes' time at "
                f"most beside decodes (until timed, {until})"
            )
        elif self.prefill_chunk_beside_decodes:
            parts.append(
                f"at most {self.prefill_chunk_beside_decodes} prompt tokens beside decodes"
            )
        if self.max_num_partial_prefills > 1:
            parts.append(
                f"{self.max_num_partial_prefills} partial prefills at once "
                f"({self.max_long_partial_prefills} long)"
            )
        return "".join(f", {part}" for part in parts)


def check_prefill_time(ratio: float | None, async_scheduling: bool | None) -> None:
    """Raises ValueError for a --prefill-time-beside-decodes that cannot run: the steps are
    timed one at a time, which overlapped steps are not."""
    if ratio is None or ratio == 0:
        return
    if not 0 < ratio < float("inf"):
        raise ValueError(f"--prefill-time-beside-decodes must be 0 (off) or positive, got {ratio}")
    if async_scheduling:
        raise ValueError(
            "--prefill-time-beside-decodes does not run with --async-scheduling: it times "
            "each step, and overlapped steps have no time of their own"
        )


def check_partial_prefills(
    max_partial: int, max_long: int, threshold: int | None, max_model_len: int | None = None
) -> None:
    """Raises ValueError, naming the flag, for limits that chunked prefill cannot honour;
    `max_model_len` None (not known yet) skips the check against it."""
    if max_partial < 1:
        raise ValueError(f"--max-num-partial-prefills must be at least 1, got {max_partial}")
    if not 1 <= max_long <= max_partial:
        raise ValueError(
            f"--max-long-partial-prefills must be between 1 and --max-num-partial-prefills "
            f"({max_partial}), got {max_long}"
        )
    if threshold is None:
        return
    if threshold < 0:
        raise ValueError(
            f"--long-prefill-token-threshold must be 0 (off) or positive, got {threshold}"
        )
    if max_model_len is not None and threshold > max_model_len:
        raise ValueError(
            f"--long-prefill-token-threshold ({threshold}) cannot be greater than "
            f"max_model_len ({max_model_len})"
        )


@dataclass(frozen=True)
class CacheConfig:
    """Shape of the paged KV cache. `num_blocks` is final: sizing happens before this."""

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
    # A hybrid model's KV cache groups (engine/kv_cache/groups.py); None: one group, a
    # K/V pair per layer.
    groups: KVCacheGroups | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {self.num_blocks}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything decided: the engine runs from this alone."""

    model: ModelConfig
    device: DeviceConfig
    scheduler: SchedulerConfig
    cache: CacheConfig
    quant: QuantConfig = QuantConfig()
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None

    def facts(self) -> list[tuple[str, str]]:
        return runtime_facts(self.device, self.quant)

    def describe(self) -> str:
        """One line for the startup log: the model, facts() and the limits."""
        c, s = self.cache, self.scheduler
        facts = ", ".join(f"{name} {value}" for name, value in self.facts())
        task = " (embeddings)" if self.model.pooler is not None else ""
        return (
            f"{self.model.name}{task}: {facts}, {c.num_blocks} KV blocks of {c.block_size} tokens"
            + ("" if c.groups is None else f" in {c.groups.describe()}")
            + f", max_model_len {s.max_model_len}, step budget {s.max_num_batched_tokens} tokens"
            + s.describe_prefill_limits()
            + ("" if self.speculative is None else f", speculative {self.speculative.describe()}")
            + ("" if self.lora is None else f", LoRA: {self.lora.max_loras} at once")
            + (", async scheduling" if s.async_scheduling else "")
        )


def runtime_facts(device: DeviceConfig, quant: QuantConfig) -> list[tuple[str, str]]:
    """What runs here, as (name, value) pairs: `pagedserve info` prints one per line, the
    engine's startup log line joins them."""
    return [*device.facts(), ("quantization", quant.describe())]


def resolve_model_config(args: EngineArgs) -> ModelConfig:
    """Finds the model (preparing the bundled one when none is given) and reads its config."""
    if args.model is None:
        from engine.models.default_model import prepare_default_model

        model: str | Path = prepare_default_model()
    else:
        model = args.model
    folder, gguf_file = resolve_model_path(model)
    hf_config = load_hf_config(folder, gguf_file)
    arch = ModelArch.from_hf_config(hf_config, eos_token_ids(folder, hf_config))
    max_model_len = _max_model_len(args.max_model_len, arch)
    pooler = None
    if resolve_task(args.task, folder) == "embed":
        if args.tensor_parallel_size > 1:
            raise ValueError("--task embed runs on one process: use --tensor-parallel-size 1")
        pooler = read_pooler_config(folder, hf_config, arch.hidden_size)
    gguf = find_gguf_weights(folder, gguf_file)
    return ModelConfig(folder, gguf_file, arch, max_model_len, gguf, pooler)


def resolve_quant_config(args: EngineArgs, model: ModelConfig, device_type: str) -> QuantConfig:
    """What `--quantization` means for this model on this device; raises ValueError for a
    method that cannot run here."""
    method = args.quantization
    if args.tensor_parallel_size > 1:
        # Quantized kernels are CPU-only and tensor parallelism is for models that outgrow
        # one GPU: the pair would only shard a CPU's memory bandwidth among its own ranks.
        if method not in ("auto", "none"):
            raise ValueError(
                f"--quantization {method} cannot run with --tensor-parallel-size > 1: tensor "
                "parallelism shards float weights; use --quantization none"
            )
        method = "none"
    if method == "auto":
        method = "gguf" if model.gguf is not None and device_type == "cpu" else "none"
    if method != "none" and device_type != "cpu":
        raise ValueError(
            f"--quantization {method} runs on the CPU only; on {device_type} use "
            "--quantization none (a GGUF file's weights are then dequantized on load)"
        )
    if method == "gguf" and model.gguf is None:
        raise ValueError("--quantization gguf needs a GGUF file: the model has none")
    lm_head = args.quantize_lm_head
    if lm_head and method not in ("int8", "int4"):
        raise ValueError(
            f"--quantize-lm-head needs --quantization int8 or int4 (here: {method}); a GGUF "
            "file's LM head runs as stored"
        )
    return QuantConfig(
        method,
        args.quantization_group_size,
        method == "int8" if lm_head is None else lm_head,
        args.quantization_dense_copy and method != "none",
    )


def resolve_scheduler_config(
    args: EngineArgs, model: ModelConfig, device_type: str
) -> SchedulerConfig:
    budget = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS[device_type]
    check_scheduling_options(args)
    overlap = args.async_scheduling
    if overlap is None:
        overlap = (
            device_type == "cuda"
            and args.tensor_parallel_size == 1
            and args.speculative_config is None
        )
    lora = resolve_lora_config(args)
    max_loras = 0 if lora is None else lora.max_loras
    spec = parse_speculative_config(args.speculative_config)
    lookahead = spec.num_speculative_tokens if spec and spec.method == "draft_model" else 0
    return SchedulerConfig(
        args.max_num_seqs,
        budget,
        model.max_model_len,
        overlap,
        max_loras,
        lookahead,
        args.max_num_partial_prefills,
        args.max_long_partial_prefills,
        *resolve_prefill_chunks(args, model.max_model_len, device_type, model.task, overlap),
    )


def resolve_prefill_chunks(
    args: EngineArgs,
    max_model_len: int,
    device_type: str,
    task: str = "generate",
    async_scheduling: bool = False,
) -> tuple[int, int, float]:
    """(long_prefill_token_threshold, prefill_chunk_beside_decodes,
    prefill_time_beside_decodes): the threshold as given and no cap beside decodes but the
    one in time, if given; else vLLM's default threshold (4% of max_model_len where several
    partial prefills may run at once, as each then needs a cap below the budget, else 0) and
    this device's caps beside decodes for an engine that generates (an embedding engine has
    no decodes to keep waiting less), in time only where steps run one at a time."""
    ratio = args.prefill_time_beside_decodes
    if args.long_prefill_token_threshold is not None:
        return args.long_prefill_token_threshold, 0, ratio or 0.0
    threshold = int(max_model_len * 0.04) if args.max_num_partial_prefills > 1 else 0
    generates = task == "generate"
    beside = DEFAULT_PREFILL_CHUNK_BESIDE_DECODES[device_type] if generates else 0
    if ratio is None:
        timed = generates and not async_scheduling
        ratio = DEFAULT_PREFILL_TIME_BESIDE_DECODES[device_type] if timed else 0.0
    return threshold, beside, ratio


def resolve_lora_config(args: EngineArgs) -> LoRAConfig | None:
    """The LoRA limits with --enable-lora, else None; raises ValueError where LoRA cannot
    run as asked."""
    if not args.enable_lora:
        if args.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    if args.tensor_parallel_size > 1:
        raise ValueError(
            "--enable-lora does not run with --tensor-parallel-size > 1: the adapters' "
            "weights are not sharded"
        )
    if args.task == "embed":
        raise ValueError("--enable-lora is for generation; --task embed does not take adapters")
    max_cpu = args.max_loras if args.max_cpu_loras is None else args.max_cpu_loras
    modules = tuple(parse_lora_modules(args.lora_modules))
    return LoRAConfig(args.max_loras, args.max_lora_rank, max_cpu, modules)


def check_scheduling_options(args: EngineArgs) -> None:
    """Raises ValueError where chunked prefill's limits, --async-scheduling or
    --speculative-config cannot run."""
    check_partial_prefills(
        args.max_num_partial_prefills,
        args.max_long_partial_prefills,
        args.long_prefill_token_threshold,
        args.max_model_len,
    )
    check_prefill_time(args.prefill_time_beside_decodes, args.async_scheduling)
    if args.async_scheduling and args.tensor_parallel_size > 1:
        raise ValueError(
            "--async-scheduling does not run with --tensor-parallel-size > 1: the workers "
            "take each step's input ids from the host, which has not seen the last tokens yet"
        )
    if parse_speculative_config(args.speculative_config) is None:
        return
    if args.async_scheduling:
        raise ValueError(
            "--speculative-config does not run with --async-scheduling: drafts are proposed "
            "from the tokens the last step accepted"
        )
    if args.tensor_parallel_size > 1:
        raise ValueError("--speculative-config does not run with --tensor-parallel-size > 1")
    if args.task == "embed":
        raise ValueError("--speculative-config is for generation; --task embed samples nothing")


def _max_model_len(requested: int | None, arch: ModelArch) -> int:
    limit, why = arch.context_limit()
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len {requested} exceeds what the model supports ({limit}{why})"
        )
    return requested


def load_tokenizer(model: ModelConfig) -> Any:
    """The model's Hugging Face tokenizer, from its directory (or GGUF file). From a GGUF
    file, with the chat template the file holds (`tokenizer.chat_template`, which
    llama.cpp's converter writes and llama-server applies): transformers' GGUF tokenizer
    leaves it out."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model.path, gguf_file=model.gguf_file)
    if model.gguf_file is not None and not getattr(tokenizer, "chat_template", None):
        from engine.models.gguf_file import GGUFFile

        template = GGUFFile(model.path / model.gguf_file).metadata.get("tokenizer.chat_template")
        if isinstance(template, str) and template.strip():
            tokenizer.chat_template = template
    return tokenizer
