"""Tensor parallelism, the driver's side: worker processes, their commands, their health.

The scheduler, the KV cache manager and sampling stay in the driver (rank 0, the engine's
own process, which also holds shard 0). Each step the driver sends the workers what it
computed on the host for its own shard, not the scheduler's output:

    ("forward", StepMetadata, input_ids)  every rank plans its attention and runs the decoder
    ("logits", (n, hidden))               every rank takes the driver's n hidden rows (a
                                          broadcast) and computes its vocabulary share

so workers keep no request state that could drift from the driver's, and need no Request
objects: a step costs one small pickle (block tables and token ids) plus the collectives.
Commands travel over a gloo group on the CPU; tensors over the device group (NCCL on GPU,
gloo on CPU). A watchdog thread notices a worker that exits and reports it in failure().
"""

from __future__ import annotations

import logging
import multiprocessing
import socket
import threading
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from engine.attention.metadata import AttentionMetadata, StepMetadata
from engine.config import DeviceConfig, EngineArgs, ModelConfig
from engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Long enough for every rank to load its weights; a collective stuck this long has failed.
TIMEOUT = timedelta(minutes=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join_group(rank: int, size: int, port: int, device_type: str) -> dist.ProcessGroup:
    """Joins the default group (NCCL on CUDA, gloo on CPU); returns a gloo group for
    commands."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size, timeout=TIMEOUT
    )
    return dist.new_group(backend="gloo", timeout=TIMEOUT)


class TensorParallelGroup:
    """Starts ranks 1..size-1 as processes and joins them as rank 0 (this process)."""

    def __init__(
        self, args: EngineArgs, model: ModelConfig, device: DeviceConfig, size: int
    ) -> None:
        from engine.worker.tp_worker import run_worker

        self.size = size
        port = free_port()
        context = multiprocessing.get_context("spawn")
        self.processes = [
            context.Process(
                target=run_worker,
                args=(args, model, device, rank, size, port),
                name=f"pagedserve-tp{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for process in self.processes:
            process.start()
        self._failure: str | None = None
        self._closing = False
        self.commands = join_group(0, size, port, device.device_type)
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()

    def wait_loaded(self) -> None:
        """Returns once every worker holds its shard; raises if one failed to load."""
        dist.barrier(group=self.commands)

    def send(self, *command: Any) -> None:
        """Mutates the workers: they run `command` next, in step with this process."""
        if self._failure is not None:
            raise RuntimeError(self._failure)
        dist.broadcast_object_list([command], src=0, group=self.commands)

    def broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=0)

    def failure(self) -> str | None:
        """Why the group cannot run steps any more (a worker exited), or None."""
        return self._failure

    def _watch(self) -> None:
        sentinels = {process.sentinel: process for process in self.processes}
        ready = wait(list(sentinels))
        if self._closing:
            return
        process = sentinels[ready[0]]  # type: ignore[index]
        process.join(timeout=1)
        self._failure = (
            f"tensor-parallel worker {process.name} exited (code {process.exitcode}); "
            "the engine cannot run steps without it"
        )
        logger.error("%s", self._failure)

    def close(self) -> None:
        """Stops the workers and leaves the process group."""
        self._closing = True
        if self._failure is None:
            try:
                self.send("stop")
            except RuntimeError:
                logger.warning("tensor-parallel workers did not take the stop command")
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        dist.destroy_process_group()


class TensorParallelRunner(ModelRunner):
    """Rank 0's model runner: before each step's forward, the workers get its inputs."""

    def __init__(self, *args: Any, group: TensorParallelGroup, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group

    def _upload(
        self, host: StepMetadata, input_ids: np.ndarray
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        self.group.send("forward", host, input_ids)
        return super()._upload(host, input_ids)
