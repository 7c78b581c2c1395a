"""RayExecutor: one Worker actor per tensor-parallel rank, each step's SchedulerOutput sent to all.

The workers live in a placement group, one bundle per rank: a STRICT_PACK group the executor
creates, or the group it is handed (a Serve replica owns one; its worker bundles start at
bundle_offset). Each step travels, by `step_transport`, over one TCP connection per rank
(workers/step_channel.py, the default and the cheapest), through a Ray Compiled Graph (written
once into shared-memory channels every rank reads), or as one plain actor call per rank. Only
plain dataclasses cross; tensors move between ranks through torch.distributed.

Any worker that dies, raises or stalls ends the engine: the executor raises EngineDeadError
naming the rank and the cause, and kills the remaining workers so none is left in a collective.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayChannelError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.placement import (
    TP_STRATEGY,
    UnplaceableError,
    check_strategy,
    live_nodes,
    unplaceable,
)
from engine.backends import register_ray_backend
from engine.config import EngineConfig
from engine.executor import EngineDeadError, RankExecutor
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from workers.options import STEP_TRANSPORTS
from workers.pipeline import sampling_rank
from workers.rank_process import threads_per_rank
from workers.runner import ModelRunner, RunnerConfig
from workers.step_channel import RankFailedError, StepClient
from workers.worker import Worker

logger = logging.getLogger(__name__)

T = TypeVar("T")

_PROBE_TIMEOUT_S = 3.0  # how long a failure diagnosis waits to learn which actors are dead


class RayWorker(Worker):
    """A Worker as a Ray actor: other ranks reach it at the address Ray registered for its node."""

    def node_host(self) -> str:
        node_id = ray.get_runtime_context().get_node_id()
        return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)

    def node_id(self) -> str:
        """The Ray node this rank runs on (where a placement put it)."""
        return ray.get_runtime_context().get_node_id()


class RayExecutor(RankExecutor):
    """Drives tensor_parallel_size Worker actors in lock-step, one SchedulerOutput per step."""

    def __init__(
        self,
        runner_config: RunnerConfig,
        tensor_parallel_size: int,
        placement_group: PlacementGroup | None = None,
        bundle_offset: int = 0,
        step_transport: str = "socket",
        step_timeout_s: float = 300.0,
        init_timeout_s: float = 600.0,
        worker_cls: type[Worker] | None = None,
        placement_strategy: str = TP_STRATEGY,
    ) -> None:
        _check_args(tensor_parallel_size, bundle_offset, step_transport)
        self.tp = tensor_parallel_size
        if not ray.is_initialized():
            _start_local_ray(self.tp)
        self.step_transport = step_transport
        self.step_timeout_s, self.init_timeout_s = step_timeout_s, init_timeout_s
        self._dag = None
        self._channel: StepClient | None = None
        self._posted: deque[bytes] = deque()  # steps posted, not yet run (transports but socket)
        self.answer_rank = sampling_rank(tensor_parallel_size, runner_config.pipeline_parallel_size)
        self._dead: EngineDeadError | None = None
        self._owns_pg = placement_group is None
        self.placement_strategy = check_strategy(placement_strategy)
        self._pg: PlacementGroup | None = placement_group or self._create_pg(runner_config.device)
        self._offset = bundle_offset
        if len(self._pg.bundle_specs) < bundle_offset + self.tp:
            raise ValueError(
                f"placement_group: has {len(self._pg.bundle_specs)} bundles, needs "
                f"bundle_offset={bundle_offset} + tensor_parallel_size={self.tp}"
            )
        self.workers = self._create_workers(worker_cls or RayWorker, runner_config)
        self._rank_of_actor = {w._actor_id.hex(): rank for rank, w in enumerate(self.workers)}
        self._rank_of_pid: dict[int, int] = {}
        self._start_ranks()

    def _start_ranks(self) -> None:
        """Join the ranks' group, load the model and open the step channel (everything shut down
        on a failure)."""
        timeout_s = self.init_timeout_s
        try:
            address = self._gather([self.workers[0].rendezvous_address.remote()], timeout_s)[0]
            self._all("init_device", address, timeout_s, timeout_s=timeout_s)
            self._all("load_model", timeout_s=timeout_s)
            # Errors raised in a worker carry its pid: how a failure is traced back to a rank.
            self._rank_of_pid = {
                pid: rank for rank, pid in enumerate(self._all("pid", timeout_s=60))
            }
            if self.step_transport == "socket":
                self._channel = StepClient(self._all("open_step_channel", timeout_s=60))
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "%d tensor-parallel workers ready (rendezvous %s, steps over %s)",
            self.tp,
            address,
            self.step_transport,
        )

    # ---- set-up --------------------------------------------------------------------------------
    def _create_pg(self, device: str) -> PlacementGroup:
        kind = "GPU" if device.startswith("cuda") else "CPU"
        bundle = {kind: 1.0}
        bundles = [dict(bundle) for _ in range(self.tp)]
        # Say now when no node can hold them rather than wait out the timeout (an offline engine
        # has no autoscaler to wait for).
        strategy = self.placement_strategy
        problem = unplaceable(bundles, strategy, live_nodes())
        if problem is not None:
            raise UnplaceableError(f"tensor_parallel_size: {self.tp} ranks: {problem}")
        pg = placement_group(bundles, strategy=strategy)
        try:
            ray.get(pg.ready(), timeout=self.init_timeout_s)
        except GetTimeoutError:
            remove_placement_group(pg)
            raise RuntimeError(
                f"placement_group: {self.tp} bundles of {bundle} could not be placed "
                f"({strategy}) within {self.init_timeout_s:.0f}s (cluster: "
                f"{ray.cluster_resources()})"
            ) from None
        return pg

    def _create_workers(self, worker_cls: type, config: RunnerConfig) -> list[Any]:
        on_cpu = not config.device.startswith("cuda")
        if not on_cpu:
            # Ray shows each worker only its own GPU, as device 0 (whatever index the driver named).
            config = dataclasses.replace(config, device="cuda")
        threads = threads_per_rank(config.device, self.tp)
        actor_cls: Any = ray.remote(worker_cls)
        return [
            actor_cls.options(**self._actor_options(rank)).remote(rank, self.tp, config, threads)
            for rank in range(self.tp)
        ]

    def _actor_options(self, rank: int) -> dict[str, Any]:
        """Rank `rank`'s actor in its bundle, with that bundle's resources; never restarted."""
        index = self._offset + rank
        assert self._pg is not None  # released only by shutdown
        bundle = self._pg.bundle_specs[index]
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self._pg,
            placement_group_bundle_index=index,
            placement_group_capture_child_tasks=False,
        )
        return {
            "num_cpus": bundle.get("CPU", 0),
            "num_gpus": bundle.get("GPU", 0),
            "scheduling_strategy": strategy,
            "max_restarts": 0,
            "name": None,
        }

    # ---- the executor interface ------------------------------------------------------------------
    def post_step(self, scheduler_output: SchedulerOutput) -> None:
        """Send the step without waiting for it (pipeline micro-batches) over the socket
        transport; the other transports run it when it is collected, one step at a time."""
        if self._dead is not None:
            raise self._dead
        # Encoded once here with the C pickler: Ray's own serializer calls back into Python for
        # every object, and a step holds hundreds of small lists, ints and strings.
        payload = scheduler_output.encode()
        if self._channel is None:
            self._posted.append(payload)
            return
        try:
            self._channel.post(payload, self.step_timeout_s)
        except RankFailedError as exc:
            self._fail(exc.rank, exc.cause)

    def collect_step(self) -> ModelRunnerOutput:
        """The oldest posted step's output, from the rank that sampled it."""
        if self._dead is not None:
            raise self._dead
        if self._channel is not None:
            try:
                answer = self._channel.collect(self.step_timeout_s, self.answer_rank)
            except RankFailedError as exc:
                self._fail(exc.rank, exc.cause)
            return ModelRunnerOutput.decode(answer)
        return self._run_posted(self._posted.popleft())

    def _run_posted(self, payload: bytes) -> ModelRunnerOutput:
        if self.step_transport == "actor_calls":
            refs = [w.execute_model_encoded.remote(payload) for w in self.workers]
            answers = self._gather(refs, self.step_timeout_s)
            return ModelRunnerOutput.decode(answers[self.answer_rank])
        try:
            # Compiling is part of the first step: a worker lost while it compiles ends the engine
            # too.
            dag = self._dag or self._compile()
            outputs = ray.get(dag.execute(payload), timeout=self.step_timeout_s)
        except Exception as exc:
            self._fail(None, exc)
        return ModelRunnerOutput.decode(outputs[self.answer_rank])

    def call_ranks(self, fn: Callable[[ModelRunner], T], timeout_s: float = 60.0) -> list[T]:
        """fn(runner) on every rank's worker, by rank (a KV transfer's work, engine/disagg.py); call
        between steps. Its errors are the caller's (the engine is not failed for them: a dead
        worker fails the next step anyway). The compiled graph's actors answer nothing else."""
        if self.step_transport == "compiled_graph":
            raise ValueError(
                "step_transport: compiled_graph workers run only the steps; work on each rank "
                "(KV transfers) needs socket or actor_calls"
            )
        if self._dead is not None:
            raise self._dead
        return ray.get([w.call.remote(fn) for w in self.workers], timeout=timeout_s)

    @property
    def pids(self) -> list[int]:
        """The worker processes, by rank."""
        return sorted(self._rank_of_pid, key=self._rank_of_pid.__getitem__)

    def shutdown(self) -> None:
        """Stop the step transport, release every worker and (if it is ours) the placement group."""
        self._teardown_transport()
        if self.workers and self._dead is None:
            try:
                ray.get([w.shutdown.remote() for w in self.workers], timeout=30)
            except Exception:
                logger.warning("a worker did not shut down cleanly", exc_info=True)
        self._kill_workers()
        if self._owns_pg and self._pg is not None:
            remove_placement_group(self._pg)
        self._pg = None

    # ---- internals -------------------------------------------------------------------------------
    def _compile(self) -> Any:
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as step:
            graph = MultiOutputNode([w.execute_model_encoded.bind(step) for w in self.workers])
        # The actors now run the graph's read-execute-write loop until teardown.
        self._dag = graph.experimental_compile()
        return self._dag

    def _all(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        return self._gather(refs, timeout_s)

    def _gather(self, refs: list[ray.ObjectRef], timeout_s: float) -> list[Any]:
        """ray.get over ranks that fails on the first error instead of waiting for every rank."""
        if self._dead is not None:
            raise self._dead
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending, deadline = list(refs), time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(
                pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0)
            )
            if not ready:
                self._fail(rank_of[pending[0]], TimeoutError(f"no answer within {timeout_s:.0f}s"))
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as exc:
                    self._fail(rank_of[ref], exc)
        return ray.get(refs)

    def _fail(self, rank: int | None, exc: BaseException) -> NoReturn:
        """Record the engine as dead, release the workers and raise EngineDeadError."""
        # A killed rank makes its peers fail too (a broken collective, a closed channel):
        # name the dead actor, the root cause, over whatever error surfaced first.
        dead_rank, dead_exc = self._find_dead_worker()
        if dead_rank is not None and dead_exc is not None:
            rank, exc = dead_rank, dead_exc
        elif rank is None:
            rank = self._rank_in(exc)
        self._dead = EngineDeadError(rank, _describe(exc))
        logger.error("%s", self._dead)
        # Kill first: a graph teardown waits for every live actor, and one stuck in a collective
        # with the lost rank would hold it up.
        self._kill_workers()
        self._teardown_transport()
        raise self._dead from exc

    def _find_dead_worker(self) -> tuple[int | None, BaseException | None]:
        """The first rank whose actor is gone (a call to a dead actor fails at once), if any."""
        probes = {w.pid.remote(): rank for rank, w in enumerate(self.workers)}
        # Live actors inside a compiled graph cannot answer until teardown: wait briefly only.
        ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=_PROBE_TIMEOUT_S)
        for ref in sorted(ready, key=lambda r: probes[r]):
            try:
                ray.get(ref)
            except RayActorError as exc:
                return probes[ref], exc
        return None, None

    def _rank_in(self, exc: BaseException) -> int | None:
        """The rank an error came from: set by Worker.execute_model, else from Ray's actor id or
        pid."""
        cause = exc.cause if isinstance(exc, RayTaskError) else exc
        rank = getattr(cause, "tp_rank", None)
        if isinstance(rank, int):
            return rank
        actor_id = getattr(exc, "actor_id", None) or getattr(exc, "_actor_id", None)
        if isinstance(actor_id, bytes):
            actor_id = actor_id.hex()
        if actor_id in self._rank_of_actor:
            return self._rank_of_actor[actor_id]
        pid = getattr(exc, "pid", None)
        return self._rank_of_pid.get(pid) if isinstance(pid, int) else None

    def _teardown_transport(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
        dag, self._dag = self._dag, None
        if dag is not None:
            try:
                dag.teardown()
            except Exception:
                logger.debug("compiled graph teardown raised", exc_info=True)

    def _kill_workers(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []


def ray_executor(
    config: EngineConfig, runner_config: RunnerConfig, placement_group: PlacementGroup | None = None
) -> RayExecutor:
    """An engine.executor.ExecutorFactory: one worker actor per rank, in placement_group when given
    (a Serve replica's group holds the replica's own bundle first, then one per worker), else in a
    group of its own."""
    if placement_group is not None and config.distributed_executor_backend == "mp":
        raise ValueError(
            "distributed_executor_backend: 'mp' starts rank processes outside the replica's "
            "placement group, where Ray reserved nothing for them; a served replica's ranks are "
            "Ray actors (leave it unset or 'ray')"
        )
    return RayExecutor(
        runner_config,
        config.world_size,
        placement_group=placement_group,
        bundle_offset=1 if placement_group is not None else 0,
        step_transport=config.step_transport,
        step_timeout_s=config.step_timeout_s,
    )


# `ray` for engine.backends.default_executor (engine/ cannot import this Ray adapter itself).
register_ray_backend(ray_executor)


def _check_args(tensor_parallel_size: int, bundle_offset: int, step_transport: str) -> None:
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size: must be >= 1, got {tensor_parallel_size}")
    if bundle_offset < 0:
        raise ValueError(f"bundle_offset: must be >= 0, got {bundle_offset}")
    if step_transport not in STEP_TRANSPORTS:
        raise ValueError(
            f"step_transport: must be one of {', '.join(STEP_TRANSPORTS)}, got {step_transport!r}"
        )


def _start_local_ray(tensor_parallel_size: int) -> None:
    """A single-node Ray for offline use (LLM(..., tensor_parallel_size=N) without a cluster)."""
    # CPU ranks are logical slots, not cores: N ranks must fit even on a smaller machine.
    num_cpus = max(os.cpu_count() or 1, tensor_parallel_size + 1)
    logger.info(
        "starting a local Ray instance (%d logical CPUs) for %d workers",
        num_cpus,
        tensor_parallel_size,
    )
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)


def _describe(exc: BaseException) -> str:
    """One readable line for the cause: the worker's own exception rather than Ray's wrapper."""
    if isinstance(exc, RayActorError):
        return "the worker actor died (killed, crashed or its node was lost)"
    if isinstance(exc, RayTaskError) and exc.cause is not None:
        exc = exc.cause
    text = str(exc).strip().splitlines()
    if isinstance(exc, (GetTimeoutError, TimeoutError)):  # RayChannelTimeoutError included
        return f"no answer in time ({type(exc).__name__}: {text[0] if text else ''})"
    if isinstance(exc, RayChannelError):
        return f"compiled-graph channel closed ({type(exc).__name__}: {text[0] if text else ''})"
    return f"{type(exc).__name__}: {text[-1] if text else ''}"
