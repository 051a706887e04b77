"""ModelRunner: turns a SchedulerOutput into sampled tokens (an embedding engine's: into
embeddings, engine/worker/pooler.py).

One flat batch per step with no per-request padding; logits only at the rows that
sample (and at prompt rows whose logprobs were asked for), where constrained requests'
grammars mask the logits before sampling. The step's metadata is built
once on the host and uploaded once: on CUDA through pinned buffers, and a decode-only step
may replay a CUDA graph (its metadata then covers the padded batch).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from engine.attention import create_backend
from engine.attention.backend import AttentionBackend, allocate_kv_cache
from engine.attention.flashinfer_backend import FlashInferAttentionBackend
from engine.attention.metadata import (
    AttentionMetadata,
    StepMetadata,
    build_step_metadata,
    host_tensors,
    upload,
)
from engine.config import CacheConfig, DeviceConfig
from engine.models.arch import ModelArch
from engine.models.llama import DecoderModel
from engine.outputs import Logprobs
from engine.pooling import PoolerConfig
from engine.scheduler.output import ModelRunnerOutput, SchedulerOutput
from engine.worker.cpu_threads import StepThreads
from engine.worker.cuda_graphs import CudaGraphConfig, CudaGraphRunner, pad_decode_batch
from engine.worker.grammar_bitmask import GrammarBitmask
from engine.worker.input_batch import InputBatch, StepBatch
from engine.worker.pinned_buffers import PinnedBuffers
from engine.worker.pooler import LastTokenPooler
from engine.worker.sampler import Sampler, collect_logprobs
from engine.worker.step_profiler import StepProfiler


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        arch: ModelArch,
        cache_config: CacheConfig,
        device_config: DeviceConfig,
        profiler: StepProfiler | None = None,
        cuda_graphs: CudaGraphConfig | None = None,
        pooler: PoolerConfig | None = None,
    ) -> None:
        """With `cuda_graphs`, the cache gets one scratch block beyond cache_config.num_blocks
        (the KV cache manager never sees it) and the decoder is captured here. With `pooler`
        (an embedding engine), the requests that reach the end of their prompt are pooled
        instead of sampled."""
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
            device_config.attention_backend, self.kv_cache, arch.num_heads, arch.head_dim**-0.5
        )
        self.backend = self.profiler.wrap_backend(backend)
        on_cpu = self.device.type == "cpu"
        self.pinned = None if on_cpu else PinnedBuffers(self.device)
        self.threads = StepThreads(device_config.num_threads) if on_cpu else None
        self.graphs = None if cuda_graphs is None else self._capture(backend, cuda_graphs)
        self.input_batch = InputBatch(arch.eos_token_ids)
        self.sampler = Sampler(arch.vocab_size)
        self.pooler = None if pooler is None else LastTokenPooler(pooler)
        self.grammar_bitmask = GrammarBitmask(arch.vocab_size, self.device)

    def _capture(self, backend: AttentionBackend, config: CudaGraphConfig) -> CudaGraphRunner:
        if not isinstance(backend, FlashInferAttentionBackend):
            raise ValueError(f"CUDA graphs need the flashinfer backend, not {backend.name!r}")
        return CudaGraphRunner(self.model, self.kv_cache, config, backend.workspace)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Mutates the KV cache and the input batch."""
        with self.profiler.section("metadata"):
            batch = self.input_batch.update(scheduler_output)
        if not batch.requests:
            return ModelRunnerOutput({})
        with self._threads():
            hidden, host = self._forward(batch)  # (T, hidden)
            if self.pooler is not None:
                return self._pool(hidden, host, batch)
            return self._sample(hidden, host, batch)

    def _threads(self) -> Any:
        return nullcontext() if self.threads is None else self.threads.step()

    def _forward(self, batch: StepBatch) -> tuple[torch.Tensor, StepMetadata]:
        """Mutates the KV cache: runs the decoder on the step, through a graph if one fits."""
        graph_size = None if self.graphs is None else self.graphs.graph_size(batch.num_new)
        with self.profiler.section("metadata"):
            computed, new, tables = batch.num_computed, batch.num_new, batch.block_ids
            input_ids = batch.input_ids
            if graph_size is not None:
                assert self.graphs is not None
                scratch = self.graphs.scratch_block
                computed, new, tables = pad_decode_batch(computed, tables, graph_size, scratch)
                input_ids = np.pad(input_ids, (0, graph_size - len(input_ids)))
            host = build_step_metadata(computed, new, tables, self.block_size)
            md, ids = self._upload(host, input_ids)
            if graph_size is None:
                self.backend.plan(md)
        with self.profiler.section("forward"):
            if self.graphs is not None and graph_size is not None:
                return self.graphs.run(md, ids, len(batch.requests)), host
            return self.model(ids, md.positions, self.backend), host

    def _upload(
        self, host: StepMetadata, input_ids: np.ndarray
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """The step's metadata and input ids on the device, in one transfer on CUDA."""
        ids = torch.from_numpy(input_ids)
        if self.pinned is None:
            return upload(host), ids
        ids, *fields = self.pinned.to_device(ids, *host_tensors(host))
        return AttentionMetadata(host, *fields), ids

    def _sample(
        self, hidden: torch.Tensor, host: StepMetadata, batch: StepBatch
    ) -> ModelRunnerOutput:
        rows = batch.sample_rows
        with self.profiler.section("logits"):
            logits = self.model.compute_logits(self._last_hidden(hidden, host, rows))
        states = [batch.requests[r] for r in rows]
        with self.profiler.section("grammar"):
            self.grammar_bitmask.apply_to(logits, [s.request for s in states])
        with self.profiler.section("sampling"):
            sampled = self.sampler(logits, [s.sampling_row() for s in states])
            request_ids = [s.request.request_id for s in states]
            logprobs = {
                rid: lp
                for rid, lp in zip(request_ids, sampled.logprobs, strict=True)
                if lp is not None
            }
            prompt_logprobs = self._prompt_logprobs(hidden, host, batch)
        return ModelRunnerOutput(
            dict(zip(request_ids, sampled.token_ids, strict=True)), logprobs, prompt_logprobs
        )

    def _last_hidden(
        self, hidden: torch.Tensor, host: StepMetadata, rows: list[int]
    ) -> torch.Tensor:
        """The hidden state of each of `rows`' last token this step, in `rows` order."""
        if len(rows) == len(hidden):
            # Every token is its request's last, in batch order (a decode step): the hidden
            # states are already those rows.
            return hidden
        last_tokens = host.qo_indptr[1:][rows].astype(np.int64) - 1
        return hidden[torch.from_numpy(last_tokens).to(self.device)]

    def _pool(
        self, hidden: torch.Tensor, host: StepMetadata, batch: StepBatch
    ) -> ModelRunnerOutput:
        """The embeddings of the requests whose prompt ends this step (sample_rows)."""
        assert self.pooler is not None
        rows = batch.sample_rows
        if not rows:
            return ModelRunnerOutput({})
        with self.profiler.section("pooling"):
            last = self._last_hidden(hidden, host, rows)
            pooled = self.pooler(last, [batch.requests[r].request for r in rows])
        return ModelRunnerOutput({}, pooled=pooled)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, host: StepMetadata, batch: StepBatch
    ) -> dict[str, list[Logprobs]]:
        """Logprobs of the prompt tokens whose predecessors were computed this step.

        The hidden state at position j predicts token j + 1, so a chunk covering positions
        start..end-1 yields the logprobs of prompt tokens start+1..min(end, P-1).
        """
        result = {}
        for row in batch.prompt_logprob_rows:
            request = batch.requests[row].request
            start = batch.num_computed[row]
            stop = min(start + batch.num_new[row], request.num_prompt_tokens - 1)
            first = int(host.qo_indptr[row])
            hidden_rows = hidden[first : first + (stop - start)]
            logprobs = torch.log_softmax(self.model.compute_logits(hidden_rows), dim=-1)
            targets = request.prompt_token_ids[start + 1 : stop + 1]
            num_top = [request.sampling_params.prompt_logprobs] * len(targets)
            entries = collect_logprobs(logprobs, targets, num_top)
            result[request.request_id] = [e for e in entries if e is not None]
        return result
