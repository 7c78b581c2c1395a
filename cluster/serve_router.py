"""FleetRouter: the Ray Serve RequestRouter that spreads LLMReplica requests by load and prefix
affinity.

A thin adapter: the policies, load accounting and prefix index live in router/.
Attach it through the deployment's request_router_config (request_router_class
"cluster.serve_router.FleetRouter"); request_router_kwargs are initialize_state's keyword arguments.

The ingress tells the routers of its process how each request it sent ended
(cluster/outcomes.py `report_outcome`), so a replica that keeps failing requests trips its
circuit breaker even while its stats still say `ok`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from cluster.fleet_view import register
from cluster.kv_event_pub import subscribe_kv_tails
from cluster.lora_admin import LoraCommand
from cluster.outcomes import subscribe
from cluster.tracing import TraceContext, record_route
from cluster.weights_admin import WeightsCommand
from router.config import RoutingConfig
from router.fleet import FleetState, Route
from router.peer_pull import PullCommand
from router.policies import RouteRequest
from router.sessions import check_session_id
from router.stats import RoutingStats
from scheduler.kv_events import KVEventTail

logger = logging.getLogger(__name__)

ROUTER_CLASS_PATH = "cluster.serve_router.FleetRouter"


class FleetRouter(RequestRouter):
    """Ranks replicas with a router/ policy and keeps its load and prefix state current."""

    def initialize_state(self, **router_kwargs: Any) -> None:
        """Called by Serve with request_router_kwargs: the settings of router.config.RoutingConfig
        (router_policy, imbalance_threshold, ..., circuit_breaker_failures,
        circuit_breaker_cooldown_s)."""
        config = RoutingConfig.from_router_kwargs(router_kwargs)
        self.fleet = FleetState(config)
        # Each replica's report as Serve last handed it: Serve hands the same dict with every
        # request until the next report comes, and each is parsed once.
        self._reports: dict[str, dict[str, Any]] = {}
        # The routing state's time: a test moves it past a circuit's cool-down instead of waiting.
        self.clock: Callable[[], float] = time.monotonic
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop Serve routes on, once known
        self._alive: frozenset[str] = frozenset()  # the running replicas, as Serve last listed them
        subscribe(self)
        subscribe_kv_tails(self)
        register(self)
        logger.info("FleetRouter for %s: %s", self._deployment_id, config)

    def replica_reports(self) -> dict[str, RoutingStats]:
        """Each live replica's latest report (the ingress's /metrics page shows them)."""
        return self.fleet.reports()

    def replica_ids(self) -> set[str]:
        """The running replicas (the ingress sends run-time adapter changes to each)."""
        return set(self._alive)

    def deployment_name(self) -> str:
        """The deployment whose replicas this router ranks (an app may serve several models)."""
        return self._deployment_id.name

    def post_outcome(self, internal_request_id: str, ok: bool) -> None:
        """Hand a request's outcome to the routing loop (callers run on another thread)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._apply_outcome, internal_request_id, ok)

    def post_kv_tail(self, tail: KVEventTail) -> None:
        """Hand the KV events an output carried to the routing loop (cluster/kv_event_pub.py):
        queued there before the client can send its next request, so applied before it routes."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._apply_kv_tail, tail)

    def _apply_kv_tail(self, tail: KVEventTail) -> None:
        if tail.replica not in self._alive:  # another deployment's replica, or a dead one
            return
        try:
            tail.check()  # unpickled without its constructor's checks
        except ValueError as e:
            logger.warning("FleetRouter: ignoring KV events of %s: %s", tail.replica, e)
            return
        self.fleet.on_kv_tail(tail, self.clock())

    def _apply_outcome(self, internal_request_id: str, ok: bool) -> None:
        replica = self.fleet.on_outcome(internal_request_id, ok, self.clock())
        if replica is not None and not ok:
            logger.info(
                "FleetRouter: request %s failed on replica %s", internal_request_id, replica
            )

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """One replica per rank, best first; Serve takes the first rank whose replica has room."""
        self._loop = asyncio.get_running_loop()
        if not candidate_replicas:
            return []
        now = self.clock()
        by_key = self._observe_all(candidate_replicas, now)
        if pending_request is None:
            return [candidate_replicas]
        # Every candidate is in the ranking below (none of them: all reported themselves failed,
        # stalled or draining), so Serve should back off before asking again. Without it Serve
        # retries at once, without awaiting: the loop spins and never applies the replica update
        # that would bring a healthy replica.
        pending_request.routing_context.should_backoff = True
        target = _target_of(pending_request)
        if target is not None and target in by_key:  # a command for one replica (lora_admin.py)
            return [[by_key[target]]]
        ranking = self._rank(pending_request, by_key, now)
        return [[by_key[key]] for key in ranking]

    def _observe_all(
        self, candidates: list[RunningReplica], now: float
    ) -> dict[str, RunningReplica]:
        """The candidates by replica key, each one's latest routing stats applied."""
        by_key = {r.replica_id.unique_id: r for r in candidates}
        for key, replica in by_key.items():
            self._observe_stats(key, replica.routing_stats, now)
        return by_key

    def _rank(
        self, pending_request: PendingRequest, by_key: dict[str, RunningReplica], now: float
    ) -> list[str]:
        """The fleet's ranking of the candidates for a request, its peer pull attached to it and
        the routing recorded in its trace when it is sampled."""
        trace = pending_request.kwargs.get("trace")  # a sampled request's (cluster/tracing.py)
        started = time.time_ns() if trace is not None else 0
        route = self.fleet.plan(route_request(pending_request), by_key, now)
        _attach_pull(pending_request, route)
        if isinstance(trace, TraceContext):
            self._record_route(trace, started, route.ranking)
        return route.ranking

    def _record_route(self, trace: TraceContext, started: int, ranking: list[str]) -> None:
        try:
            record_route(trace, started, time.time_ns(), self.fleet.config.router_policy, ranking)
        except Exception:  # a tracing failure is logged, never the request's
            logger.exception("FleetRouter: the routing span was not recorded")

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        self.fleet.on_routed(route_request(pending_request), replica_id.unique_id, self.clock())

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.fleet.on_completed(internal_request_id, self.clock())

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._reports.pop(replica_id.unique_id, None)
        if self.fleet.remove_replica(replica_id.unique_id):
            logger.warning(
                "FleetRouter: replica %s died; dropped from the prefix index", replica_id.unique_id
            )

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive = {r.replica_id.unique_id for r in replicas}
        self._alive = frozenset(alive)
        self._reports = {key: report for key, report in self._reports.items() if key in alive}
        self.fleet.retain(alive)
        # Serve broadcasts the replicas again with each new report: taken in now, every one (a
        # KV-event snapshot included), not only the latest when the next request comes.
        now = self.clock()
        for replica in replicas:
            self._observe_stats(replica.replica_id.unique_id, replica.routing_stats, now)

    def _observe_stats(self, key: str, report: dict[str, Any], now: float) -> None:
        if not report or report is self._reports.get(key):
            return
        self._reports[key] = report
        try:
            stats = RoutingStats.from_dict(report)
        except ValueError as e:
            # A malformed report must not stop routing; load then falls back to own counts.
            logger.warning("FleetRouter: ignoring routing stats of %s: %s", key, e)
            return
        self.fleet.on_stats(key, stats, now)


def _attach_pull(pending_request: PendingRequest, route: Route) -> None:
    """A generation's peer pull travels with it to the replica ranked first (none: whatever an
    earlier routing of the same request attached is dropped)."""
    if pending_request.metadata.call_method != "generate":
        return
    pending_request.kwargs.pop("pull", None)
    if route.pull is not None:
        pending_request.kwargs["pull"] = route.pull


def route_request(pending_request: PendingRequest) -> RouteRequest:
    """The routing view of a request whose first argument is a scheduler.request.EngineRequest.

    Any other argument is routed by load alone: no block hashes, no token cost.
    """
    request_id = pending_request.metadata.internal_request_id
    arg = pending_request.args[0] if pending_request.args else None
    block_hashes = getattr(arg, "block_hashes", None) or ()
    prompt = getattr(arg, "prompt_token_ids", None) or ()
    max_tokens = getattr(getattr(arg, "sampling_params", None), "max_tokens", None) or 0
    lora_name = getattr(arg, "lora_name", None)
    return RouteRequest(
        request_id,
        len(prompt) + int(max_tokens),
        list(block_hashes),
        lora_name if isinstance(lora_name, str) else None,
        _session_of(pending_request),
    )


def _session_of(pending_request: PendingRequest) -> str | None:
    """The session the caller named (`handle.options(session_id=...)`, which the ingress sets from
    the request's session: deploy/ingress.py); None when it named none, or one the router cannot
    key (the ingress refuses those with a 400 first)."""
    session = getattr(pending_request.metadata, "session_id", "")
    if not session:
        return None
    try:
        return check_session_id(session)
    except ValueError as e:
        logger.warning("FleetRouter: routing without the session: %s", e)
        return None


def _target_of(pending_request: PendingRequest) -> str | None:
    """The replica a LoraCommand, WeightsCommand or PullCommand names (None: an ordinary request,
    ranked by the policy)."""
    arg = pending_request.args[0] if pending_request.args else None
    return arg.replica if isinstance(arg, (LoraCommand, WeightsCommand, PullCommand)) else None
