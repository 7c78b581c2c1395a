"""Per-replica load as the router sees it: its own exact in-flight counts and the replicas' late
reports."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from router.stats import ReplicaState, RoutingStats


@dataclass(slots=True)
class ReplicaLoad:
    """The router's view of one replica: its own in-flight counts plus the replica's last report."""

    inflight_requests: int = 0
    inflight_tokens: int = 0
    reported_requests: int = 0
    kv_cache_usage: float = 0.0
    healthy: bool = True  # the last report's state was OK


@dataclass(slots=True)
class _InFlight:
    replica: str
    num_tokens: int
    confirmed: bool
    started_at: float


class LoadTracker:
    """Per-replica load: exact in-flight counts of this router combined with late replica
    reports."""

    def __init__(self, tokens_per_request: int, kv_usage_weight: float, unconfirmed_ttl_s: float):
        self.tokens_per_request = tokens_per_request
        self.kv_usage_weight = kv_usage_weight
        self.unconfirmed_ttl_s = unconfirmed_ttl_s
        self._replicas: dict[str, ReplicaLoad] = {}
        self._requests: dict[str, _InFlight] = {}
        # Derived, kept current by every change above: each replica's load, the unconfirmed requests
        # (all that expire() must look at) and the replicas that reported themselves unhealthy.
        self._load: dict[str, float] = {}
        self._unconfirmed: dict[str, None] = {}
        self.unhealthy: set[str] = set()

    def get(self, replica: str) -> ReplicaLoad:
        return self._replicas.get(replica) or ReplicaLoad()

    def load(self, replica: str) -> float:
        """Load in request units: the larger of own and reported requests, plus token and KV
        terms."""
        return self._load.get(replica, 0.0)

    def loads(self, replicas: Iterable[str]) -> list[float]:
        """load() of each replica, in order."""
        load = self._load.get
        return [load(r, 0.0) for r in replicas]

    def _refresh(self, replica: str) -> None:
        s = self._replicas[replica]
        # Reports are 1-2 s late but include other routers' traffic; own counts are exact but local.
        # The max never under-counts either source without double counting this router's requests.
        requests = max(s.inflight_requests, s.reported_requests)
        self._load[replica] = (
            requests
            + s.inflight_tokens / self.tokens_per_request
            + self.kv_usage_weight * s.kv_cache_usage
        )

    def start(
        self, request_id: str, replica: str, num_tokens: int, now: float, confirmed: bool
    ) -> None:
        """Count request_id against replica (moving it if it was counted elsewhere)."""
        self.finish(request_id)
        self._requests[request_id] = _InFlight(replica, num_tokens, confirmed, now)
        if not confirmed:
            self._unconfirmed[request_id] = None
        s = self._replicas.setdefault(replica, ReplicaLoad())
        s.inflight_requests += 1
        s.inflight_tokens += num_tokens
        self._refresh(replica)

    def finish(self, request_id: str) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        self._unconfirmed.pop(request_id, None)
        s = self._replicas.get(entry.replica)
        if s is not None:
            s.inflight_requests -= 1
            s.inflight_tokens -= entry.num_tokens
            self._refresh(entry.replica)

    def expire(self, now: float) -> None:
        """Forget unconfirmed decisions older than the TTL (their request never reached a
        replica)."""
        stale = [
            rid
            for rid in self._unconfirmed
            if now - self._requests[rid].started_at > self.unconfirmed_ttl_s
        ]
        for rid in stale:
            self.finish(rid)

    def report(self, replica: str, stats: RoutingStats) -> None:
        """Apply a replica's report: its queues, KV usage and state."""
        s = self._replicas.setdefault(replica, ReplicaLoad())
        s.reported_requests = stats.scheduler.num_waiting + stats.scheduler.num_running
        s.healthy = stats.state is ReplicaState.OK
        s.kv_cache_usage = min(1.0, max(0.0, stats.scheduler.kv_cache_usage))
        if s.healthy:
            self.unhealthy.discard(replica)
        else:
            self.unhealthy.add(replica)
        self._refresh(replica)

    def remove_replica(self, replica: str) -> None:
        self._replicas.pop(replica, None)
        self._load.pop(replica, None)
        self.unhealthy.discard(replica)
        for rid in [rid for rid, e in self._requests.items() if e.replica == replica]:
            del self._requests[rid]
            self._unconfirmed.pop(rid, None)

    def replicas(self) -> set[str]:
        return set(self._replicas)

    def is_healthy(self, replica: str) -> bool:
        """False once the replica reported itself failed, stalled or draining."""
        return replica not in self.unhealthy

    def num_inflight(self) -> int:
        return len(self._requests)
