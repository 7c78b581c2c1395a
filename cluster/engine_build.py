"""The replica's EngineCore, built on a thread that exits once it is built.

The model is loaded on a passing thread, then stepped on the engine loop's (cluster/engine_loop.py):
one OpenMP thread pool stays, the engine thread's (see on_passing_thread).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from cluster.ray_executor import ray_executor
from engine.config import EngineConfig

if TYPE_CHECKING:
    from engine.core import EngineCore

T = TypeVar("T")


def build_engine(config: EngineConfig) -> EngineCore:
    """EngineCore for the config, on the placement group Serve created for this replica, built on
    a thread of its own that then exits (see on_passing_thread)."""
    from ray.util import get_current_placement_group

    from engine.core import EngineCore
    from engine.executor import local_executor

    placement_group = get_current_placement_group()
    if config.world_size == 1:
        # The one rank runs in this process, inside the replica's own bundle.
        return on_passing_thread(lambda: EngineCore(config, local_executor))
    factory = functools.partial(ray_executor, placement_group=placement_group)
    return on_passing_thread(lambda: EngineCore(config, factory))


def on_passing_thread(fn: Callable[[], T]) -> T:
    """fn() on a new thread that exits when it returns, so that its OpenMP thread pool goes with it.

    torch's OpenMP runtime (libgomp) keeps a thread pool for every thread that starts parallel work.
    Loading the model on the actor's thread and stepping on the engine thread made two pools; with
    more pool threads than CPUs, libgomp cuts its spin-waiting to 100 spins whatever GOMP_SPINCOUNT
    says, so `omp_spin_count` had no effect. A pool is freed when its thread exits.
    """
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((fn(), None))
        except BaseException as exc:
            outcome.append((None, exc))

    thread = threading.Thread(target=run, name="raylm-engine-build")
    thread.start()
    thread.join()
    result, error = outcome[0]
    if error is not None:
        raise error
    return result
