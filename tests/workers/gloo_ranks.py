"""Real gloo groups of spawned ranks for the tensor- and expert-parallel layer tests.

Spawning a rank (a fresh interpreter that imports torch and the model code) costs seconds, far
more than the tiny forward passes it runs, so one group of each size serves every test in turn:
`GlooRanks.run(job, *args)` runs job(rank, world, *args) on every rank and returns rank 0's value.
A rank that fails takes the group down (a peer may be stuck in a collective); the next test gets a
new one.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

# Bounds a collective whose peer failed, and each job: far beyond the tiny models' forward passes.
TIMEOUT_S = 300


def _serve(rank: int, world: int, init_file: str, jobs: Any, results: Any) -> None:
    """A rank's loop: join the group, then run each job it is sent."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    parent = os.getppid()
    while True:  # until GlooRanks.close() kills the rank, or the test process is gone
        try:
            fn, args = jobs.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:
                os._exit(1)
            continue
        try:
            value = fn(rank, world, *args)
            buf = io.BytesIO()
            torch.save(value if rank == 0 else None, buf)
            results.put((rank, None, buf.getvalue()))
        except BaseException:
            results.put((rank, traceback.format_exc(), b""))


class GlooRanks:
    """`world` spawned ranks in one gloo group (init by file), kept until close()."""

    def __init__(self, world: int, init_file: str) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self._jobs = [ctx.Queue() for _ in range(world)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(rank, world, init_file, self._jobs[rank], self._results),
                daemon=True,  # killed when the test process exits
            )
            for rank in range(world)
        ]
        for proc in self._procs:
            proc.start()
        self.alive = True

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(rank, world, *args) on every rank (fn must be importable by name); rank 0's value."""
        assert self.alive, "this group failed before"
        for jobs in self._jobs:
            jobs.put((fn, args))
        got: dict[int, tuple[str | None, bytes]] = {}
        try:
            while len(got) < self.world:
                rank, error, value = self._results.get(timeout=TIMEOUT_S)
                got[rank] = (error, value)
                if error is not None:
                    break
        except queue.Empty:
            self.close()
            raise TimeoutError(f"{self.world} gloo ranks: no answer in {TIMEOUT_S} s") from None
        errors = [f"rank {r}:\n{e}" for r, (e, _) in sorted(got.items()) if e is not None]
        if errors:
            self.close()
            raise AssertionError("\n".join(errors))
        return torch.load(io.BytesIO(got[0][1]))

    def close(self) -> None:
        """Kill every rank: an idle one holds nothing to save, and a clean exit (leaving the group,
        the interpreter's shutdown) costs seconds per rank; one may also wait on a dead peer."""
        self.alive = False
        for proc in self._procs:
            proc.kill()
        for proc in self._procs:
            proc.join()
