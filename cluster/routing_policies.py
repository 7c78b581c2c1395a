"""Fleet routing policies: small pure objects that rank data-parallel replicas for one request.

No Ray here. cluster/serve_router.py adapts FleetState to Serve's RequestRouter; a simulator can drive the
same objects with its own clock. Replicas are named by plain strings (Serve's replica unique ids).
"""
from __future__ import annotations

import math
import random
from array import array
from bisect import bisect_right
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from itertools import chain, compress, repeat
from typing import Any, Protocol

from cluster.circuit_breaker import CircuitBreaker
from scheduler.settings import check_settings, setting

POLICIES = ("round_robin", "least_loaded", "power_of_two", "prefix_affinity")
# Routed requests whose outcome the router can still attribute (a few minutes of heavy traffic).
MAX_RECENT_ROUTES = 65_536


@dataclass(slots=True)
class RoutingConfig:
    """Knobs of the fleet router; the app config passes them, by these names, as request_router_kwargs."""

    router_policy: str = setting("prefix_affinity", "how replicas are ranked", choices=POLICIES)
    imbalance_threshold: float = setting(
        4.0, "load units (about one in-flight request each) by which the prefix holder may exceed the least "
        "loaded replica before load wins over affinity", ge=0)
    # Under heavy load a few requests of skew cost little next to recomputing a prefix, and a fixed
    # threshold alone would spill every tenant everywhere.
    imbalance_ratio: float = setting(1.5, "...or by this factor of the least loaded replica's load, "
                                     "whichever allows more", ge=1)
    min_match_blocks: int = setting(1, "leading prompt blocks a replica must hold for affinity to count", ge=1)
    max_index_blocks: int = setting(200_000, "LRU bound of the router's prefix index, in blocks", ge=1)
    tokens_per_request: int = setting(2048, "in-flight tokens (prompt + max new tokens) that weigh as much as "
                                      "one in-flight request", ge=1)
    kv_usage_weight: float = setting(1.0, "weight of a replica's KV usage (0-1) in its load", ge=0)
    # The report may have been taken before the request that planted the entries arrived.
    stats_grace_s: float = setting(5.0, "prefix-index entries younger than this survive a replica's prefix "
                                   "report that lacks them", ge=0)
    unconfirmed_ttl_s: float = setting(30.0, "a routing decision Serve never confirmed (request cancelled "
                                       "before send) stops counting after this", gt=0)
    circuit_breaker_failures: int = setting(
        3, "consecutive requests failed by a replica (actor died or unreachable, engine failed) after which "
        "the router skips that replica (0: never)", ge=0, le=1_000_000)
    circuit_breaker_cooldown_s: float = setting(
        10.0, "a replica's open circuit lets one probe through after this long without a failure; a "
        "success or a fresh `ok` stats report closes it", gt=0, le=86400)
    seed: int | None = setting(None, "seed of the power_of_two policy's choices", ge=0, lt=2**63)

    def __post_init__(self) -> None:
        check_settings(self)

    @classmethod
    def from_router_kwargs(cls, kwargs: Mapping[str, Any] | None) -> RoutingConfig:
        """Validated config from request_router_kwargs; an unknown key raises ValueError naming it."""
        known = cls.__dataclass_fields__
        for key in kwargs or {}:
            if key not in known:
                raise ValueError(f"router_kwargs.{key}: unknown; known: {sorted(known)}")
        return cls(**(kwargs or {}))


@dataclass(slots=True)
class RouteRequest:
    """What routing needs to know about a request: its id, cost, and leading prompt block hashes."""

    request_id: str
    num_tokens: int = 0
    block_hashes: Sequence[int] = ()


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

    def __init__(self, value_of: Callable[[str], float], values_of: Callable[[Sequence[str]], list[float]],
                 typecode: str):
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
    """Per-replica load: exact in-flight counts of this router combined with late replica reports."""

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
        self._aligned = _Aligned(lambda replica: self._load.get(replica, 0.0),
                                 lambda replicas: list(map(self._load.get, replicas, repeat(0.0))), "d")
        self._unconfirmed: dict[str, None] = {}
        self.unhealthy: set[str] = set()

    def get(self, replica: str) -> ReplicaLoad:
        return self._replicas.get(replica) or ReplicaLoad()

    def load(self, replica: str) -> float:
        """Load in request units: the larger of own and reported requests, plus token and KV terms."""
        return self._load.get(replica, 0.0)

    def _refresh(self, replica: str) -> None:
        s = self._replicas[replica]
        # Reports are 1-2 s late but include other routers' traffic; own counts are exact but local.
        # The max never under-counts either source without double counting this router's requests.
        requests = max(s.inflight_requests, s.reported_requests)
        self._load[replica] = (requests + s.inflight_tokens / self.tokens_per_request
                               + self.kv_usage_weight * s.kv_cache_usage)
        self._aligned.update(replica)

    def by_load(self, replicas: list[str]) -> list[str]:
        """replicas sorted by load, least first; the sort is stable, so ties keep the given order."""
        return sorted(replicas, key=self._load.__getitem__)

    def least(self, replicas: Sequence[str]) -> str:
        """by_load(replicas)[0] without the sort."""
        return min(replicas, key=self._load.__getitem__)

    def loads_of(self, replicas: Sequence[str]) -> Sequence[float]:
        """The load of each of replicas, in order; read only (it is kept for the next call with this list)."""
        return self._aligned.values(replicas)

    def least_load(self, replicas: Sequence[str]) -> float:
        """min(loads_of(replicas)); replicas non-empty."""
        return self._aligned.least(replicas)

    def start(self, request_id: str, replica: str, num_tokens: int, now: float, confirmed: bool) -> None:
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
        """Forget unconfirmed decisions older than the TTL (their request never reached a replica)."""
        stale = [rid for rid in self._unconfirmed if now - self._requests[rid].started_at > self.unconfirmed_ttl_s]
        for rid in stale:
            self.finish(rid)

    def report(self, replica: str, stats: Mapping[str, Any]) -> None:
        """Apply a replica's routing stats (num_waiting, num_running, kv_cache_usage)."""
        s = self._replicas.setdefault(replica, ReplicaLoad())
        s.reported_requests = int(_number(stats, "num_waiting")) + int(_number(stats, "num_running"))
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


def _in_listed_order(listed: list[int], wanted: set[int]) -> list[int]:
    """The members of wanted in listed's order (a report's list: no duplicates)."""
    # Blocks a report lists for the first time were mostly registered since the report before, so
    # they sit near the end of its oldest-first list: search ever longer tails, not the whole list.
    if not wanted:
        return []
    k = len(wanted)
    while k < len(listed):
        tail = listed[-k:]
        if wanted.issubset(tail):
            return [h for h in tail if h in wanted]
        k *= 4
    return [h for h in listed if h in wanted]


class PrefixIndex:
    """LRU-bounded map from prompt block hash to the replicas believed to hold that block."""

    def __init__(self, max_blocks: int):
        self.max_blocks = max_blocks
        self._owners: OrderedDict[int, dict[str, float]] = OrderedDict()  # hash -> {replica: last planted}
        self._by_replica: dict[str, set[int]] = {}
        # What each replica's last report listed, and the blocks planted by routing since then that
        # no report has confirmed yet: a report is applied as its difference from the previous one,
        # so a fleet of replicas holding thousands of blocks each costs the changes, not the holdings.
        self._reported: dict[str, set[int]] = {}
        self._unreported: dict[str, set[int]] = {}
        self._report_ids: dict[str, int | None] = {}  # the number of the report applied last
        self._footprints = _Aligned(self.footprint, self._footprints_of, "q")
        # Every change of the index bumps this, so that an insert repeating the last one with none
        # in between (a router charging a request at its pick, then at its confirmation at the same
        # instant) is known to change nothing and skipped.
        self._changes = 0
        self._last_insert: tuple[str, float, int, tuple[int, ...]] | None = None

    def __len__(self) -> int:
        return len(self._owners)

    def replicas_of(self, block_hash: int) -> set[str]:
        return set(self._owners.get(block_hash, ()))

    def blocks_of(self, replica: str) -> set[int]:
        return set(self._by_replica.get(replica, ()))

    def replicas(self) -> set[str]:
        return set(self._by_replica)

    def footprint(self, replica: str) -> int:
        """Blocks attributed to replica: how much of the fleet's cached prefixes it holds."""
        return len(self._by_replica.get(replica, ()))

    def least_footprint(self, replicas: Sequence[str]) -> str:
        """The replica of replicas with the smallest footprint (the first of equals); replicas non-empty."""
        sizes = self._footprints_of(replicas)  # a list made per request: not worth keeping
        return replicas[sizes.index(min(sizes))]

    def _footprints_of(self, replicas: Sequence[str]) -> list[int]:
        return list(map(len, map(self._by_replica.get, replicas, repeat(()))))  # no Python call per replica

    def footprints(self, replicas: Sequence[str]) -> Sequence[int]:
        """The footprint of each of replicas, in order; read only (it is kept for the next call with this list)."""
        return self._footprints.values(replicas)

    def smallest_footprint(self, replicas: Sequence[str]) -> int:
        """min(footprints(replicas)); replicas non-empty."""
        return self._footprints.least(replicas)

    def insert(self, replica: str, block_hashes: Iterable[int], now: float) -> None:
        """Record that replica received these blocks (routing planted them at now)."""
        hashes = tuple(block_hashes)
        last = self._last_insert
        if last is not None and last[2] == self._changes and last[:2] == (replica, now) and last[3] == hashes:
            return
        self._add(replica, hashes, now)
        # Its blocks are now the newest entries, in its order (those past the bound evicted): a
        # repeat would move them into that order again and evict the same ones.
        self._last_insert = (replica, now, self._changes, hashes)

    def _add(self, replica: str, block_hashes: Iterable[int], planted: float) -> None:
        # planted: when routing last sent the block there (-inf: only a report listed it), so that a
        # report lacking it spares it for the grace window.
        # Reversed so the leading blocks end up most recent: they are the most shared, and evicting a
        # tail block first keeps the leading run of every other prompt intact.
        self._changes += 1
        mine = self._by_replica.setdefault(replica, set())
        reported = self._reported.get(replica, frozenset())
        unreported = self._unreported.setdefault(replica, set())
        for h in reversed(list(block_hashes)):
            owners = self._owners.get(h)
            if owners is None:
                owners = self._owners[h] = {}
            else:
                self._owners.move_to_end(h)
            owners[replica] = planted
            mine.add(h)
            if h not in reported:
                unreported.add(h)
        self._footprints.update(replica)
        while len(self._owners) > self.max_blocks:
            h, owners = self._owners.popitem(last=False)
            for r in owners:
                self._by_replica[r].discard(h)
                self._footprints.update(r)

    def match(self, block_hashes: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        """Length of the leading run of block_hashes held by each replica."""
        runs = dict.fromkeys(replicas, 0)
        runs.update(self.holder_runs(block_hashes, set(runs)))
        return runs

    def holder_runs(self, block_hashes: Sequence[int], replicas: set[str]) -> dict[str, int]:
        """match() restricted to the replicas holding at least the first block: O(holders), not O(replicas)."""
        runs: dict[str, int] = {}
        alive = replicas
        matched = 0
        for i, h in enumerate(block_hashes):
            owners = self._owners.get(h)
            if not owners:
                break
            alive = alive.intersection(owners)
            if not alive:
                break
            for r in alive:
                runs[r] = i + 1
            matched = i + 1
        if matched:
            self._changes += 1
        for h in reversed(block_hashes[:matched]):
            self._owners.move_to_end(h)
        return runs

    def remove_replica(self, replica: str) -> None:
        self._changes += 1
        self._reported.pop(replica, None)
        self._unreported.pop(replica, None)
        self._report_ids.pop(replica, None)
        for h in self._by_replica.pop(replica, ()):
            self._drop(replica, h)
        self._footprints.update(replica)

    def _drop(self, replica: str, block_hash: int) -> None:
        owners = self._owners.get(block_hash)
        if owners is not None:
            owners.pop(replica, None)
            if not owners:
                del self._owners[block_hash]

    def sync_replica(self, replica: str, resident: Iterable[int], now: float, grace_s: float,
                     change: ReportChange | None = None) -> None:
        """Correct the index from the replica's own list of resident block hashes (after evictions).

        Blocks new since the previous report are inserted (as insert() would); blocks it listed before
        and lists no more are dropped, and so are blocks routing planted that stayed unreported for
        grace_s. A block still resident keeps its place in the LRU order (a match refreshes it), and
        one the LRU bound evicted comes back only when routing plants it or a report lists it anew.
        change: the report's own account of how it differs from the replica's report it names; used
        when that is the report applied last and the account adds up, instead of comparing the lists.
        """
        self._changes += 1
        resident = resident if isinstance(resident, list) else list(resident)
        listed, dropped, ordered = self._relist(replica, resident, change)
        mine = self._by_replica.setdefault(replica, set())
        unreported = self._unreported.setdefault(replica, set())
        # unreported never holds a block the previous report listed, so of the blocks listed now
        # only the newly listed can be in it.
        unreported -= listed
        unreported |= dropped  # no longer listed: dropped below unless planted within grace_s
        cutoff = now - grace_s
        owners = self._owners
        stale = [h for h in unreported if h not in mine or owners[h][replica] < cutoff]
        unreported.difference_update(stale)
        mine.difference_update(stale)
        for h in stale:
            self._drop(replica, h)
        self._footprints.update(replica)
        new = listed - mine
        if new:
            self._add(replica, _in_listed_order(ordered, new), -math.inf)

    def _relist(self, replica: str, resident: list[int], change: ReportChange | None
                ) -> tuple[Set[int], Set[int], list[int]]:
        """Record the report as replica's listed blocks: (newly listed, no longer listed, the order to add them in)."""
        reported = self._reported.get(replica)
        ordered = None
        if change is not None and change.base_id is not None and reported is not None \
                and self._report_ids.get(replica) == change.base_id:
            ordered = change.listed_in(resident, reported)
        self._report_ids[replica] = change.report_id if change is not None else None
        if ordered is not None:
            reported -= change.unlisted_set
            reported |= change.listed_set
            return change.listed_set, change.unlisted_set, ordered
        # C-level passes over the holdings, then work on the changes only: a report differs from
        # the one before by a few blocks out of about a thousand, and most drop none.
        keep = set(resident)
        previous = reported or set()
        listed = keep - previous
        dropped = previous - keep if len(keep) - len(listed) < len(previous) else set()
        self._reported[replica] = keep
        return listed, dropped, resident


@dataclass(frozen=True, slots=True)
class ReportChange:
    """A prefix report's account of how it differs from an earlier report of the same replica."""

    report_id: int
    base_id: int | None
    listed_set: frozenset[int]  # listed now, not in report base_id
    unlisted_set: frozenset[int]  # listed in report base_id, not now
    num_listed: int  # as sent (a duplicate makes it differ from the set's size)
    num_unlisted: int

    @classmethod
    def of(cls, stats: Mapping[str, Any]) -> ReportChange | None:
        """From a stats dict's prefix_* fields; None where absent or malformed (the lists are then compared)."""
        report_id, base_id = stats.get("prefix_report_id"), stats.get("prefix_base_id")
        if type(report_id) is not int:
            return None
        listed, unlisted = stats.get("prefix_listed"), stats.get("prefix_unlisted")
        if type(base_id) is not int or not _block_hashes(listed) or not _block_hashes(unlisted):
            return cls(report_id, None, frozenset(), frozenset(), 0, 0)
        return cls(report_id, base_id, frozenset(listed), frozenset(unlisted), len(listed), len(unlisted))

    def listed_in(self, resident: list[int], previous: set[int]) -> list[int] | None:
        """The newly listed blocks in the report's order, if the change adds up: applied to the previous
        report's blocks it gives as many distinct blocks as the report lists, and the report lists
        every block it calls new. None otherwise (the lists are then compared)."""
        if not (len(self.listed_set) == self.num_listed and len(self.unlisted_set) == self.num_unlisted
                and self.listed_set.isdisjoint(previous) and self.unlisted_set <= previous
                and len(previous) - self.num_unlisted + self.num_listed == len(resident)):
            return None
        ordered = _in_listed_order(resident, self.listed_set)  # O(how far back the first new block lies)
        return ordered if len(ordered) == self.num_listed else None


def _block_hashes(value: Any) -> bool:
    """Whether value is a list of block hashes (ints of 128 bits at most)."""
    # C-level passes: a report's change is checked on every report of every replica.
    return type(value) is list and (not value or (set(map(type, value)) == {int} and min(value) >= 0
                                                  and max(value) < 1 << 128))


class FleetView(Protocol):
    loads: LoadTracker
    index: PrefixIndex


class _Rotation:
    """Rotating tie-break so equally loaded replicas take turns instead of the first always winning."""

    def __init__(self) -> None:
        self._offset = 0

    def order(self, replicas: Sequence[str], fleet: FleetView) -> list[str]:
        # Rotated so that position breaks ties: the load sort is stable.
        return fleet.loads.by_load(self.rotate(replicas))

    def rotate(self, replicas: Sequence[str]) -> list[str]:
        """replicas starting at this turn's offset (each call is a turn)."""
        replicas = list(replicas)
        offset = self.turn(len(replicas))
        return replicas[offset:] + replicas[:offset]

    def turn(self, n: int) -> int:
        """This turn's offset into n replicas (each call is a turn): rotate()'s, without the copy."""
        offset = self._offset % n
        self._offset += 1
        return offset


# Replicas sharing the smallest prefix footprint, up to which a pick ranks them one by one.
_FEW = 16


def least_rotated(loads: Sequence[float], offset: int) -> int:
    """Index of the least load, ties to the first at or after offset (then wrapping): C-level passes."""
    least = min(loads)
    try:
        return loads.index(least, offset)
    except ValueError:
        return loads.index(least)


def _least_holding(footprints: Sequence[int], footprint: int, loads: Sequence[float], ceiling: float,
                   offset: int) -> int | None:
    """Index of the least (load, rotated position) among the replicas of this footprint within the
    ceiling; None if none is, or over _FEW hold it (then one pass over the fleet costs less)."""
    holding = footprints.count(footprint)
    if holding > _FEW:
        return None
    n = len(loads)
    at, i = [], -1
    for _ in range(holding):
        i = footprints.index(footprint, i + 1)
        if loads[i] <= ceiling:
            at.append((loads[i], (i - offset) % n, i))
    return min(at)[2] if at else None


def rotated_positions(n: int, offset: int) -> Iterable[int]:
    """Each index's position in the list rotated to start at offset, in index order."""
    return chain(range(n - offset, n), range(n - offset))


class _Positions:
    """The candidate list a router last ranked, as a set and an index map (rebuilt when it changes)."""

    def __init__(self) -> None:
        self._of: list[str] | None = None
        self.members: frozenset[str] = frozenset()
        self.index: dict[str, int] = {}

    def update(self, replicas: Sequence[str]) -> None:
        # The router hands the same list object while the replica set stays as it is.
        if replicas is not self._of:
            self._of = replicas if isinstance(replicas, list) else None
            self.members = frozenset(replicas)
            self.index = {r: i for i, r in enumerate(replicas)}


class RoundRobin:
    """Each request to the next replica in turn, blind to load and prefixes."""

    def __init__(self) -> None:
        self._next = 0

    def rank(self, replicas: Sequence[str], request: RouteRequest, fleet: FleetView) -> list[str]:
        start = self._next % len(replicas)
        self._next += 1
        return [*replicas[start:], *replicas[:start]]

    def best(self, replicas: Sequence[str], request: RouteRequest, fleet: FleetView) -> str:
        """rank(...)[0], with the same state change, without building the ranking."""
        start = self._next % len(replicas)
        self._next += 1
        return replicas[start]


class LeastLoaded:
    """The replica with the lowest combined load first."""

    def __init__(self) -> None:
        self._rotation = _Rotation()

    def rank(self, replicas: Sequence[str], request: RouteRequest, fleet: FleetView) -> list[str]:
        return self._rotation.order(replicas, fleet)

    def best(self, replicas: Sequence[str], request: RouteRequest, fleet: FleetView) -> str:
        """rank(...)[0], with the same state change, without sorting or rotating."""
        offset = self._rotation.turn(len(replicas))
        return replicas[least_rotated(fleet.loads.loads_of(replicas), offset)]


class PowerOfTwo:
    """Two replicas at random, the less loaded first (Ray Serve's default policy, on our load signal)."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def rank(self, replicas: Sequence[str], request: RouteRequest, fleet: FleetView) -> list[str]:
        pair = self._rng.sample(list(replicas), min(2, len(replicas)))
        return sorted(pair, key=fleet.loads.load)

    def best(self, replicas: Sequence[str], request: RouteRequest, fleet: FleetView) -> str:
        """rank(...)[0], with the same state change (the same random draws)."""
        return self.rank(replicas, request, fleet)[0]


class PrefixAffinity:
    """Longest run of the prompt's leading blocks wins, among replicas within threshold of the least loaded.

    Within threshold: load <= max(least + imbalance_threshold, least * imbalance_ratio).
    """

    def __init__(self, imbalance_threshold: float, min_match_blocks: int, imbalance_ratio: float = 1.0) -> None:
        self.imbalance_threshold = imbalance_threshold
        self.imbalance_ratio = imbalance_ratio
        self.min_match_blocks = min_match_blocks
        self._rotation = _Rotation()
        self._positions = _Positions()

    def rank(self, replicas: Sequence[str], request: RouteRequest, fleet: FleetView) -> list[str]:
        by_load = self._rotation.order(replicas, fleet)
        if not request.block_hashes:
            return by_load
        runs = fleet.index.match(request.block_hashes, replicas)
        load = fleet.loads.load
        least = load(by_load[0])
        ceiling = max(least + self.imbalance_threshold, least * self.imbalance_ratio)
        # An overloaded holder of the longest run drops out; a shorter run on an acceptable replica
        # still beats none. by_load order makes the least loaded win ties of equal runs. by_load is
        # sorted by load, so the replicas within the ceiling are a prefix of it.
        eligible = by_load[:bisect_right(by_load, ceiling, key=load)]
        best = max(eligible, key=runs.__getitem__)
        if runs[best] < self.min_match_blocks:
            # A prefix nobody holds goes where the fewest prefixes live, so tenants spread evenly
            # over the fleet's caches instead of following momentary load.
            best = fleet.index.least_footprint(eligible)
        i = by_load.index(best)
        return [best, *by_load[:i], *by_load[i + 1:]]

    def best(self, replicas: Sequence[str], request: RouteRequest, fleet: FleetView) -> str:
        """rank(...)[0], with the same state changes, in C-level passes over the fleet plus O(holders).

        rank's order is (load, rotated position); the eligible replicas are those within the
        ceiling, so each choice below is a minimum over (key, load, position) tuples.
        """
        n = len(replicas)
        offset = self._rotation.turn(n)
        loads = fleet.loads.loads_of(replicas)
        if not request.block_hashes:
            return replicas[least_rotated(loads, offset)]
        positions = self._positions
        positions.update(replicas)
        runs = fleet.index.holder_runs(request.block_hashes, positions.members)
        least = fleet.loads.least_load(replicas)
        ceiling = float(max(least + self.imbalance_threshold, least * self.imbalance_ratio))
        load = fleet.loads.load
        held = [(run, r) for r, run in runs.items() if load(r) <= ceiling]
        top = max((run for run, _ in held), default=0)
        if top >= self.min_match_blocks:
            index = positions.index
            return min((load(r), (index[r] - offset) % n, r) for run, r in held if run == top)[2]
        footprints = fleet.index.footprints(replicas)
        # Usually a few replicas hold the smallest footprint and one is within the ceiling: rank
        # those alone instead of building a key for every replica of the fleet.
        position = _least_holding(footprints, fleet.index.smallest_footprint(replicas), loads, ceiling, offset)
        if position is None:
            # Under load the smallest footprints sit on busy replicas: the smallest within the
            # ceiling, found in C-level passes, usually has a few holders too.
            smallest_within = min(compress(footprints, map(ceiling.__ge__, loads)))
            position = _least_holding(footprints, smallest_within, loads, ceiling, offset)
        if position is None:
            keyed = zip(footprints, loads, rotated_positions(n, offset))
            position = (min(compress(keyed, map(ceiling.__ge__, loads)))[2] + offset) % n
        return replicas[position]


Policy = RoundRobin | LeastLoaded | PowerOfTwo | PrefixAffinity


def make_policy(config: RoutingConfig) -> Policy:
    """The policy object named by config.router_policy."""
    if config.router_policy == "round_robin":
        return RoundRobin()
    if config.router_policy == "least_loaded":
        return LeastLoaded()
    if config.router_policy == "power_of_two":
        return PowerOfTwo(config.seed)
    return PrefixAffinity(config.imbalance_threshold, config.min_match_blocks, config.imbalance_ratio)


class FleetState:
    """Everything the fleet router knows: loads, the prefix index, and the policy that reads them."""

    def __init__(self, config: RoutingConfig):
        self.config = config
        self.loads = LoadTracker(config.tokens_per_request, config.kv_usage_weight, config.unconfirmed_ttl_s)
        self.index = PrefixIndex(config.max_index_blocks)
        self.policy = make_policy(config)
        self.routed: Counter[str] = Counter()  # requests Serve confirmed, per replica (logs, benches)
        self.breaker = CircuitBreaker(config.circuit_breaker_failures, config.circuit_breaker_cooldown_s)
        # request id -> replica of recently routed requests, so a failure reported later is attributed.
        self._recent: OrderedDict[str, str] = OrderedDict()
        self._stats_seen: dict[str, Mapping[str, Any]] = {}
        self._sorted: tuple[tuple[str, ...], list[str]] = ((), [])  # last replica set and its sorted names

    def route(self, request: RouteRequest, replicas: Iterable[str], now: float) -> list[str]:
        """Replicas ranked best first for request; the first is provisionally charged with it."""
        candidates = self._candidates(replicas, now)
        if not candidates:
            return []
        ranking = self.policy.rank(candidates, request, self)
        self._picked(request, ranking[0], now)
        return ranking

    def pick(self, request: RouteRequest, replicas: Iterable[str], now: float) -> str | None:
        """route(...)[0], with the same state changes, without ranking the rest (a simulator's fleet)."""
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
        # The cached list itself while all are healthy (no caller mutates it): policies key caches on it.
        return [r for r in self._sorted[1] if r not in unhealthy] if unhealthy else self._sorted[1]

    def on_routed(self, request: RouteRequest, replica: str, now: float) -> None:
        """Serve sent request to replica (it may differ from the ranking's first if that one was full)."""
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
            self.index.sync_replica(replica, prefix_hashes, now, self.config.stats_grace_s, ReportChange.of(stats))

    def remove_replica(self, replica: str) -> bool:
        """Forget a dead or removed replica at once: its load, its requests, its index entries.

        False if there was nothing to forget (Serve reports a death once per failed request)."""
        known = replica in self.loads.replicas() or replica in self.index.replicas() or replica in self._stats_seen
        self.loads.remove_replica(replica)
        self.index.remove_replica(replica)
        self.breaker.forget(replica)
        self._stats_seen.pop(replica, None)
        return known

    def retain(self, replicas: Iterable[str]) -> None:
        """Forget every replica not in replicas."""
        alive = set(replicas)
        known = self.loads.replicas() | self.index.replicas() | set(self._stats_seen) | self.breaker.replicas()
        for replica in known - alive:
            self.remove_replica(replica)

    def _charge(self, request: RouteRequest, replica: str, now: float, confirmed: bool) -> None:
        self.loads.start(request.request_id, replica, request.num_tokens, now, confirmed)
        if request.block_hashes:
            self.index.insert(replica, request.block_hashes, now)
