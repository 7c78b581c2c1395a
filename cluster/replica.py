"""LLMReplica: one data-parallel engine behind Ray Serve (the per-replica scheduler actor).

The EngineCore steps on one background thread while it has work; each step's RequestOutputs are
handed to the replica's event loop, which feeds one asyncio.Queue per request. The event loop
never blocks on the model, so `generate` streams, aborts and routing-stats calls stay responsive.

The replica deals in tokens only: stop strings, text and each request's finish as the client
sees it belong to the ingress's frontend (deploy/generation.py), which cancels the stream at a
stop string.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ray import serve

from cluster.caller_watch import CallerGoneError, CallerWatch
from cluster.disagg_replica import DisaggPhase, phase_engine, phase_stats, prefill_on
from cluster.engine_build import build_engine
from cluster.engine_loop import EngineLoop
from cluster.errors import EngineFailedError, ReplicaDrainingError
from cluster.kv_event_pub import TailingEngine, attach_kv_events
from cluster.kv_pull import replica_pulls
from cluster.loop_lag import LoopLag
from cluster.lora_admin import LoraCommand, WrongReplicaError
from cluster.replica_stream import ReplicaStream
from cluster.replica_telemetry import ReplicaTelemetry
from cluster.stream_chunks import chunk_tokens
from cluster.tracing import TraceContext
from cluster.weights_admin import WeightsCommand
from cluster.weights_admin import run_command as run_weights_command
from engine.config import EngineConfig
from router.autoscaling import SloTargets
from router.peer_pull import PeerPull, PullCommand
from router.stats import MAX_REPORTED_PREFIX_HASHES, ReplicaState, RoutingStats
from scheduler.outputs import RequestOutput, SchedulerStats
from scheduler.request import EngineRequest
from workers.kv_transfer import TransferHandle

if TYPE_CHECKING:
    from engine.disagg_reply import PrefillReply

logger = logging.getLogger(__name__)

# How often the watchdog looks for a stalled engine and for requests whose caller died.
WATCHDOG_PERIOD_S = 1.0
# Where Serve puts every replica actor, the ingress replicas that call us included (the runtime
# context's namespace is the job's, not this one).
SERVE_NAMESPACE = "serve"


@serve.deployment(name="LLMReplica")
class LLMReplica:
    """One data-parallel engine: its scheduler, KV cache and (TP) workers."""

    # Serve awaits an async constructor, so the replica can take its event loop here.
    async def __init__(  # type: ignore[misc]
        self,
        config: EngineConfig,
        slo: SloTargets | None = None,
        model_name: str = "",
        phase: DisaggPhase | None = None,
    ) -> None:
        """slo: the model's latency targets, whose attainment each finished request counts (and
        the autoscaling policy compares the measured p90s with); model_name: the name clients use
        (the metrics' `model` tag: an app may serve several); phase: this replica's part of a
        disaggregated model (cluster/disagg_replica.py), None: the whole of every request."""
        self.config = config
        self.replica = replica = serve.get_replica_context().replica_tag
        self.telemetry = ReplicaTelemetry(replica, model_name or config.model, slo)
        # Awaited on a thread: the model load takes the loop for no one, and the engine is built
        # on a passing thread of its own either way (cluster/engine_build.py).
        self.engine = await asyncio.to_thread(build_engine, config)
        self.telemetry.metrics.record_kv_layout(self.engine.kv_bytes_per_token)
        self.phase = phase_engine(self.engine, phase)
        # Peer pulls (router_kwargs.peer_pulls) install their connector before the events attach.
        self.pulls = replica_pulls(self.engine, replica) if phase is None else None
        self._kv_events = attach_kv_events(self.engine)  # before the first step: none missed
        self._streams: dict[str, ReplicaStream] = {}
        self._draining = False
        self._stats: SchedulerStats = self.engine.stats()
        self.telemetry.metrics.record_stats(self._stats)
        self._loop_thread = EngineLoop(
            TailingEngine(self._driven(), self._kv_events, replica),  # KV events ride back
            asyncio.get_running_loop(),
            self._on_step,
            self._on_error,
        )
        self._callers = CallerWatch(SERVE_NAMESPACE)
        self._stall_failed_over = False
        self._orphans_aborted = 0  # requests aborted because their caller died
        self._watchdog = asyncio.create_task(self._watch())
        self._lag = LoopLag()  # cluster/loop_lag.py: Serve skips a replica late to its probe
        self._lag_task = self._lag.start()
        self.telemetry.cold_start.record_engine(self.engine.startup)
        logger.info("replica %s ready: %s", replica, self.model_info_sync())

    # ---- the request path ----------------------------------------------------------------------
    async def generate(
        self,
        request: EngineRequest,
        handoff: TransferHandle | None = None,
        trace: TraceContext | None = None,
        pull: PeerPull | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutput deltas as the engine produces them; cancelling aborts the request.
        handoff: a decode replica's request resumed after its prefill, whose prompt blocks
        arrive through this transfer; trace: a sampled request's trace (cluster/tracing.py);
        pull: the prompt blocks to pull from a peer (the fleet router's, cluster/kv_pull.py)."""
        stream = self._admit(request, handoff, trace)
        rid = request.request_id
        finished = False
        output: RequestOutput | None = None
        try:  # a pull's wait is cancelled as the stream is: the stream goes, the ids are aborted
            if pull is not None and self.pulls is not None:
                await self.pulls.start(request, pull)  # failed or not worth it: computed here
            self._loop_thread.add(request)  # end-of-turn ids: the engine fills in the model's
            while not finished:
                output = await stream.next()
                finished = output.finished
                if finished and output.finish_reason in ("stop", "length"):
                    self.telemetry.count_slo(stream)
                yield output
        finally:
            self._streams.pop(rid, None)
            if not finished:  # cancelled by the ingress (a stop string, a client gone)
                self._loop_thread.abort([rid])
            if trace is not None:
                self._record_trace(trace, request, handoff is not None, output)

    def _admit(
        self, request: EngineRequest, handoff: TransferHandle | None, trace: TraceContext | None
    ) -> ReplicaStream:
        """The request's stream, once this replica may take it (OK, and its id not in flight)."""
        state = self._state()
        if state in (ReplicaState.FAILED, ReplicaState.STALLED):
            raise self._unavailable(state)
        if state is ReplicaState.DRAINING:
            raise ReplicaDrainingError("replica is shutting down")
        rid = request.request_id
        if rid in self._streams:
            raise ValueError(f"request_id: {rid!r} is already in flight")
        stream = self._streams[rid] = ReplicaStream(rid, caller=request.caller)
        self.telemetry.admitted(request)
        if handoff is not None and self.phase is not None:
            self.phase.handoffs[rid] = handoff
        if trace is not None:  # the engine records its phases (engine/tracing.py)
            self.engine.tracer.watch(rid, time.time_ns())
        return stream

    async def pull_command(self, command: PullCommand) -> TransferHandle | None:
        """Send a peer the prompt blocks it pulls (cluster/kv_pull.py), read on the engine thread
        between steps; None: pulls are off, or the blocks are no longer held."""
        if command.replica != self.replica:
            raise WrongReplicaError(f"pull for {command.replica} reached {self.replica}")
        pulls = self.pulls
        if pulls is None:
            return None
        return await self._loop_thread.call(lambda _: pulls.export(command))

    def _driven(self) -> Any:
        """The engine as the loop drives it: a phase of a disaggregated model, one that loads
        peer pulls, or the engine itself."""
        if self.phase is not None:
            return self.phase
        return self.pulls.engine if self.pulls is not None else self.engine

    async def prefill(
        self, request: EngineRequest, trace: TraceContext | None = None
    ) -> PrefillReply:
        """Compute the prompt and its first token, and send the prompt's blocks (a prefill
        replica of a disaggregated model)."""
        if self.phase is None or self.phase.prefill is None:
            raise ValueError("prefill: this replica is not a prefill replica")
        return await prefill_on(self.phase, request, self.generate(request, trace=trace))

    def _record_trace(
        self,
        trace: TraceContext,
        request: EngineRequest,
        handed_off: bool,
        last: RequestOutput | None,
    ) -> None:
        role = "whole" if self.phase is None else "prefill" if self.phase.prefill else "decode"
        source = "remote" if handed_off else "tiers"
        self.telemetry.record_trace(trace, self.engine, request, role, source, last)

    def _on_step(self, outputs: list[RequestOutput], stats: SchedulerStats) -> None:
        now = time.perf_counter()
        config = self.config
        interval = chunk_tokens(
            config.stream_interval, config.stream_chunks_per_step, len(self._streams)
        )
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # already gone: cancelled, or handed back
                continue
            self.telemetry.settle(stream, output, now)
            chunk = stream.chunk(output, interval)
            if chunk is not None:
                stream.queue.put_nowait(chunk)
        self._stats = stats
        self.telemetry.after_step(stats, self.engine)

    def _on_error(self, request_id: str | None, exc: BaseException) -> None:
        targets = (
            list(self._streams.values()) if request_id is None else [self._streams.get(request_id)]
        )
        for stream in targets:
            if stream is not None:
                stream.queue.put_nowait(exc)

    # ---- the watchdog ----------------------------------------------------------------------------
    async def _watch(self) -> None:
        """Every WATCHDOG_PERIOD_S: fail over a stalled engine's requests, abort a dead caller's."""
        while True:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            try:
                self._fail_over_if_stalled()
                await self._abort_orphans()
            except Exception:
                logger.exception("replica watchdog round failed")

    def _fail_over_if_stalled(self) -> None:
        """Hand every in-flight request to migration once the step in progress overruns its limit:
        the ingress resumes them elsewhere without waiting for Serve to replace this replica."""
        stalled = self._state() is ReplicaState.STALLED
        if stalled and not self._stall_failed_over:
            error = self._unavailable(ReplicaState.STALLED)
            logger.error("%s: failing over %d requests", error, len(self._streams))
            self._on_error(None, error)
        self._stall_failed_over = stalled

    async def _abort_orphans(self) -> None:
        callers = {stream.caller for stream in self._streams.values() if stream.caller is not None}
        if not callers:
            return
        gone = await self._callers.gone(callers)
        orphans = [rid for rid, stream in self._streams.items() if stream.caller in gone]
        if not orphans:
            return
        logger.warning(
            "aborting %d requests whose caller died (%s)", len(orphans), ", ".join(sorted(gone))
        )
        self._loop_thread.abort(orphans)
        self._orphans_aborted += len(orphans)
        for rid in orphans:
            self._streams[rid].queue.put_nowait(CallerGoneError(f"caller of {rid} died"))

    # ---- what the router, the ingress and Serve ask ---------------------------------------------
    def model_info_sync(self) -> dict[str, Any]:
        return {
            "max_model_len": self.engine.max_model_len,
            "block_size": self.config.block_size,
            "replica": self.replica,
        }

    async def model_info(self) -> dict[str, Any]:
        return self.model_info_sync()

    async def cold_start_report(self) -> dict[str, dict[str, float]]:
        """This replica's start by phase (cluster/cold_start.py), for bench/cold_start.py."""
        return self.telemetry.cold_start.report()

    async def stats(self) -> dict[str, Any]:
        """The latest scheduler figures (updated after every step and every abort)."""
        return {
            **RoutingStats(self._stats, self._state()).to_dict(),
            "replica": self.replica,
            "num_streams": len(self._streams),
            "orphans_aborted": self._orphans_aborted,
            "model_pids": self.engine.executor.pids,
            "engine_loop": {
                "steps": self._loop_thread.steps,
                "step_s": self._loop_thread.step_seconds,
            },
            "loop_lag": self._lag.report(),
            **phase_stats(self.phase),
            **(self.pulls.stats() if self.pulls is not None else {}),  # peer pulls (kv_pull.py)
        }

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve polls this for the request router: queues, KV usage, prefix-cache figures and the
        hashes of the most recently cached blocks (the router's prefix index syncs to them)."""
        prefix = tiers = predicted = kv_events = None
        state = self._state()
        if state is ReplicaState.OK:  # a failed or stopped engine answers no call
            try:
                prefix, tiers, predicted, kv_events = await asyncio.wait_for(
                    self._loop_thread.call(
                        lambda engine: (
                            engine.prefix_report(MAX_REPORTED_PREFIX_HASHES),
                            engine.tier_hashes(MAX_REPORTED_PREFIX_HASHES),
                            engine.predicted_load(),
                            self._kv_events.report(),  # cluster/kv_event_pub.py
                        )
                    ),
                    timeout=5,
                )
            except asyncio.TimeoutError:
                logger.warning("engine busy for 5 s: routing stats without prefix hashes")
        return RoutingStats(self._stats, state, prefix, tiers, predicted, kv_events).to_dict()

    async def list_loras(self) -> list[str]:
        """The adapters requests may name on this replica, in the order they were added."""
        # Read here, not on the engine thread: one list() of a dict (atomic under the GIL), so
        # /v1/models answers while a long step runs, or after the engine failed.
        return self.engine.list_loras()

    async def lora_command(self, command: LoraCommand) -> list[str]:
        """Add or remove an adapter at run time, on the engine's thread between steps (the running
        batch is not touched); returns the replica's adapters after it. A bad adapter raises
        ValueError, an unknown one UnknownLoraError, one in use LoraInUseError."""
        if command.replica != self.replica:
            raise WrongReplicaError(f"command for replica {command.replica} reached {self.replica}")
        if command.op == "add":
            # Read and checked off the engine's thread (a slow or stalled file stalls no step),
            # then handed to the ranks between steps.
            loras = self.engine.loras
            adapter = await asyncio.to_thread(loras.prepare, command.name, command.path)
            await self._loop_thread.call(lambda e: e.loras.register(adapter))
        else:
            await self._loop_thread.call(lambda e: e.remove_lora(command.name))
        logger.info("LoRA adapter %s: %s", command.name, command.op)
        return await self.list_loras()

    async def weights_command(self, command: WeightsCommand) -> dict[str, Any]:
        """Update the weights from a path, sleep or wake up, on the engine's thread between steps
        (cluster/weights_admin.py); the replica's sleep state after it. A bad checkpoint raises
        ValueError naming the tensor (the old weights keep serving)."""
        if command.replica != self.replica:
            raise WrongReplicaError(f"command for replica {command.replica} reached {self.replica}")
        state = await run_weights_command(self._loop_thread, self.engine, command)
        logger.info("weights %s: %s", command.op, state)
        return state

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve pushes this to the controller for the autoscaling policy."""
        return self.telemetry.signals(self._stats, self.config).to_dict()

    async def check_health(self) -> None:
        """Serve's probe: a failed, stalled or shut-down engine fails it, and Serve replaces this
        replica."""
        state = self._state()
        if state is not ReplicaState.OK:
            error = self._unavailable(state)
            logger.error("%s: failing the health check", error)
            raise error

    def _state(self) -> ReplicaState:
        """Where this replica stands: the one place that judges a failed or stalled engine."""
        if self._loop_thread.failure is not None:
            return ReplicaState.FAILED
        if self._loop_thread.stalled_for() > self.config.engine_stall_timeout_s:
            return ReplicaState.STALLED
        return ReplicaState.DRAINING if self._draining else ReplicaState.OK

    def _unavailable(self, state: ReplicaState) -> EngineFailedError:
        """Why a replica that is not OK serves nothing."""
        if state is ReplicaState.FAILED:
            return EngineFailedError(f"engine failed: {self._loop_thread.failure!r}")
        if state is ReplicaState.DRAINING:
            return EngineFailedError("replica shut down")
        return EngineFailedError(f"engine stalled for {self._loop_thread.stalled_for():.0f} s")

    # ---- shutdown --------------------------------------------------------------------------
    async def shutdown(self) -> dict[str, Any]:
        """Stop taking requests, hand every one in flight back to its ingress for migration (with
        the tokens it holds), and release the engine. Idempotent.

        Serve calls it through __del__; tests and operators may call it directly. Returns the
        replica's name and how many requests this call handed back.
        """
        streams: dict[str, ReplicaStream] = {}
        if not self._draining:
            self._draining = True
            streams, self._streams = self._streams, {}
            for stream in streams.values():
                stream.hand_back()
            if streams:
                logger.warning("shutting down: %d requests handed back", len(streams))
            self._watchdog.cancel()
            self._lag_task.cancel()
            # Never blocks the event loop: the engine thread releases the workers after its step.
            self._loop_thread.stop(shutdown_engine=True, wait=False)
        return {"replica": self.replica, "handed_back": len(streams)}

    async def __del__(self) -> None:
        """Serve's shutdown hook, awaited once at the end of a graceful stop.

        Serve 2.60's controller asks the replica actor to stop (perform_graceful_shutdown): it
        waits until no request is in flight, then awaits this method once (call_destructor,
        which accepts a coroutine), then kills the actor. Past graceful_shutdown_timeout_s the
        controller kills the actor without calling it; each ingress then resumes its requests
        from the tokens it has received. A garbage collector calling this would only make a
        coroutine that never runs, so nothing here depends on when, or whether, that happens.
        """
        if hasattr(self, "_loop_thread"):  # Serve calls it even when __init__ failed
            await self.shutdown()
