"""MPExecutor: one spawned process per rank on this machine, no Ray (vLLM's `mp` backend).

Each rank is a fresh interpreter (the `spawn` start method: CUDA cannot be forked) running
workers/rank_process.py around a Worker, the same body the Ray executor runs as an actor: it joins
a torch.distributed group (gloo on CPU, NCCL on CUDA, workers/distributed.py), loads its shard and
serves steps over the step channel (one loopback TCP connection per rank). Calls other than steps
go over a pipe per rank.

A rank that dies fails the engine at once instead of leaving its peers in a collective until the
step timeout: a watchdog thread waits on every rank's process and, when one ends unbidden, kills
the others, so the step in flight fails within a second and EngineDeadError names the rank that
died first. Every wait is bounded; shutdown ends every rank (SIGKILL after a grace period).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn, TypeVar

import torch
import torch.multiprocessing as mp

from engine.executor import EngineDeadError, RankExecutor
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from workers.pipeline import sampling_rank
from workers.rank_process import ERROR, serve_rank, threads_per_rank
from workers.runner import ModelRunner, RunnerConfig
from workers.step_channel import RankFailedError, StepClient

logger = logging.getLogger(__name__)

T = TypeVar("T")

_GRACE_S = 10.0  # how long shutdown waits for a rank to leave its group before killing it
_WATCH_PERIOD_S = 0.5  # how often the watchdog looks up from the rank processes to see if it stops


class MPExecutor(RankExecutor):
    """Drives world_size rank processes in lock-step, one SchedulerOutput per step."""

    def __init__(
        self,
        runner_config: RunnerConfig,
        world_size: int,
        step_timeout_s: float = 300.0,
        init_timeout_s: float = 600.0,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size: must be >= 1, got {world_size}")
        self.world_size = world_size
        self.answer_rank = sampling_rank(world_size, runner_config.pipeline_parallel_size)
        self.step_timeout_s, self.init_timeout_s = step_timeout_s, init_timeout_s
        self._dead: EngineDeadError | None = None
        self._lost: tuple[int, int | None] | None = None  # (rank, exit code) of the first to die
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # one call on the pipes at a time
        self._channel: StepClient | None = None
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        try:
            self._spawn(runner_config)
            self._watchdog = threading.Thread(
                target=self._watch, name="raylm-mp-watchdog", daemon=True
            )
            self._watchdog.start()
            self._start_ranks()
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d rank processes ready (pids %s)", world_size, self.pids)

    # ---- set-up --------------------------------------------------------------------------------
    def _spawn(self, config: RunnerConfig) -> None:
        ctx = mp.get_context("spawn")
        threads = threads_per_rank(config.device, self.world_size)
        for rank in range(self.world_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=serve_rank,
                args=(rank, self.world_size, rank_config(config, rank), threads, theirs),
                name=f"raylm-rank-{rank}",
                daemon=True,  # ended with this process if it exits without shutdown()
            )
            proc.start()
            theirs.close()  # the rank's end lives in the rank only: its death ends our reads
            self._procs.append(proc)
            self._conns.append(ours)

    def _start_ranks(self) -> None:
        """Join the group, load the shards, open the step channels: as the Ray executor does."""
        address = self._call_rank(0, "rendezvous_address", (), self.init_timeout_s)
        self._all("init_device", address, self.init_timeout_s, timeout_s=self.init_timeout_s)
        self._all("load_model", timeout_s=self.init_timeout_s)
        self._channel = StepClient(self._all("open_step_channel", timeout_s=60))

    # ---- the executor interface ------------------------------------------------------------------
    def post_step(self, scheduler_output: SchedulerOutput) -> None:
        """Send the step to every rank without waiting (pipeline micro-batches: stage 0 starts
        it while later stages still run earlier ones); collect_step answers in order."""
        try:
            self._live_channel().post(scheduler_output.encode(), self.step_timeout_s)
        except RankFailedError as exc:
            self._fail(exc.rank, exc.cause)

    def collect_step(self) -> ModelRunnerOutput:
        """The oldest posted step's output, from the rank that sampled it."""
        try:
            answer = self._live_channel().collect(self.step_timeout_s, self.answer_rank)
        except RankFailedError as exc:
            self._fail(exc.rank, exc.cause)
        return ModelRunnerOutput.decode(answer)

    def _live_channel(self) -> StepClient:
        channel = self._channel
        if self._dead is not None or channel is None:
            raise self._dead or EngineDeadError(None, "the executor is shut down")
        return channel

    def call_ranks(self, fn: Callable[[ModelRunner], T], timeout_s: float = 60.0) -> list[T]:
        """fn(runner) on every rank, by rank, between steps. fn is pickled to the rank processes
        (a module-level function or a partial of one). Its errors are the caller's; a rank that
        dies or does not answer in time fails the engine."""
        return self._all("call", fn, timeout_s=timeout_s)

    @property
    def pids(self) -> list[int]:
        """The rank processes, by rank."""
        return [proc.pid for proc in self._procs]

    def shutdown(self) -> None:
        """Stop the step channel, ask every rank to leave its group, and end every process."""
        self._stopping.set()
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
        if self._dead is None:
            for conn in self._conns:
                _send_quietly(conn, ("shutdown", ()))
        deadline = time.monotonic() + _GRACE_S
        for proc in self._procs:
            proc.join(max(deadline - time.monotonic(), 0))
        self._kill_ranks()
        for conn in self._conns:
            conn.close()
        self._conns = []

    # ---- internals -------------------------------------------------------------------------------
    def _all(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        """method(*args) on every rank; the first rank's error is raised once all have answered
        (the pipes stay in step)."""
        with self._lock:
            self._check_alive()
            for rank, conn in enumerate(self._conns):
                self._send(rank, conn, (method, args))
            deadline = time.monotonic() + timeout_s
            answers = [self._receive(rank, deadline, timeout_s) for rank in range(len(self._conns))]
        errors = [value for kind, value in answers if kind == ERROR]
        if errors:
            raise errors[0]
        return [value for _, value in answers]

    def _call_rank(self, rank: int, method: str, args: tuple[Any, ...], timeout_s: float) -> Any:
        with self._lock:
            self._check_alive()
            self._send(rank, self._conns[rank], (method, args))
            kind, value = self._receive(rank, time.monotonic() + timeout_s, timeout_s)
        if kind == ERROR:
            raise value
        return value

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if not self._conns:
            raise EngineDeadError(None, "the executor is shut down")

    def _send(self, rank: int, conn: Connection, message: tuple[str, tuple[Any, ...]]) -> None:
        try:
            conn.send(message)
        except OSError as exc:
            self._fail(rank, exc)

    def _receive(self, rank: int, deadline: float, timeout_s: float) -> tuple[str, Any]:
        conn = self._conns[rank]
        try:
            if not conn.poll(max(deadline - time.monotonic(), 0)):
                self._fail(rank, TimeoutError(f"no answer within {timeout_s:.0f}s"))
            answer: tuple[str, Any] = conn.recv()
        except (EOFError, OSError) as exc:
            self._fail(rank, exc)
        return answer

    def _watch(self) -> None:
        """Wait on the rank processes; the first that ends unbidden takes the others down."""
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while not self._stopping.is_set():
            ended = wait(list(sentinels), timeout=_WATCH_PERIOD_S)
            if ended and not self._stopping.is_set():
                rank = min(sentinels[s] for s in ended)
                self._procs[rank].join(_WATCH_PERIOD_S)  # reaped: its exit code is known
                self._lost = (rank, self._procs[rank].exitcode)
                logger.error("rank %d's process ended (exit code %s)", *self._lost)
                # Its peers may sit in a collective with it until the group's timeout: end them,
                # so the step in flight fails now.
                self._kill_ranks(join=False)  # the engine's thread joins them
                return

    def _fail(self, rank: int | None, exc: BaseException) -> NoReturn:
        """Record the engine as dead, end every rank and raise EngineDeadError."""
        self._wait_for_watchdog()
        if self._lost is not None:  # a dead process, not the peer that noticed it first
            rank, code = self._lost
            cause = f"its process died (exit code {code})"
        else:
            cause = f"{type(exc).__name__}: {exc}"
        self._dead = EngineDeadError(rank, cause)
        logger.error("%s", self._dead)
        self._kill_ranks()
        raise self._dead from exc

    def _wait_for_watchdog(self) -> None:
        """A closed pipe or socket usually means a rank died; let the watchdog see which first."""
        deadline = time.monotonic() + 2 * _WATCH_PERIOD_S
        while self._lost is None and time.monotonic() < deadline:
            if all(proc.is_alive() for proc in self._procs):
                return
            time.sleep(0.05)

    def _kill_ranks(self, join: bool = True) -> None:
        for proc in self._procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in self._procs if join else ():
            proc.join(_GRACE_S)


def _send_quietly(conn: Connection, message: tuple[str, tuple[Any, ...]]) -> None:
    """A message to a rank that may be gone already (shutdown ends it either way)."""
    try:
        conn.send(message)
    except OSError:
        pass


def rank_config(config: RunnerConfig, rank: int) -> RunnerConfig:
    """The rank's RunnerConfig: on CUDA, GPU base + rank of this machine (cuda:N counts from N)."""
    device = torch.device(config.device)
    if device.type != "cuda":
        return config
    return dataclasses.replace(config, device=f"cuda:{(device.index or 0) + rank}")


def mp_executor_for(config: RunnerConfig, world_size: int, step_timeout_s: float) -> MPExecutor:
    """An MPExecutor once its ranks are known to fit: each its own GPU on CUDA."""
    device = torch.device(config.device)
    if device.type == "cuda":
        have = torch.cuda.device_count() - (device.index or 0)
        if world_size > have:
            raise ValueError(
                f"distributed_executor_backend: 'mp' runs {world_size} ranks on this machine, one "
                f"GPU each, and it has {have} from {config.device} on; use 'ray' across nodes"
            )
    return MPExecutor(config, world_size, step_timeout_s=step_timeout_s)
