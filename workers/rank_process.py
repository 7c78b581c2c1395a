"""The body of one rank as a spawned process (engine/mp_executor.py starts one per rank).

The process hosts a Worker, exactly as a Ray actor does in cluster/ray_executor.py, and answers the
executor's calls over a pipe: one (method, args) in, one (OK, value) or (ERROR, exception) out, in
order. Steps do not come this way: they come over the step channel the Worker opens (one TCP
connection per rank on loopback, the Ray executor's default transport too).

The pipe is also the lifeline: the executor holds its only other end, so when the executor's
process dies, or closes the pipe at shutdown, the next read ends and the rank exits at once, even
with a step thread stuck in a collective. No rank outlives its engine.
"""

from __future__ import annotations

import logging
import os
import pickle
from multiprocessing.connection import Connection
from typing import Any

import torch

from workers.runner import RunnerConfig
from workers.worker import Worker

logger = logging.getLogger(__name__)

OK, ERROR = "ok", "error"
# What the executor may call: the Worker's lifecycle and Worker.call (fn on the rank's runner).
CALLS = frozenset(
    {
        "rendezvous_address",
        "init_device",
        "load_model",
        "open_step_channel",
        "determine_num_blocks",
        "init_kv_cache",
        "call",
        "pid",
        "shutdown",
    }
)


def threads_per_rank(device: str, world_size: int) -> int | None:
    """torch threads of each CPU rank of one machine (process or Ray actor): its cores shared
    out; without a cap each rank would start one thread per core and they would fight for them.
    None on CUDA."""
    if torch.device(device).type == "cuda":
        return None
    return max(1, (os.cpu_count() or 1) // world_size)


def serve_rank(
    rank: int, world_size: int, config: RunnerConfig, threads: int | None, conn: Connection
) -> None:
    """Run rank `rank` until the executor says shutdown or its end of the pipe closes."""
    logging.basicConfig(level=logging.INFO, format=f"rank {rank} %(levelname)s %(message)s")
    worker = Worker(rank, world_size, config, threads)
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            logger.info("rank %d: the executor is gone; exiting", rank)
            os._exit(0)  # a step thread in a collective must not keep the process alive
        conn.send(_answer(worker, method, args))
        if method == "shutdown":
            conn.close()
            os._exit(0)


def _answer(worker: Worker, method: str, args: tuple[Any, ...]) -> tuple[str, Any]:
    if method not in CALLS:
        return ERROR, ValueError(f"rank {worker.rank}: no call {method!r}")
    try:
        return OK, getattr(worker, method)(*args)
    except Exception as exc:
        exc.tp_rank = worker.rank  # type: ignore[attr-defined]  # names the rank, as Worker does
        return ERROR, _picklable(exc)


def _picklable(exc: BaseException) -> BaseException:
    """exc itself when it survives the pipe, else a RuntimeError with its type and text."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        plain = RuntimeError(f"{type(exc).__name__}: {exc}")
        plain.tp_rank = getattr(exc, "tp_rank", None)  # type: ignore[attr-defined]
        return plain
    return exc
