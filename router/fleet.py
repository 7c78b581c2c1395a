"""FleetState: everything the fleet router knows (loads, prefix index, circuits) and the policy that
reads it.

No Ray here. cluster/serve_router.py adapts it to Serve's RequestRouter; sim/ drives the same object
with
its own clock. Replicas are named by plain strings (Serve's replica unique ids).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from router.circuit_breaker import CircuitBreaker
from router.config import RoutingConfig
from router.loads import LoadTracker
from router.policies import RouteRequest, make_policy
from router.prefix_index import PrefixIndex, ReportChange

MAX_RECENT_ROUTES = 65_536


class FleetState:
    """Everything the fleet router knows: loads, the prefix index, and the policy that reads
    them."""

    def __init__(self, config: RoutingConfig):
        self.config = config
        self.loads = LoadTracker(
            config.tokens_per_request, config.kv_usage_weight, config.unconfirmed_ttl_s
        )
        self.index = PrefixIndex(config.max_index_blocks)
        self.policy = make_policy(config)
        self.routed: Counter[str] = (
            Counter()
        )  # requests Serve confirmed, per replica (logs, benches)
        self.breaker = CircuitBreaker(
            config.circuit_breaker_failures, config.circuit_breaker_cooldown_s
        )
        # request id -> replica of recently routed requests, so a failure reported later is
        # attributed.
        self._recent: OrderedDict[str, str] = OrderedDict()
        self._stats_seen: dict[str, Mapping[str, Any]] = {}
        self._sorted: tuple[tuple[str, ...], list[str]] = (
            (),
            [],
        )  # last replica set and its sorted names

    def route(self, request: RouteRequest, replicas: Iterable[str], now: float) -> list[str]:
        """Replicas ranked best first for request; the first is provisionally charged with it."""
        candidates = self._candidates(replicas, now)
        if not candidates:
            return []
        ranking = self.policy.rank(candidates, request, self)
        self._picked(request, ranking[0], now)
        return ranking

    def pick(self, request: RouteRequest, replicas: Iterable[str], now: float) -> str | None:
        """route(...)[0], with the same state changes, without ranking the rest (a simulator's
        fleet)."""
        candidates = self._candidates(replicas, now)
        if not candidates:
            return None
        best = self.policy.best(candidates, request, self)
        self._picked(request, best, now)
        return best

    def _candidates(self, replicas: Iterable[str], now: float) -> list[str]:
        # A replica that reports itself failed, stalled or draining is never picked.
        healthy = self._healthy_sorted(replicas)
        if not healthy:
            return []
        self.loads.expire(now)
        # An open circuit skips its replica, unless every circuit is open: then the requests' own
        # migration limit, not the router, decides when to give up.
        if self.breaker.any_open():
            return [r for r in healthy if self.breaker.allows(r, now)] or healthy
        return healthy

    def _picked(self, request: RouteRequest, replica: str, now: float) -> None:
        self.breaker.on_picked(replica, now)
        # Charged now, not when Serve confirms: a burst routes before any confirmation comes back.
        self._charge(request, replica, now, confirmed=False)

    def _healthy_sorted(self, replicas: Iterable[str]) -> list[str]:
        # The replica set rarely changes between requests: sort it once per change, not per request.
        # A caller that passes the same tuple again (a simulator's fleet) skips even the copy: at
        # 1,000 replicas it touches 1,000 name objects scattered over memory.
        key = replicas if type(replicas) is tuple else tuple(replicas)
        if key is not self._sorted[0] and key != self._sorted[0]:
            self._sorted = (key, sorted(set(key)))
        unhealthy = self.loads.unhealthy
        # The cached list itself while all are healthy (no caller mutates it): policies key caches
        # on it.
        return [r for r in self._sorted[1] if r not in unhealthy] if unhealthy else self._sorted[1]

    def on_routed(self, request: RouteRequest, replica: str, now: float) -> None:
        """Serve sent request to replica (it may differ from the ranking's first if that one was
        full)."""
        self._charge(request, replica, now, confirmed=True)
        self.routed[replica] += 1
        self._recent[request.request_id] = replica
        self._recent.move_to_end(request.request_id)
        while len(self._recent) > MAX_RECENT_ROUTES:
            self._recent.popitem(last=False)

    def on_outcome(self, request_id: str, ok: bool, now: float) -> str | None:
        """The ingress's verdict on a request this router sent: a success or a replica failure.

        Returns the replica it is attributed to (None for a request routed too long ago)."""
        replica = self._recent.pop(request_id, None)
        if replica is None:
            return None
        if ok:
            self.breaker.record_success(replica, now)
        else:
            self.breaker.record_failure(replica, now)
        return replica

    def on_completed(self, request_id: str) -> None:
        self.loads.finish(request_id)

    def on_stats(self, replica: str, stats: Mapping[str, Any], now: float) -> None:
        """Apply a replica's routing stats once per distinct report."""
        seen = self._stats_seen.get(replica)
        # Serve re-broadcasts the last report with every replica-set change; re-applying an old
        # prefix report after the grace window would drop blocks planted since it was taken.
        if stats is seen or stats == seen:
            return
        self._stats_seen[replica] = stats
        self.loads.report(replica, stats)
        if self.loads.is_healthy(replica):
            self.breaker.record_healthy_report(replica, now)
        prefix_hashes = stats.get("prefix_hashes")
        if prefix_hashes is not None:
            self.index.sync_replica(
                replica, prefix_hashes, now, self.config.stats_grace_s, ReportChange.of(stats)
            )

    def remove_replica(self, replica: str) -> bool:
        """Forget a dead or removed replica at once: its load, its requests, its index entries.

        False if there was nothing to forget (Serve reports a death once per failed request)."""
        known = (
            replica in self.loads.replicas()
            or replica in self.index.replicas()
            or replica in self._stats_seen
        )
        self.loads.remove_replica(replica)
        self.index.remove_replica(replica)
        self.breaker.forget(replica)
        self._stats_seen.pop(replica, None)
        return known

    def retain(self, replicas: Iterable[str]) -> None:
        """Forget every replica not in replicas."""
        alive = set(replicas)
        known = (
            self.loads.replicas()
            | self.index.replicas()
            | set(self._stats_seen)
            | self.breaker.replicas()
        )
        for replica in known - alive:
            self.remove_replica(replica)

    def _charge(self, request: RouteRequest, replica: str, now: float, confirmed: bool) -> None:
        self.loads.start(request.request_id, replica, request.num_tokens, now, confirmed)
        if request.block_hashes:
            self.index.insert(replica, request.block_hashes, now)
