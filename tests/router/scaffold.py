"""What the router's tests build: fleets, their load, and replica reports as the router receives
them."""

from __future__ import annotations

import itertools

from router.config import RoutingConfig
from router.fleet import FleetState
from router.policies import RouteRequest
from router.stats import ReplicaState, RoutingStats
from scheduler.block_manager import PrefixReport
from scheduler.outputs import SchedulerStats

_ids = itertools.count()


def fleet(**config) -> FleetState:
    return FleetState(RoutingConfig(**config))


def busy(state: FleetState, replica: str, n: int, now: float = 0.0) -> None:
    """Charge replica with n more confirmed requests that carry no prefix."""
    for _ in range(n):
        state.on_routed(RouteRequest(f"busy-{next(_ids)}"), replica, now)


def fail_on(state: FleetState, replica: str, n: int, now: float) -> None:
    """n requests routed to replica whose caller then reports a replica failure."""
    for _ in range(n):
        request = RouteRequest(f"doomed-{next(_ids)}", 10, [])
        state.on_routed(request, replica, now)
        assert state.on_outcome(request.request_id, ok=False, now=now) == replica


def report(
    num_waiting: int = 0,
    num_running: int = 0,
    kv_cache_usage: float = 0.0,
    state: str = "ok",
    prefix: PrefixReport | list[int] | None = None,
) -> RoutingStats:
    """A report with these figures (the rest zero); a list prefix is a report numbered 0 that names
    no base, so the router compares it with the list before."""
    if isinstance(prefix, list):
        prefix = PrefixReport(prefix, 0)
    figures = SchedulerStats(num_waiting, num_running, 0, kv_cache_usage, 0.0, 0)
    return RoutingStats(figures, ReplicaState(state), prefix)
