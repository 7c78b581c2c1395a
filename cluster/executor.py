"""Executors run each SchedulerOutput on the model workers and return rank 0's ModelRunnerOutput.

LocalExecutor runs one ModelRunner in this process (tests, TP=1); cluster.ray_executor.RayExecutor
drives one worker actor per tensor-parallel rank. Both satisfy the Executor protocol.
"""
from __future__ import annotations

import logging
import os
from typing import Protocol

from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from workers.runner import ModelRunner, RunnerConfig

logger = logging.getLogger(__name__)


class Executor(Protocol):
    """What an EngineCore needs from the workers of one replica."""

    def determine_num_blocks(self) -> int:
        """KV blocks the device can hold (the minimum over ranks)."""
        ...

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...

    @property
    def pids(self) -> list[int]:
        """The processes that run the model, by rank (what an operator inspects or signals)."""
        ...


class LocalExecutor:
    """A single in-process worker (tensor_parallel_size == 1)."""

    def __init__(self, runner_config: RunnerConfig, tensor_parallel_size: int = 1) -> None:
        if tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size: LocalExecutor runs one rank, got {tensor_parallel_size}")
        self.runner = ModelRunner(runner_config)

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.runner.init_kv_cache(num_gpu_blocks, num_cpu_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        """Release the model and the cache."""
        self.runner = None

    @property
    def pids(self) -> list[int]:
        return [os.getpid()]
