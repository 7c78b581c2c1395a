"""Routing policies: small pure objects that each choose one data-parallel replica for a request."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from router.adapter_affinity import AdapterIndex, holders_within
from router.config import RoutingConfig
from router.kv_events import InFlightPrompts, KVIndex, TierRun
from router.loads import LoadTracker
from router.prefix_index import PrefixIndex
from router.sessions import SessionTable, check_session_id


@dataclass(slots=True)
class RouteRequest:
    """What routing needs to know about a request: its id, cost, leading prompt block hashes and
    LoRA adapter (None: the base model)."""

    request_id: str
    num_tokens: int = 0
    block_hashes: Sequence[int] = ()
    lora_name: str | None = None
    # An agent's conversation (the request's session id): its turns stay on the replica that
    # served the last one, within the load ceiling (router/sessions.py). None: no session.
    session: str | None = None

    def __post_init__(self) -> None:
        if self.session is not None:
            check_session_id(self.session)


class FleetView(Protocol):
    loads: LoadTracker
    index: PrefixIndex
    adapters: AdapterIndex
    tier_hashes: dict[str, frozenset[int]]  # per replica: what its lower KV tiers hold
    kv: KVIndex  # exact holdings by tier, from the replicas' KV events
    kv_seen_at: dict[str, float]  # when each replica's KV events were last applied
    in_flight: InFlightPrompts  # prompts of requests not completed, pinned on their replicas
    sessions: SessionTable


class _Turns:
    """A rotating offset: the policy's n-th call starts at n modulo the replica count."""

    def __init__(self) -> None:
        self._next = 0

    def next(self, n: int) -> int:
        offset = self._next % n
        self._next += 1
        return offset


_Keyed = tuple[float, int, str]  # (load, turn, replica): the least is the choice by load


def _keyed_by_load(replicas: Sequence[str], loads: LoadTracker, offset: int) -> list[_Keyed]:
    """(load, turn, replica) of each replica, turn being its position counted from offset.

    The least key is the least loaded replica; equally loaded replicas take turns, the first at or
    after offset winning, instead of the first in the list always winning.
    """
    n = len(replicas)
    turns = [*range(n - offset, n), *range(n - offset)]  # (i - offset) % n of each index i
    return list(zip(loads.loads(replicas), turns, replicas))


class RoundRobin:
    """Each request to the next replica in turn, blind to load and prefixes."""

    def __init__(self) -> None:
        self._turns = _Turns()

    def choose(self, replicas: Sequence[str], request: RouteRequest, fleet: FleetView) -> str:
        return replicas[self._turns.next(len(replicas))]


class LeastLoaded:
    """The replica with the lowest combined load."""

    def __init__(self) -> None:
        self._turns = _Turns()

    def choose(self, replicas: Sequence[str], request: RouteRequest, fleet: FleetView) -> str:
        return min(_keyed_by_load(replicas, fleet.loads, self._turns.next(len(replicas))))[2]


class PowerOfTwo:
    """The less loaded of two replicas drawn at random (Ray Serve's default policy, on our load
    signal); the first drawn wins a tie."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, replicas: Sequence[str], request: RouteRequest, fleet: FleetView) -> str:
        pair = self._rng.sample(replicas, min(2, len(replicas)))
        return min(pair, key=fleet.loads.load)


class PrefixAffinity:
    """Longest run of the prompt's leading blocks wins, among replicas within the ceiling.

    The ceiling: max(base + imbalance_threshold, base * imbalance_ratio), base being the least
    loaded replica's load (reference "least") or the mean load of the replicas ("mean"). The least
    loaded replica is always within it. Ties go as in LeastLoaded.

    A request for a LoRA adapter (with adapter_affinity) first narrows the replicas within the
    ceiling to those holding its adapter; if none does, the adapter is cold there and the least
    loaded replica gets it (router/adapter_affinity.py).
    """

    def __init__(
        self,
        imbalance_threshold: float,
        min_match_blocks: int,
        imbalance_ratio: float = 1.0,
        reference: str = "least",
        adapter_affinity: bool = True,
        tier_hit_discount: float = 0.5,
    ) -> None:
        self.tier_hit_discount = tier_hit_discount
        self.imbalance_threshold = imbalance_threshold
        self.adapter_affinity = adapter_affinity
        self.imbalance_ratio = imbalance_ratio
        self.reference = reference
        self.min_match_blocks = min_match_blocks
        self._turns = _Turns()

    def choose(self, replicas: Sequence[str], request: RouteRequest, fleet: FleetView) -> str:
        keyed = _keyed_by_load(replicas, fleet.loads, self._turns.next(len(replicas)))
        least = min(keyed)
        adapter = request.lora_name if self.adapter_affinity else None
        session = fleet.sessions.replica_of(request.session) if request.session else None
        if not request.block_hashes and adapter is None and session is None:
            return least[2]
        eligible = self._within_ceiling(keyed, least)
        # A session's replica holds its context (the longest run its next turn can have): it keeps
        # the turn unless the ceiling drops it, the spill rule of prefix affinity.
        if session is not None and any(k[2] == session for k in eligible):
            return session
        if adapter is not None:
            eligible = holders_within(eligible, adapter, fleet.adapters)
            if not eligible:  # cold within the ceiling: by load
                return least[2]
            if not request.block_hashes:
                return min(eligible)[2]
        return self._by_prefix(eligible, request.block_hashes, replicas, fleet)

    def _within_ceiling(self, keyed: list[_Keyed], least: _Keyed) -> list[_Keyed]:
        """The replicas loaded at most the ceiling above the reference load: an overloaded holder
        of the longest run drops out; a shorter run on an acceptable replica still beats none."""
        base = least[0] if self.reference == "least" else sum(k[0] for k in keyed) / len(keyed)
        ceiling = max(base + self.imbalance_threshold, base * self.imbalance_ratio)
        return [k for k in keyed if k[0] <= ceiling]

    def _by_prefix(
        self,
        eligible: list[_Keyed],
        hashes: Sequence[int],
        replicas: Sequence[str],
        fleet: FleetView,
    ) -> str:
        """The eligible replica holding the longest run of the prompt, least loaded among equals;
        a prefix nobody holds goes where the fewest prefixes live, so tenants spread evenly over
        the fleet's caches instead of following momentary load."""
        runs = self._runs(hashes, replicas, fleet)
        longest = max(runs[r] for *_, r in eligible)
        if longest >= self.min_match_blocks:
            return min(k for k in eligible if runs[k[2]] == longest)[2]
        footprint = fleet.index.footprint
        return min((footprint(k[2]), k) for k in eligible)[1][2]

    def _runs(
        self, hashes: Sequence[int], replicas: Sequence[str], fleet: FleetView
    ) -> dict[str, float]:
        """Each replica's prefix score: from its KV events where they are in sync (exact, by
        tier, or what routing planted there since they were last applied, if longer), else from
        the approximate index and its lower tiers' report."""
        runs: dict[str, float] = dict(fleet.index.match(hashes, replicas))
        if fleet.tier_hashes:
            self._add_tier_runs(runs, hashes, fleet.tier_hashes)
        for r, run in expected_runs(fleet, hashes, replicas).items():
            runs[r] = self.score(run)
        return runs

    def score(self, run: TierRun) -> float:
        """A run's worth in device blocks: a device block 1, a CPU-tier block tier_hit_discount
        (a copy to the device instead of a prefill), a disk-tier block its square (a file read
        and a copy)."""
        d = self.tier_hit_discount
        return run.device + d * run.cpu + d * d * run.disk

    def _add_tier_runs(
        self, runs: dict[str, float], hashes: Sequence[int], tiers: dict[str, frozenset[int]]
    ) -> None:
        """Each replica's run continued through the blocks its lower tiers hold, at a discount
        (loading them back costs a copy, not a prefill)."""
        for replica, run in runs.items():
            held = tiers.get(replica)
            if not held:
                continue
            more = 0
            for h in hashes[int(run) :]:
                if h not in held:
                    break
                more += 1
            runs[replica] = run + self.tier_hit_discount * more


Policy = RoundRobin | LeastLoaded | PowerOfTwo | PrefixAffinity


def expected_runs(
    fleet: FleetView, hashes: Sequence[int], replicas: Sequence[str]
) -> dict[str, TierRun]:
    """The run of these leading blocks each replica whose KV events are in sync is expected to
    give: its events' run, or, when longer, the device run of what its events cannot show yet:
    the prompts of requests in flight there (pinned in its pool, whenever the events were taken)
    and what routing planted there since the events were last applied."""
    synced = [r for r in replicas if fleet.kv.in_sync(r)]
    runs = fleet.kv.match(hashes, synced) if synced else {}
    for r, run in runs.items():
        planted = max(
            fleet.in_flight.run(hashes, r),
            fleet.index.planted_run(hashes, r, fleet.kv_seen_at.get(r, math.inf)),
        )
        if planted > run.blocks:
            runs[r] = TierRun(planted)
    return runs


def make_policy(config: RoutingConfig) -> Policy:
    """The policy object named by config.router_policy."""
    if config.router_policy == "round_robin":
        return RoundRobin()
    if config.router_policy == "least_loaded":
        return LeastLoaded()
    if config.router_policy == "power_of_two":
        return PowerOfTwo(config.seed)
    return PrefixAffinity(
        config.imbalance_threshold,
        config.min_match_blocks,
        config.imbalance_ratio,
        config.imbalance_reference,
        config.adapter_affinity,
        config.tier_hit_discount,
    )
