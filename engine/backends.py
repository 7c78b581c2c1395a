"""Which executor runs an engine's ranks: the default ExecutorFactory of EngineCore and LLM.

One rank runs in this process (LocalExecutor). Several run as `distributed_executor_backend` says:
`mp`, one spawned process per rank on this machine (engine/mp_executor.py); `ray`, one Ray actor
per rank (cluster/ray_executor.py); unset, `mp` when every rank fits this machine, else `ray`.

This package is Ray-free (docs/architecture.md, the import contract), so it cannot import the Ray
executor: the Ray adapter registers its factory here when it is imported (`import
cluster.ray_executor`), and asking for `ray` before that is a ValueError that says so.
"""

from __future__ import annotations

import logging

from engine.config import EngineConfig
from engine.executor import Executor, ExecutorFactory, LocalExecutor
from engine.mp_executor import mp_executor_for
from workers.runner import RunnerConfig

logger = logging.getLogger(__name__)

_RAY: list[ExecutorFactory] = []  # the Ray executor's factory, once cluster.ray_executor loads


def register_ray_backend(factory: ExecutorFactory) -> None:
    """Called by cluster.ray_executor at import: `ray` is now available to every engine."""
    _RAY[:] = [factory]


def default_executor(config: EngineConfig, runner_config: RunnerConfig) -> Executor:
    """The executor the settings ask for (an ExecutorFactory)."""
    backend = backend_for(config, runner_config.device)
    if backend is None:
        return LocalExecutor(runner_config, config.world_size)
    logger.info("%d ranks on the %s executor", config.world_size, backend)
    if backend == "mp":
        return mp_executor_for(runner_config, config.world_size, config.step_timeout_s)
    if not _RAY:
        raise ValueError(
            f"distributed_executor_backend: 'ray' ({config.world_size} ranks"
            f"{'' if config.distributed_executor_backend else ', more than this machine holds'})"
            " runs the ranks as Ray actors, which the Ray-free engine package cannot start "
            "itself: `import cluster.ray_executor` first (it registers the backend), or pass "
            "executor_factory=cluster.ray_executor.ray_executor"
        )
    return _RAY[0](config, runner_config)


def backend_for(config: EngineConfig, device: str) -> str | None:
    """`mp` or `ray` for several ranks on `device` (the resolved one), None for one rank."""
    if config.world_size == 1 and config.distributed_executor_backend is None:
        return None
    if config.distributed_executor_backend is not None:
        return config.distributed_executor_backend
    return "mp" if config.world_size <= ranks_this_machine_holds(device) else "ray"


def ranks_this_machine_holds(device: str) -> int:
    """GPUs from the named one on, on CUDA; on CPU any number (ranks share the cores)."""
    if not device.startswith("cuda"):
        return 1 << 62
    import torch

    index = int(device.split(":", 1)[1]) if ":" in device else 0
    return torch.cuda.device_count() - index
