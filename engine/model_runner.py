"""ModelRunner: turns a SchedulerOutput into sampled tokens.

One flat batch per step with no per-request padding; logits only at the rows that
sample (and at prompt rows whose logprobs were asked for). On CUDA, the host-built metadata
reaches the GPU through pinned buffers, and decode-only steps may replay a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.attention import create_backend
from engine.attention.backend import AttentionBackend, allocate_kv_cache
from engine.attention.flashinfer_backend import FlashInferAttentionBackend
from engine.attention.metadata import AttentionMetadata, build_attention_metadata
from engine.config import CacheConfig
from engine.cpu_threads import StepThreads
from engine.cuda_graphs import CudaGraphConfig, CudaGraphRunner
from engine.host_staging import PinnedStaging
from engine.models.arch import ModelArch
from engine.models.llama import DecoderModel
from engine.profiling import StepProfiler
from engine.runner_state import RunnerStates, StepBatch
from engine.sampler import Sampler, collect_logprobs
from engine.scheduler.output import Logprobs, ModelRunnerOutput, SchedulerOutput


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        arch: ModelArch,
        cache_config: CacheConfig,
        attention_backend: str,
        profiler: StepProfiler | None = None,
        cuda_graphs: CudaGraphConfig | None = None,
    ) -> None:
        """With `cuda_graphs`, the cache gets one scratch block beyond cache_config.num_blocks
        (the KV cache manager never sees it) and the decoder is captured here."""
        self.model = model
        self.arch = arch
        self.block_size = cache_config.block_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        scratch_blocks = 0 if cuda_graphs is None else 1
        self.kv_cache = allocate_kv_cache(
            arch.num_layers,
            cache_config.num_blocks + scratch_blocks,
            cache_config.block_size,
            arch.num_kv_heads,
            arch.head_dim,
            self.dtype,
            self.device,
        )
        self.profiler = profiler or StepProfiler(enabled=False)
        backend = create_backend(
            attention_backend, self.kv_cache, arch.num_heads, arch.head_dim**-0.5
        )
        self.backend = self.profiler.wrap_backend(backend)
        self.staging = PinnedStaging(self.device) if self.device.type == "cuda" else None
        self.graphs = None if cuda_graphs is None else self._capture(backend, cuda_graphs)
        self.states = RunnerStates(arch.eos_token_ids)
        self.sampler = Sampler(arch.vocab_size)
        cpu = self.device.type == "cpu"
        self.threads = StepThreads(torch.get_num_threads()) if cpu else None

    def _capture(self, backend: AttentionBackend, config: CudaGraphConfig) -> CudaGraphRunner:
        if not isinstance(backend, FlashInferAttentionBackend):
            raise ValueError(f"CUDA graphs need the flashinfer backend, not {backend.name!r}")
        return CudaGraphRunner(self.model, self.kv_cache, config, backend.workspace)

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Mutates the KV cache and the runner's request states."""
        with self.profiler.section("metadata"):
            batch = self.states.update(so)
            if not batch.request_ids:
                return ModelRunnerOutput({})
            if self.threads is not None:
                num_tokens = len(batch.input_ids)
                self.threads.apply(num_tokens, sum(batch.num_computed) + num_tokens)
        hidden = self._hidden_states(batch)  # (T, hidden)
        qo_indptr = np.concatenate(([0], np.cumsum(batch.num_new)))
        with self.profiler.section("sampling"):
            rows = batch.sample_rows
            logits = self.model.compute_logits(hidden[qo_indptr[1:][rows] - 1])
            states = [self.states.requests[batch.request_ids[r]] for r in rows]
            sampled = self.sampler(logits, [s.sampling_row() for s in states])
            request_ids = [batch.request_ids[r] for r in rows]
            self.states.append_sampled(request_ids, sampled.token_ids)
            prompt_logprobs = self._prompt_logprobs(hidden, batch, qo_indptr)
        logprobs = {
            rid: lp for rid, lp in zip(request_ids, sampled.logprobs, strict=True) if lp is not None
        }
        return ModelRunnerOutput(
            dict(zip(request_ids, sampled.token_ids, strict=True)), logprobs, prompt_logprobs
        )

    def _hidden_states(self, batch: StepBatch) -> torch.Tensor:
        """Mutates the KV cache: runs the decoder on the step, through a graph if one fits."""
        if self.graphs is not None and self.graphs.fits(batch.num_new):
            assert self.staging is not None  # graphs exist only on CUDA
            with self.profiler.section("forward"):
                return self.graphs.run(
                    batch.input_ids, batch.num_computed, batch.block_ids, self.staging
                )
        return self._eager_hidden_states(batch)

    def _eager_hidden_states(self, batch: StepBatch) -> torch.Tensor:
        """Mutates the KV cache: plans the attention backend and runs the decoder eagerly."""
        with self.profiler.section("metadata"):
            md, input_ids = self._step_inputs(batch)
            self.backend.plan(md)
        with self.profiler.section("forward"):
            return self.model(input_ids, md.positions, self.backend)

    def _step_inputs(self, batch: StepBatch) -> tuple[AttentionMetadata, torch.Tensor]:
        """The step's metadata and input ids on the device; on CUDA via pinned buffers."""
        if self.staging is None:
            md = build_attention_metadata(
                batch.num_computed, batch.num_new, batch.block_ids, self.block_size, self.device
            )
            return md, torch.from_numpy(batch.input_ids).to(self.device)
        md = build_attention_metadata(
            batch.num_computed, batch.num_new, batch.block_ids, self.block_size, "cpu"
        )
        return self.staging.step_inputs(md, batch.input_ids)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, batch: StepBatch, qo_indptr: np.ndarray
    ) -> dict[str, list[Logprobs]]:
        """Logprobs of the prompt tokens whose predecessors were computed this step.

        The hidden state at position j predicts token j + 1, so a chunk covering positions
        start..end-1 yields the logprobs of prompt tokens start+1..min(end, P-1).
        """
        result = {}
        for row in batch.prompt_logprob_rows:
            state = self.states.requests[batch.request_ids[row]]
            start = batch.num_computed[row]
            stop = min(start + batch.num_new[row], state.num_prompt_tokens - 1)
            hidden_rows = hidden[qo_indptr[row] : qo_indptr[row] + (stop - start)]
            logprobs = torch.log_softmax(self.model.compute_logits(hidden_rows), dim=-1)
            targets = state.prompt_token_ids[start + 1 : stop + 1]
            num_top = [state.params.prompt_logprobs] * len(targets)
            entries = collect_logprobs(logprobs, targets, num_top)
            result[state.request_id] = [e for e in entries if e is not None]
        return result
