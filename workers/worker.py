"""Worker: the body of one tensor-parallel rank (cluster/ray_executor.py runs it as a Ray actor, one
per GPU).

The executor drives every rank through the same calls in the same order: init_device (join the
process group), load_model (this rank's weight shards), determine_num_blocks, init_kv_cache, then
one execute_model per step. Only plain dataclasses come in and go out; tensors move between ranks
only through torch.distributed collectives inside the model.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeVar

import torch

from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from workers.distributed import destroy_distributed, free_port, init_distributed
from workers.runner import ModelRunner, RunnerConfig
from workers.step_channel import ChannelAddress, StepServer

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Worker:
    """One tensor-parallel rank: its process-group membership, model shard and KV cache."""

    def __init__(
        self, rank: int, world_size: int, config: RunnerConfig, num_threads: int | None = None
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: must be in [0, {world_size}), got {rank}")
        self.rank, self.world_size, self.config = rank, world_size, config
        self.num_threads = num_threads
        self.runner: ModelRunner | None = None
        self._step_server: StepServer | None = None

    def __repr__(self) -> str:
        # Ray prints the actor's repr in errors; the rank is what a reader needs to see.
        return f"Worker(rank={self.rank}, world_size={self.world_size})"

    def rendezvous_address(self) -> str:
        """host:port for the process group, on this rank's node (called on rank 0).

        The host is the address Ray registered for this node (127.0.0.1 on a loopback cluster).
        """
        host = self.node_host()
        return f"{host}:{free_port(host)}"

    def init_device(self, address: str, timeout_s: float = 300.0) -> None:
        """Pin the CPU thread count and join the process group."""
        self._pin_threads()
        init_distributed(
            self.rank,
            self.world_size,
            address,
            self.config.device,
            timeout_s,
            self.config.pipeline_parallel_size,
        )

    def open_step_channel(self) -> ChannelAddress:
        """Serve steps over a socket on this rank's node (the executor's fast path, see
        step_channel)."""
        self._step_server = StepServer(
            self.node_host(), self.execute_model_encoded, on_start=self._on_step_thread
        )
        return self._step_server.address

    def load_model(self) -> None:
        """Build the model for this rank (the layers read the rank at construction) and load its
        shards."""
        self.runner = ModelRunner(self.config)

    def determine_num_blocks(self) -> int:
        return self._ready().determine_num_blocks()

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self._ready().init_kv_cache(num_gpu_blocks, num_cpu_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step; the sampling rank (workers.pipeline.sampling_rank) returns the sampled
        tokens, the other ranks None."""
        runner = self._ready()
        try:
            output = runner.execute_model(scheduler_output)
        except Exception as exc:
            # Travels back pickled with the exception: the executor names the rank from it.
            exc.tp_rank = self.rank  # type: ignore[attr-defined]  # any exception may carry it
            raise
        return output if runner.is_driver else None

    def execute_model_encoded(self, scheduler_output: bytes | bytearray) -> bytes | None:
        """execute_model over the executor's wire format (SchedulerOutput.encode,
        ModelRunnerOutput.encode)."""
        output = self.execute_model(SchedulerOutput.decode(scheduler_output))
        return output.encode() if output is not None else None

    def call(self, fn: Callable[[ModelRunner], T]) -> T:
        """fn(this rank's runner): work outside the steps that every rank does on its own part
        of the model (a KV transfer's, workers/kv_ranks.py); called between steps."""
        return fn(self._ready())

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        """Drop the model and cache and leave the process group."""
        self.runner = None
        destroy_distributed()

    def _pin_threads(self) -> None:
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)

    def _on_step_thread(self) -> None:
        """The step server's thread runs the forwards: same thread count, same CUDA device."""
        self._pin_threads()
        if self.config.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(self.config.device).index or 0)

    def node_host(self) -> str:
        """The address other ranks reach this one at; a single machine's loopback unless the process
        that hosts the worker knows its node's address (cluster.ray_executor.RayWorker does)."""
        return "127.0.0.1"

    def _ready(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError(f"rank {self.rank}: load_model() must run first")
        return self.runner
