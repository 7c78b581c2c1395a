"""Per-replica load as the router sees it: its own exact in-flight counts and the replicas' late
reports."""

from __future__ import annotations

from array import array
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any


@dataclass(slots=True)
class ReplicaLoad:
    """The router's view of one replica: its own in-flight counts plus the replica's last report."""

    inflight_requests: int = 0
    inflight_tokens: int = 0
    reported_requests: int = 0
    kv_cache_usage: float = 0.0
    healthy: bool = True  # the last report's state was "ok"


@dataclass(slots=True)
class _InFlight:
    replica: str
    num_tokens: int
    confirmed: bool
    started_at: float


class _Aligned:
    """A per-replica figure laid out in the order of the replica list last asked for, kept current.

    The router asks again with the same list object while the replica set stays as it is, so a pick
    at 1,000 replicas reads a ready list instead of looking up 1,000 names. The figures lie in one
    array of machine numbers (typecode "d" or "q"): a pass over the fleet reads contiguous memory,
    where a list's number objects would lie wherever each update allocated them.
    """

    def __init__(
        self,
        value_of: Callable[[str], float],
        values_of: Callable[[Sequence[str]], list[float]],
        typecode: str,
    ):
        self._value_of = value_of
        self._values_of = values_of  # value_of for each, in C-level passes
        self._typecode = typecode
        self._listed: Sequence[str] | None = None
        self._slot: dict[str, int] = {}
        self._values: array[float] = array(typecode)
        # The smallest of _values, kept through the changes that cannot raise it (None: find it
        # again); the figures are finite, so it is one value whatever the order.
        self._least: float | None = None

    def values(self, replicas: Sequence[str]) -> array[float]:
        if replicas is not self._listed:
            self._listed = replicas if isinstance(replicas, list) else None
            self._slot = {r: i for i, r in enumerate(replicas)}
            self._values = array(self._typecode, self._values_of(replicas))
            self._least = None
        return self._values

    def least(self, replicas: Sequence[str]) -> float:
        """min(values(replicas)), which mostly needs no pass over the fleet; replicas non-empty."""
        values = self.values(replicas)
        if self._least is None:
            self._least = min(values)
        return self._least

    def update(self, replica: str) -> None:
        """replica's figure changed: re-read it if it is listed."""
        slot = self._slot.get(replica)
        if slot is not None:
            old, new = self._values[slot], self._value_of(replica)
            self._values[slot] = new
            least = self._least
            if least is not None and (new < least or old == least != new):
                self._least = new if new < least else None


class LoadTracker:
    """Per-replica load: exact in-flight counts of this router combined with late replica
    reports."""

    def __init__(self, tokens_per_request: int, kv_usage_weight: float, unconfirmed_ttl_s: float):
        self.tokens_per_request = tokens_per_request
        self.kv_usage_weight = kv_usage_weight
        self.unconfirmed_ttl_s = unconfirmed_ttl_s
        self._replicas: dict[str, ReplicaLoad] = {}
        self._requests: dict[str, _InFlight] = {}
        # Derived, kept current by every change above, so ranking a large fleet costs no Python
        # call per replica: each replica's load (0.0 when unknown), the unconfirmed requests (all
        # that expire() must look at) and the replicas that reported themselves unhealthy.
        self._load: defaultdict[str, float] = defaultdict(float)
        self._aligned = _Aligned(
            lambda replica: self._load.get(replica, 0.0),
            lambda replicas: list(map(self._load.get, replicas, repeat(0.0))),
            "d",
        )
        self._unconfirmed: dict[str, None] = {}
        self.unhealthy: set[str] = set()

    def get(self, replica: str) -> ReplicaLoad:
        return self._replicas.get(replica) or ReplicaLoad()

    def load(self, replica: str) -> float:
        """Load in request units: the larger of own and reported requests, plus token and KV
        terms."""
        return self._load.get(replica, 0.0)

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
        self._aligned.update(replica)

    def by_load(self, replicas: list[str]) -> list[str]:
        """replicas sorted by load, least first; the sort is stable, so ties keep the given
        order."""
        return sorted(replicas, key=self._load.__getitem__)

    def least(self, replicas: Sequence[str]) -> str:
        """by_load(replicas)[0] without the sort."""
        return min(replicas, key=self._load.__getitem__)

    def loads_of(self, replicas: Sequence[str]) -> Sequence[float]:
        """The load of each of replicas, in order; read only (it is kept for the next call with this
        list)."""
        return self._aligned.values(replicas)

    def least_load(self, replicas: Sequence[str]) -> float:
        """min(loads_of(replicas)); replicas non-empty."""
        return self._aligned.least(replicas)

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

    def report(self, replica: str, stats: Mapping[str, Any]) -> None:
        """Apply a replica's routing stats (num_waiting, num_running, kv_cache_usage)."""
        s = self._replicas.setdefault(replica, ReplicaLoad())
        s.reported_requests = int(_number(stats, "num_waiting")) + int(
            _number(stats, "num_running")
        )
        s.healthy = stats.get("state", "ok") == "ok"
        s.kv_cache_usage = min(1.0, max(0.0, _number(stats, "kv_cache_usage")))
        if s.healthy:
            self.unhealthy.discard(replica)
        else:
            self.unhealthy.add(replica)
        self._refresh(replica)

    def remove_replica(self, replica: str) -> None:
        self._replicas.pop(replica, None)
        self._load.pop(replica, None)
        self._aligned.update(replica)
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


def _number(stats: Mapping[str, Any], key: str) -> float:
    value = stats.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"routing stats field {key!r}: expected a number, got {value!r}")
    return float(value)
