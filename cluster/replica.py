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
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from ray import serve

from cluster.caller_watch import CallerGoneError, CallerWatch
from cluster.cold_start import ColdStart
from cluster.disagg_replica import DisaggPhase, phase_engine, phase_stats, prefill_on
from cluster.engine_loop import EngineLoop
from cluster.errors import EngineFailedError, ReplicaDrainingError
from cluster.kv_event_pub import TailingEngine, attach_kv_events
from cluster.kv_pull import replica_pulls
from cluster.lora_admin import LoraCommand, WrongReplicaError
from cluster.lora_metrics import LoraMetrics
from cluster.metrics import ReplicaMetrics
from cluster.ray_executor import ray_executor
from cluster.stream_chunks import chunk_tokens
from cluster.tracing import ReplicaSide, TraceContext, record_replica
from cluster.weights_admin import WeightsCommand
from cluster.weights_admin import run_command as run_weights_command
from engine.config import EngineConfig
from router.autoscaling import LatencyWindow, ReplicaSignals, SloTargets
from router.peer_pull import PeerPull, PullCommand
from router.stats import MAX_REPORTED_PREFIX_HASHES, ReplicaState, RoutingStats
from scheduler.outputs import RequestOutput, SchedulerStats
from scheduler.request import EngineRequest
from workers.kv_transfer import TransferHandle

if TYPE_CHECKING:
    from engine.core import EngineCore
    from engine.disagg import PrefillReply

logger = logging.getLogger(__name__)

T = TypeVar("T")


def merge_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two deltas of one request as one (the consumer fell behind by a step)."""
    logprobs = None
    if first.new_logprobs is not None or later.new_logprobs is not None:
        logprobs = (first.new_logprobs or []) + (later.new_logprobs or [])
    return RequestOutput(
        request_id=later.request_id,
        new_token_ids=first.new_token_ids + later.new_token_ids,
        finished=later.finished,
        finish_reason=later.finish_reason,
        num_prompt_tokens=later.num_prompt_tokens or first.num_prompt_tokens,
        num_output_tokens=later.num_output_tokens,
        num_cached_tokens=later.num_cached_tokens,
        new_logprobs=logprobs,
        error=later.error,
        prompt_logprobs=first.prompt_logprobs or later.prompt_logprobs,
        kv_events=later.kv_events,
    )


@dataclass(slots=True)
class _Stream:
    """Event-loop side of one in-flight request."""

    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    caller: str | None = None  # the caller actor's name (its death aborts the request)
    arrival: float = field(default_factory=time.perf_counter)
    last_token: float | None = None
    ttft: float | None = None
    gaps: int = 0  # inter-token gaps so far, and those over the SLO's ITL
    slow_gaps: int = 0
    sent: bool = False  # a delta with tokens has gone out (the first tokens are never held back)
    held: RequestOutput | None = None  # tokens waiting for a full chunk (stream_interval)

    def chunk(self, output: RequestOutput, interval: int) -> RequestOutput | None:
        """The delta to send now, or None while it is held for a chunk of `interval` tokens; the
        first tokens, a finish and an error are never held."""
        if self.held is not None:
            output, self.held = merge_outputs(self.held, output), None
        if (
            self.sent
            and not output.finished
            and output.error is None
            and len(output.new_token_ids) < interval
        ):
            self.held = output
            return None
        self.sent = self.sent or bool(output.new_token_ids)
        return output

    def hand_back(self) -> None:
        """End the stream with an "abort" that carries every token it still holds (queued deltas
        merge into it in next()): the ingress sends their text, then resumes the request on
        another replica from there."""
        if self.held is None:
            last = RequestOutput(self.request_id, [], True, "abort")
        else:
            last, self.held = replace(self.held, finished=True, finish_reason="abort"), None
        self.queue.put_nowait(last)

    async def next(self) -> RequestOutput:
        item = await self.queue.get()
        while isinstance(item, RequestOutput) and not item.finished and not self.queue.empty():
            nxt = self.queue.get_nowait()
            if not isinstance(nxt, RequestOutput):
                item = nxt
                break
            item = merge_outputs(item, nxt)
        if isinstance(item, BaseException):
            raise item
        return item


# The window of the TTFT and ITL p90 a replica reports to the autoscaling policy.
LATENCY_WINDOW_S = 30.0
# How often the watchdog looks for a stalled engine and for requests whose caller died.
WATCHDOG_PERIOD_S = 1.0
# Where Serve puts every replica actor, the ingress replicas that call us included (the runtime
# context's namespace is the job's, not this one).
SERVE_NAMESPACE = "serve"


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
        self.slo = slo
        self.replica = replica = serve.get_replica_context().replica_tag
        self.lora_metrics = LoraMetrics(replica, model_name or config.model)
        self.metrics = ReplicaMetrics(replica, model_name or config.model)
        self.cold_start = ColdStart(model_name or config.model, replica)
        self._ttft_window = LatencyWindow(LATENCY_WINDOW_S)
        self._itl_window = LatencyWindow(LATENCY_WINDOW_S)
        self.engine = build_engine(config)
        self.metrics.record_kv_layout(self.engine.kv_bytes_per_token)
        self.phase = phase_engine(self.engine, phase)
        # Peer pulls (router_kwargs.peer_pulls) install their connector before the events attach.
        self.pulls = replica_pulls(self.engine, replica) if phase is None else None
        self._kv_events = attach_kv_events(self.engine)  # before the first step: none missed
        self._streams: dict[str, _Stream] = {}
        self._draining = False
        self._stats: SchedulerStats = self.engine.stats()
        self.metrics.record_stats(self._stats)
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
        self.cold_start.record_engine(self.engine.startup)
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
        state = self._state()
        if state in (ReplicaState.FAILED, ReplicaState.STALLED):
            raise self._unavailable(state)
        if state is ReplicaState.DRAINING:
            raise ReplicaDrainingError("replica is shutting down")
        rid = request.request_id
        if rid in self._streams:
            raise ValueError(f"request_id: {rid!r} is already in flight")
        stream = self._streams[rid] = _Stream(rid, caller=request.caller)
        self.cold_start.first_request()
        self.metrics.record_admitted(len(request.prompt_token_ids))
        if request.lora_name is not None:
            self.lora_metrics.record_request(request.lora_name)
        if handoff is not None and self.phase is not None:
            self.phase.handoffs[rid] = handoff
        if trace is not None:  # the engine records its phases (engine/tracing.py)
            self.engine.tracer.watch(rid, time.time_ns())
        if pull is not None and self.pulls is not None:
            await self.pulls.start(request, pull)  # failed or not worth it: computed here
        self._loop_thread.add(request)  # end-of-turn ids: the engine fills in the model's
        finished = False
        output: RequestOutput | None = None
        try:
            while not finished:
                output = await stream.next()
                finished = output.finished
                if finished and output.finish_reason in ("stop", "length"):
                    self._count_slo(stream)
                yield output
        finally:
            self._streams.pop(rid, None)
            if not finished:  # cancelled by the ingress (a stop string, a client gone)
                self._loop_thread.abort([rid])
            if trace is not None:
                self._record_trace(trace, request, handoff is not None, output)

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
        """The request's spans on this replica, from the engine's record; a tracing failure is
        logged, never the request's."""
        record = self.engine.tracer.pop(request.request_id)
        if record is None:
            return
        role = "whole" if self.phase is None else "prefill" if self.phase.prefill else "decode"
        made = 0 if last is None else last.num_output_tokens - len(request.output_token_ids)
        side = ReplicaSide(
            self.replica,
            request.request_id,
            len(request.prompt_token_ids),
            max(made, 0),
            role,
            "remote" if handed_off else "tiers",
        )
        try:
            record_replica(trace, side, record, time.time_ns())
        except Exception:
            logger.exception("request %s: its spans were not recorded", request.request_id)

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
            self._settle(stream, output, now)
            chunk = stream.chunk(output, interval)
            if chunk is not None:
                stream.queue.put_nowait(chunk)
        self._stats = stats
        self.metrics.record_stats(stats)
        self.metrics.record_expert_load(self.engine.expert_load())
        slots = self.engine.scheduler.loras  # plain counters, read as expert_load() is
        self.lora_metrics.record_slots(stats.loaded_loras, slots.num_loads, slots.num_evictions)

    def _settle(self, stream: _Stream, output: RequestOutput, now: float) -> None:
        """The output's tokens in the metrics, with the time to the first and between the next."""
        if not output.new_token_ids:
            return
        last = stream.last_token
        ttft = now - stream.arrival if last is None else None
        itl = None if last is None else now - last
        if last is None:
            self.cold_start.first_token()
        self.metrics.record_tokens(len(output.new_token_ids), ttft=ttft, itl=itl)
        stream.last_token = now
        if ttft is not None:
            stream.ttft = ttft
            self._ttft_window.add(now, ttft)
        if itl is not None:
            self._itl_window.add(now, itl)
            stream.gaps += 1
            stream.slow_gaps += self.slo is not None and itl > self.slo.itl_p90_s

    def _count_slo(self, stream: _Stream) -> None:
        """A request that ended by itself met the SLO if its TTFT did and at most a tenth of its
        inter-token gaps exceeded the ITL target (its ITL p90 met it)."""
        if self.slo is None or stream.ttft is None:
            return
        met = stream.ttft <= self.slo.ttft_p90_s and stream.slow_gaps * 10 <= stream.gaps
        self.metrics.record_slo(met)

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
        return self.cold_start.report()

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
        """Serve pushes this to the controller for the autoscaling policy
        (cluster/autoscaling_policy.py): KV usage, queues and backlog, batch size against
        max_num_seqs, and the TTFT and ITL p90 over the last LATENCY_WINDOW_S (-1: no samples)."""
        stats, now = self._stats, time.perf_counter()
        return ReplicaSignals(
            kv_cache_usage=min(1.0, stats.kv_cache_usage),
            num_waiting=stats.num_waiting,
            num_waiting_prompt_tokens=stats.num_waiting_prompt_tokens,
            num_running=stats.num_running,
            max_num_seqs=self.config.scheduler.max_num_seqs,
            ttft_p90_s=self._ttft_window.p90(now),
            itl_p90_s=self._itl_window.p90(now),
            kv_cache_tokens=stats.num_gpu_blocks * self.config.block_size,
        ).to_dict()

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
        streams: dict[str, _Stream] = {}
        if not self._draining:
            self._draining = True
            streams, self._streams = self._streams, {}
            for stream in streams.values():
                stream.hand_back()
            if streams:
                logger.warning("shutting down: %d requests handed back", len(streams))
            self._watchdog.cancel()
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
