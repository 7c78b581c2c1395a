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
    # The last report's predicted remaining output tokens and the requests they cover (None: it
    # had none); this router's requests started since that report, which it cannot include.
    predicted_tokens: int | None = None
    predicted_requests: int = 0
    since_report: int = 0
    report_epoch: int = 0


@dataclass(slots=True)
class _InFlight:
    replica: str
    num_tokens: int
    confirmed: bool
    started_at: float
    epoch: int  # the replica's report_epoch when it started


class LoadTracker:
    """Per-replica load: exact in-flight counts of this router combined with late replica
    reports."""

    def __init__(
        self,
        tokens_per_request: int,
        kv_usage_weight: float,
        unconfirmed_ttl_s: float,
        load_signal: str = "requests",
        predicted_tokens_per_request: int = 128,
    ):
        self.tokens_per_request = tokens_per_request
        self.kv_usage_weight = kv_usage_weight
        self.unconfirmed_ttl_s = unconfirmed_ttl_s
        self.by_predicted_tokens = load_signal == "predicted_tokens"
        self.predicted_tokens_per_request = predicted_tokens_per_request
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
        """Load in request units: the larger of own and reported requests (load_signal requests)
        or the predicted remaining tokens in requests (predicted_tokens), plus token and KV
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
        requests: float = max(s.inflight_requests, s.reported_requests)
        if self.by_predicted_tokens and s.predicted_tokens is not None and s.predicted_requests:
            # The work the replica has left, in requests of predicted_tokens_per_request tokens:
            # its predicted tokens, one estimate for each of its requests the predictor could not
            # size, and one for each request this router sent it since it reported.
            unsized = max(0, s.reported_requests - s.predicted_requests) + s.since_report
            requests = s.predicted_tokens / self.predicted_tokens_per_request + unsized
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
        s = self._replicas.setdefault(replica, ReplicaLoad())
        self._requests[request_id] = _InFlight(replica, num_tokens, confirmed, now, s.report_epoch)
        if not confirmed:
            self._unconfirmed[request_id] = None
        s.inflight_requests += 1
        s.since_report += 1
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
            if entry.epoch == s.report_epoch:
                s.since_report -= 1
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
        predicted = stats.predicted
        s.predicted_tokens = None if predicted is None else predicted.tokens
        s.predicted_requests = 0 if predicted is None else predicted.requests
        s.report_epoch += 1  # the requests started before now are in this report
        s.since_report = 0
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
