"""A tensor-parallel worker process (rank >= 1): loads its shard, then runs the driver's
commands until told to stop (see tensor_parallel.py for the protocol)."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import StepMetadata, upload
from engine.config import DeviceConfig, EngineArgs, ModelConfig
from engine.models.parallel import TensorParallelDecoder
from engine.worker.memory_profiler import cache_and_backend, profile_gpu_memory

logger = logging.getLogger(__name__)


def run_worker(
    args: EngineArgs, model: ModelConfig, device: DeviceConfig, rank: int, size: int, port: int
) -> None:
    """The process's entry point. Exits when the driver says stop, or with an error when
    the driver (or another rank) goes away."""
    from engine.worker.tensor_parallel import join_group
    from engine.worker.worker import load_shard

    logging.basicConfig(level=logging.INFO, format=f"tp{rank} %(levelname)s %(message)s")
    if device.device_type == "cuda":
        torch.cuda.set_device(rank)
        device = replace(device, device=f"cuda:{rank}")
    torch.set_num_threads(device.num_threads)
    commands = join_group(rank, size, port, device.device_type)
    shard = load_shard(args, model, device, rank, size)
    dist.barrier(group=commands)
    ShardWorker(shard, device, commands).run()
    dist.destroy_process_group()


class ShardWorker:
    def __init__(
        self, model: TensorParallelDecoder, device: DeviceConfig, commands: dist.ProcessGroup
    ) -> None:
        self.model = model
        self.device = torch.device(device.device)
        self.device_config = device
        self.commands = commands
        self.backend: AttentionBackend | None = None

    def run(self) -> None:
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=self.commands)
            kind, *payload = box[0]
            if kind == "stop":
                return
            with torch.inference_mode():
                getattr(self, f"_{kind}")(*payload)

    def _kv_cache(self, num_blocks: int, block_size: int) -> None:
        name = self.device_config.attention_backend
        _, self.backend = cache_and_backend(self.model, name, num_blocks, block_size)

    def _forward(self, host: StepMetadata, input_ids: np.ndarray) -> None:
        assert self.backend is not None, "the driver sends kv_cache before any step"
        md = upload(host, self.device)
        self.backend.plan(md)
        self.model(torch.from_numpy(input_ids).to(self.device), md.positions, self.backend)

    def _logits(self, shape: tuple[int, int]) -> None:
        rows = torch.empty(shape, dtype=self.model.norm.weight.dtype, device=self.device)
        dist.broadcast(rows, src=0)
        self.model.compute_logits(rows)

    def _profile(self, *limits: int) -> None:
        profile_gpu_memory(self.model, self.device_config.attention_backend, *limits)
