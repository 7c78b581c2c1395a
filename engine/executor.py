"""Executors run each SchedulerOutput on the model workers and return the sampling rank's
ModelRunnerOutput (rank 0; with pipeline stages, the last stage's first rank).

LocalExecutor runs one ModelRunner in this process (one rank); engine.mp_executor.MPExecutor one
spawned process per rank on this machine; cluster.ray_executor.RayExecutor one Ray actor per rank.
All satisfy the Executor protocol; an EngineCore gets its executor from an ExecutorFactory
(engine/backends.py picks one from the settings), so this Ray-free package never names the Ray one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from workers.runner import ModelRunner, RunnerConfig

if TYPE_CHECKING:
    from engine.config import EngineConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """A rank died, raised or stalled; the engine cannot take more steps."""

    def __init__(self, rank: int | None, cause: str) -> None:
        where = f"tensor-parallel rank {rank}" if rank is not None else "a tensor-parallel worker"
        super().__init__(f"engine dead: {where} failed: {cause}")
        self.rank = rank
        self.cause = cause


class Executor(Protocol):
    """What an EngineCore needs from the workers of one replica."""

    def determine_num_blocks(self) -> int:
        """KV blocks the device can hold (the minimum over ranks)."""
        ...

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def call_ranks(self, fn: Callable[[ModelRunner], T], timeout_s: float = 60.0) -> list[T]:
        """fn(runner) on every rank, by rank, between steps (LoRA adapters, KV transfers); fn
        crosses a process boundary where the ranks are processes: a module-level function or a
        functools.partial of one."""
        ...

    def shutdown(self) -> None: ...

    @property
    def pids(self) -> list[int]:
        """The processes that run the model, by rank (what an operator inspects or signals)."""
        ...


class RankExecutor:
    """What the multi-rank executors (one process or Ray actor per rank) share: the KV sizing
    asked of every rank, and a step as post then collect. Subclasses send a method to every rank
    (`_all`) and post and collect the step over their own transport."""

    init_timeout_s: float

    def _all(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        raise NotImplementedError

    def post_step(self, scheduler_output: SchedulerOutput) -> None:
        raise NotImplementedError

    def collect_step(self) -> ModelRunnerOutput:
        raise NotImplementedError

    def determine_num_blocks(self) -> int:
        """KV blocks every rank can hold: the minimum over ranks."""
        return min(self._all("determine_num_blocks", timeout_s=self.init_timeout_s))

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self._all("init_kv_cache", num_gpu_blocks, num_cpu_blocks, timeout_s=self.init_timeout_s)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Send the step to every rank and return the sampling rank's output."""
        self.post_step(scheduler_output)
        return self.collect_step()


class LocalExecutor:
    """A single in-process worker (tensor_parallel_size == 1)."""

    def __init__(self, runner_config: RunnerConfig, tensor_parallel_size: int = 1) -> None:
        if tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size: {tensor_parallel_size} ranks need a process each; this "
                "executor runs one in this process (engine/backends.py picks MPExecutor or the "
                "Ray executor for more)"
            )
        self.runner: ModelRunner | None = ModelRunner(runner_config)

    def determine_num_blocks(self) -> int:
        return self._live().determine_num_blocks()

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self._live().init_kv_cache(num_gpu_blocks, num_cpu_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._live().execute_model(scheduler_output)

    def call_ranks(self, fn: Callable[[ModelRunner], T], timeout_s: float = 60.0) -> list[T]:
        """fn(runner) on each rank, by rank (here the one): see RayExecutor.call_ranks."""
        return [fn(self._live())]

    def _live(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("LocalExecutor: shut down, its model is released")
        return self.runner

    def shutdown(self) -> None:
        """Release the model and the cache."""
        self.runner = None

    @property
    def pids(self) -> list[int]:
        return [os.getpid()]


# What builds an engine's executor once the engine knows the model (the runner config).
ExecutorFactory = Callable[["EngineConfig", RunnerConfig], Executor]


def local_executor(config: EngineConfig, runner_config: RunnerConfig) -> Executor:
    """The default factory: the one rank in this process."""
    return LocalExecutor(runner_config, config.world_size)
