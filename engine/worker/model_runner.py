"""ModelRunner: turns a SchedulerOutput into sampled tokens (an embedding engine's: into
embeddings, engine/worker/pooler.py).

One flat batch per step with no per-request padding; logits only at the rows that
sample (and at prompt rows whose logprobs were asked for), where constrained requests'
grammars mask the logits before sampling. The step's metadata is built
once on the host and uploaded once: on CUDA through pinned buffers, and a decode-only step
may replay a CUDA graph (its metadata then covers the padded batch).
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.attention.backend import AttentionBackend
from engine.attention.flashinfer_backend import FlashInferAttentionBackend
from engine.attention.metadata import (
    AttentionMetadata,
    StepMetadata,
    build_step_metadata,
    device_metadata,
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
from engine.worker.draft_runner import DraftModelRunner, paged_kv_cache
from engine.worker.grammar_bitmask import GrammarBitmask
from engine.worker.input_batch import InputBatch, StepBatch
from engine.worker.lora_manager import LoRAManager
from engine.worker.pinned_buffers import PinnedBuffers
from engine.worker.pooler import LastTokenPooler
from engine.worker.sampler import (
    LogprobTensors,
    Sampler,
    SamplingRow,
    collect_logprobs,
    to_logprobs,
)
from engine.worker.step_profiler import StepProfiler


@dataclass(frozen=True)
class ForwardStep:
    """A step whose forward has been launched: its batch, hidden states and metadata."""

    batch: StepBatch
    hidden: torch.Tensor  # (num_tokens, hidden_size)
    host: StepMetadata


class PendingOutput:
    """A step's sampled tokens (and logprobs) on their way to the host: on CUDA they are
    copied into pinned memory without blocking, and `result()` waits for that copy only,
    not for whatever the device was given to run after it."""

    def __init__(
        self,
        request_ids: list[str],
        tokens: torch.Tensor,
        logprobs: LogprobTensors | None,
        num_top: list[int | None],
        prompt_logprobs: dict[str, list[Logprobs]],
        verified: tuple[dict[str, int], dict[str, list[int]], dict[str, list[Logprobs]]] = (
            {},
            {},
            {},
        ),
        drafted: dict[str, list[int]] | None = None,
    ) -> None:
        """`verified`: the tokens and accepted drafts of the rows that verified drafts
        (speculative decoding), already on the host; `drafted`: a draft model's drafts for
        the next step."""
        self._request_ids = request_ids
        self._verified = verified
        self._drafted = drafted or {}
        self._num_top = num_top
        self._prompt_logprobs = prompt_logprobs
        self._copied: torch.cuda.Event | None = None
        device = tokens.device
        if device.type == "cuda":
            tokens = _to_host(tokens)
            if logprobs is not None:
                logprobs = logprobs.map(_to_host)
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(device))
        self._tokens = tokens
        self._logprobs = logprobs
        self._result: ModelRunnerOutput | None = None

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> PendingOutput:
        pending = cls.__new__(cls)
        pending._result = output
        return pending

    def result(self) -> ModelRunnerOutput:
        if self._result is not None:
            return self._result
        if self._copied is not None:
            self._copied.synchronize()
        tokens = self._tokens.tolist()
        logprobs = {}
        if self._logprobs is not None:
            entries = to_logprobs(self._logprobs, tokens, self._num_top)
            logprobs = {
                rid: lp
                for rid, lp in zip(self._request_ids, entries, strict=True)
                if lp is not None
            }
        verified_tokens, accepted, spec_logprobs = self._verified
        sampled = dict(zip(self._request_ids, tokens, strict=True)) | verified_tokens
        self._result = ModelRunnerOutput(
            sampled,
            logprobs,
            self._prompt_logprobs,
            accepted_draft_ids=accepted,
            spec_logprobs=spec_logprobs,
            draft_token_ids=self._drafted,
        )
        return self._result


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a device tensor, made without blocking the host."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


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
        lora: LoRAManager | None = None,
        drafter: DraftModelRunner | None = None,
    ) -> None:
        """With `cuda_graphs`, the cache gets one scratch block beyond cache_config.num_blocks
        (the KV cache manager never sees it) and the decoder is captured here. With `pooler`
        (an embedding engine), the requests that reach the end of their prompt are pooled
        instead of sampled. With `drafter` (speculative decoding with a draft model), the
        draft model runs over every step and drafts after it."""
        self.model = model
        self.arch = arch
        self.lora = lora
        self.drafter = drafter
        self.block_size = cache_config.block_size
        self.num_kv_groups = 1 if cache_config.groups is None else cache_config.groups.num_groups
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        scratch_blocks = 0 if cuda_graphs is None else 1
        self.kv_cache, backend = paged_kv_cache(
            model, arch, cache_config, device_config.attention_backend, scratch_blocks
        )
        self.profiler = profiler or StepProfiler(enabled=False)
        self.backend = self.profiler.wrap_backend(backend)
        on_cpu = self.device.type == "cpu"
        self.pinned = None if on_cpu else PinnedBuffers(self.device)
        self.threads = StepThreads(device_config.num_threads) if on_cpu else None
        self.graphs = None if cuda_graphs is None else self._capture(backend, cuda_graphs)
        self.input_batch = InputBatch(arch.eos_token_ids)
        self.sampler = Sampler(arch.vocab_size)
        self.pooler = None if pooler is None else LastTokenPooler(pooler)
        self.grammar_bitmask = GrammarBitmask(arch.vocab_size, self.device)
        # The last step's sampled tokens, on the device, and each request's row in them.
        self._last_sampled = torch.zeros(0, dtype=torch.long, device=self.device)
        self._last_sampled_rows: dict[str, int] = {}
        # Recorded once a step's inputs have gone to the device (CUDA).
        self._inputs_sent: torch.cuda.Event | None = None

    def _capture(self, backend: AttentionBackend, config: CudaGraphConfig) -> CudaGraphRunner:
        if not isinstance(backend, FlashInferAttentionBackend):
            raise ValueError(f"CUDA graphs need the flashinfer backend, not {backend.name!r}")
        return CudaGraphRunner(self.model, self.kv_cache, config, backend.workspace)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Mutates the KV cache and the input batch: one whole step, synchronously."""
        step = self.forward(scheduler_output)
        if step is None:
            return ModelRunnerOutput({})
        return self.sample(step).result()

    @torch.inference_mode()
    def forward(self, scheduler_output: SchedulerOutput) -> ForwardStep | None:
        """Mutates the KV cache and the input batch: the step's forward, launched (on a GPU
        it may still be running on return). None when nothing runs. A token the previous
        step sampled but the host has not seen yet (async scheduling) is read from that
        step's device tensor of sampled tokens."""
        with self.profiler.section("metadata"):
            batch = self.input_batch.update(scheduler_output)
        if not batch.requests:
            return None
        with self._threads(len(batch.input_ids)):
            hidden, host = self._forward(batch)
        return ForwardStep(batch, hidden, host)

    @torch.inference_mode()
    def sample(self, step: ForwardStep) -> PendingOutput:
        """Samples (or pools) the rows of `step` whose request is still unfinished: with
        async scheduling one may have ended on the output of the step before, applied
        after this step's forward was launched. The tokens come back to the host when the
        result is asked for."""
        with self._threads():
            if self.pooler is not None:
                return PendingOutput.ready(self._pool(step.hidden, step.host, step.batch))
            return self._sample(step.hidden, step.host, step.batch)

    def _threads(self, num_tokens: int | None = None) -> Any:
        """The step's CPU threads (StepThreads): a forward passes its token count."""
        return nullcontext() if self.threads is None else self.threads.step(num_tokens)

    def _forward(self, batch: StepBatch) -> tuple[torch.Tensor, StepMetadata]:
        """Mutates the KV cache: runs the decoder on the step, through a graph if one fits
        (not a step with LoRA adapters, whose segments the graphs do not know)."""
        adapted = False
        if self.lora is not None:
            self.lora.prepare([state.request.lora for state in batch.requests], batch.num_new)
            adapted = self.lora.step.active
        graph_size = None
        if self.graphs is not None and not adapted:
            graph_size = self.graphs.graph_size(batch.num_new)
        with self.profiler.section("metadata"):
            computed, new, tables = batch.num_computed, batch.num_new, batch.block_ids
            input_ids = batch.input_ids
            if graph_size is not None:
                assert self.graphs is not None
                scratch = self.graphs.scratch_block
                computed, new, tables = pad_decode_batch(computed, tables, graph_size, scratch)
                input_ids = np.pad(input_ids, (0, graph_size - len(input_ids)))
            host = build_step_metadata(computed, new, tables, self.block_size)
            if self._inputs_sent is not None:
                # The last step's host buffers (ours and FlashInfer's plan) are reused now.
                self._inputs_sent.synchronize()
            md, ids = self._upload(host, input_ids)
            if self.num_kv_groups > 1:  # a hybrid model's other groups: on the CPU only
                md = dataclasses.replace(md, groups=self._group_metadata(batch))
            if batch.placeholders:
                self._fill_placeholders(ids, batch.placeholders)
            if self.graphs is not None and graph_size is not None:
                self.graphs.prepare(md, ids)
            else:
                self.backend.plan(md)
            if self.device.type == "cuda":
                self._inputs_sent = torch.cuda.Event()
                self._inputs_sent.record(torch.cuda.current_stream(self.device))
        with self.profiler.section("forward"):
            if self.graphs is not None and graph_size is not None:
                hidden = self.graphs.replay(graph_size, len(batch.requests))
            else:
                hidden = self.model(ids, md.positions, self.backend)
        return hidden, host

    def _group_metadata(self, batch: StepBatch) -> tuple[AttentionMetadata, ...]:
        """The step's metadata over each KV cache group's tables after group 0's (the
        worker makes groups only where the cache is on the CPU: views, no copies)."""
        computed, new = batch.num_computed, batch.num_new
        return tuple(
            upload(build_step_metadata(computed, new, batch.group_block_ids(g), self.block_size))
            for g in range(1, self.num_kv_groups)
        )

    def _fill_placeholders(self, ids: torch.Tensor, placeholders: list[tuple[int, str]]) -> None:
        """Writes into `ids`, at each placeholder's position, the token the last step
        sampled for its request (still on the device)."""
        rows = self._last_sampled_rows
        positions = [position for position, _ in placeholders]
        sources = [rows[request_id] for _, request_id in placeholders]
        index = self._to_device(torch.tensor(positions + sources, dtype=torch.long))
        count = len(positions)
        ids[index[:count]] = self._last_sampled[index[count:]]

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A small host tensor on the device without waiting for the device's queue (a
        blocking copy would wait for the running step)."""
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _upload(
        self, host: StepMetadata, input_ids: np.ndarray
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """The step's metadata and input ids on the device, in one transfer on CUDA."""
        ids = torch.from_numpy(input_ids)
        if self.pinned is None:
            return upload(host), ids
        ids, *fields = self.pinned.to_device(ids, *host_tensors(host))
        return device_metadata(host, fields), ids

    def _sample(self, hidden: torch.Tensor, host: StepMetadata, batch: StepBatch) -> PendingOutput:
        live = [r for r in batch.sample_rows if not batch.requests[r].request.is_finished]
        rows = [r for r in live if not batch.num_drafts[r]]
        verified = self._verify(hidden, host, batch, [r for r in live if batch.num_drafts[r]])
        states = [batch.requests[r] for r in rows]
        request_ids = [s.request.request_id for s in states]
        if not rows:
            prompt_logprobs = self._prompt_logprobs(hidden, host, batch)
            drafted = self._draft(batch, [], None, live, verified)
            output = ModelRunnerOutput(
                verified[0], {}, prompt_logprobs, {}, verified[1], verified[2], drafted
            )
            return PendingOutput.ready(output)
        sampling_rows = [s.sampling_row() for s in states]
        last_hidden = self._last_hidden(hidden, host, rows)
        greedy: torch.Tensor | None = None
        if all(s.request.structured is None for s in states):
            with self.profiler.section("logits"):
                greedy = self._greedy_tokens(last_hidden, sampling_rows)
        if greedy is not None:
            tokens, logprobs = greedy, None
        else:
            with self.profiler.section("logits"):
                logits = self.model.compute_logits(last_hidden)
            with self.profiler.section("grammar"):
                self.grammar_bitmask.apply_to(logits, [s.request for s in states])
            with self.profiler.section("sampling"):
                tokens, logprobs = self.sampler.sample_on_device(logits, sampling_rows)
        with self.profiler.section("sampling"):
            self._last_sampled = tokens
            self._last_sampled_rows = {rid: i for i, rid in enumerate(request_ids)}
            num_top = [r.params.logprobs for r in sampling_rows]
            prompt_logprobs = self._prompt_logprobs(hidden, host, batch)
        drafted = self._draft(batch, rows, tokens, live, verified)
        return PendingOutput(
            request_ids, tokens, logprobs, num_top, prompt_logprobs, verified, drafted
        )

    def _greedy_tokens(self, hidden: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor | None:
        """The rows' greedy tokens from the model's head without the logits, where the
        model gives them and every row allows it (Sampler.lowered_tokens); a row whose raw
        argmax is a token its processing lowers is computed in full. None: the logits."""
        lowered = self.sampler.lowered_tokens(rows)
        if lowered is None:
            return None
        tokens = self.model.greedy_tokens(hidden, self.sampler.vocab_size)
        if tokens is None:
            return None
        redo = [i for i, token in enumerate(tokens.tolist()) if token in lowered[i]]
        if redo:
            index = torch.tensor(redo)
            logits = self.model.compute_logits(hidden[index])[:, : self.sampler.vocab_size]
            tokens[index] = self.sampler.sample(logits, [rows[i] for i in redo])
        return tokens

    def _draft(
        self,
        batch: StepBatch,
        rows: list[int],
        tokens: torch.Tensor | None,
        live: list[int],
        verified: tuple[dict[str, int], dict[str, list[int]], dict[str, list[Logprobs]]],
    ) -> dict[str, list[int]]:
        """A draft model's drafts after this step (none without one): `rows` sampled
        `tokens` plainly; the other `live` rows verified drafts (`verified`)."""
        if self.drafter is None:
            return {}
        sampled = dict(zip(rows, [] if tokens is None else tokens.tolist(), strict=True))
        verified_tokens, accepted, _ = verified
        num_valid = [n - d for n, d in zip(batch.num_new, batch.num_drafts, strict=True)]
        for r in live:
            rid = batch.requests[r].request.request_id
            if batch.num_drafts[r]:
                sampled[r] = verified_tokens[rid]
                num_valid[r] += len(accepted[rid])
        with self.profiler.section("draft"):
            return self.drafter.propose(batch, num_valid, sampled)

    def _verify(
        self, hidden: torch.Tensor, host: StepMetadata, batch: StepBatch, rows: list[int]
    ) -> tuple[dict[str, int], dict[str, list[int]], dict[str, list[Logprobs]]]:
        """Speculative decoding: each of `rows` verifies its drafts on the logits of its
        last num_drafts + 1 positions. Returns, by request id, the token each samples after
        the drafts it accepts, those drafts, and where asked for the logprobs of each (the
        raw distribution's at its position, as a plain step reports them)."""
        if not rows:
            return {}, {}, {}
        ends = host.qo_indptr[1:]
        spans = [(int(ends[r]) - batch.num_drafts[r] - 1, int(ends[r])) for r in rows]
        positions = np.concatenate([np.arange(a, b) for a, b in spans])
        with self.profiler.section("logits"):
            logits = self.model.compute_logits(hidden[self._to_device(torch.from_numpy(positions))])
        tokens, accepted, logprobs = {}, {}, {}
        with self.profiler.section("sampling"):
            first = 0
            for r, (a, b) in zip(rows, spans, strict=True):
                state = batch.requests[r]
                drafts = batch.input_ids[b - batch.num_drafts[r] : b].tolist()
                rid = state.request.request_id
                own = logits[first : first + b - a]
                self.grammar_bitmask.apply_to_drafts(own, state.request, drafts)
                accepted[rid], tokens[rid] = self.sampler.verify(own, state.sampling_row(), drafts)
                num_top = state.request.sampling_params.logprobs
                if num_top is not None:
                    out = [*accepted[rid], tokens[rid]]
                    raw = torch.log_softmax(own[: len(out), : self.arch.vocab_size], dim=-1)
                    entries = collect_logprobs(raw, out, [num_top] * len(out))
                    logprobs[rid] = [e for e in entries if e is not None]
                first += b - a
        return tokens, accepted, logprobs

    def _last_hidden(
        self, hidden: torch.Tensor, host: StepMetadata, rows: list[int]
    ) -> torch.Tensor:
        """The hidden state of each of `rows`' last token this step, in `rows` order."""
        if len(rows) == len(hidden):
            # Every token is its request's last, in batch order (a decode step): the hidden
            # states are already those rows.
            return hidden
        last_tokens = host.qo_indptr[1:][rows].astype(np.int64) - 1
        return hidden[self._to_device(torch.from_numpy(last_tokens))]

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
