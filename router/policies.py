"""Routing policies: small pure objects that choose a data-parallel replica for one request."""

from __future__ import annotations

import random
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, compress
from typing import Protocol

from router.config import RoutingConfig
from router.loads import LoadTracker
from router.prefix_index import PrefixIndex


@dataclass(slots=True)
class RouteRequest:
    """What routing needs to know about a request: its id, cost, and leading prompt block hashes."""

    request_id: str
    num_tokens: int = 0
    block_hashes: Sequence[int] = ()


class FleetView(Protocol):
    loads: LoadTracker
    index: PrefixIndex


class _Rotation:
    """Rotating tie-break so equally loaded replicas take turns instead of the first always
    winning."""

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
        """This turn's offset into n replicas (each call is a turn): rotate()'s, without the
        copy."""
        offset = self._offset % n
        self._offset += 1
        return offset


# Replicas sharing the smallest prefix footprint, up to which a pick ranks them one by one.
_FEW = 16


def least_rotated(loads: Sequence[float], offset: int) -> int:
    """Index of the least load, ties to the first at or after offset (then wrapping): C-level
    passes."""
    least = min(loads)
    try:
        return loads.index(least, offset)
    except ValueError:
        return loads.index(least)


def _least_holding(
    footprints: Sequence[int], footprint: int, loads: Sequence[float], ceiling: float, offset: int
) -> int | None:
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
    """The candidate list a router last ranked, as a set and an index map (rebuilt when it
    changes)."""

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
    """Two replicas at random, the less loaded first (Ray Serve's default policy, on our load
    signal)."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def rank(self, replicas: Sequence[str], request: RouteRequest, fleet: FleetView) -> list[str]:
        pair = self._rng.sample(list(replicas), min(2, len(replicas)))
        return sorted(pair, key=fleet.loads.load)

    def best(self, replicas: Sequence[str], request: RouteRequest, fleet: FleetView) -> str:
        """rank(...)[0], with the same state change (the same random draws)."""
        return self.rank(replicas, request, fleet)[0]


class PrefixAffinity:
    """Longest run of the prompt's leading blocks wins, among replicas within threshold of the least
    loaded.

    Within threshold: load <= max(least + imbalance_threshold, least * imbalance_ratio).
    """

    def __init__(
        self, imbalance_threshold: float, min_match_blocks: int, imbalance_ratio: float = 1.0
    ) -> None:
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
        eligible = by_load[: bisect_right(by_load, ceiling, key=load)]
        best = max(eligible, key=runs.__getitem__)
        if runs[best] < self.min_match_blocks:
            # A prefix nobody holds goes where the fewest prefixes live, so tenants spread evenly
            # over the fleet's caches instead of following momentary load.
            best = fleet.index.least_footprint(eligible)
        i = by_load.index(best)
        return [best, *by_load[:i], *by_load[i + 1 :]]

    def best(self, replicas: Sequence[str], request: RouteRequest, fleet: FleetView) -> str:
        """rank(...)[0], with the same state changes, in C-level passes over the fleet plus
        O(holders).

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
        position = _least_holding(
            footprints, fleet.index.smallest_footprint(replicas), loads, ceiling, offset
        )
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
    return PrefixAffinity(
        config.imbalance_threshold, config.min_match_blocks, config.imbalance_ratio
    )
