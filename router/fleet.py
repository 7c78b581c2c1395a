"""FleetState: everything the fleet router knows (loads, prefix index, circuits) and the policy that
reads it.

No Ray here. cluster/serve_router.py adapts it to Serve's RequestRouter; sim/ drives the same object
with its own clock. Replicas are named by plain strings (Serve's replica unique ids).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from router.adapter_affinity import AdapterIndex
from router.circuit_breaker import CircuitBreaker
from router.config import RoutingConfig
from router.kv_events import InFlightPrompts, KVIndex, TierRun
from router.loads import LoadTracker
from router.peer_pull import PeerPull, PullsInFlight, plan_pull
from router.policies import RouteRequest, make_policy
from router.prefix_index import DEFAULT_REPLICA_BLOCKS, PrefixIndex
from router.sessions import SessionTable
from router.stats import RoutingStats
from scheduler.kv_events import KVEventTail

MAX_RECENT_ROUTES = 65_536


@dataclass(frozen=True, slots=True)
class Route:
    """A request's ranking (best first) and, with peer_pulls on, the pull its first replica is to
    make (router/peer_pull.py); joined: a pull already in flight to that replica, which the
    request waits for rather than moving its blocks again."""

    ranking: list[str]
    pull: PeerPull | None = None
    joined: bool = False


class FleetState:
    """Everything the fleet router knows: loads, the prefix index, and the policy that reads
    them."""

    def __init__(self, config: RoutingConfig):
        self.config = config
        self.loads = LoadTracker(
            config.tokens_per_request,
            config.kv_usage_weight,
            config.unconfirmed_ttl_s,
            config.load_signal,
            config.predicted_tokens_per_request,
        )
        self.index = PrefixIndex(
            config.index_blocks_per_replica or DEFAULT_REPLICA_BLOCKS, config.max_index_blocks
        )
        self.adapters = AdapterIndex()
        self.policy = make_policy(config)
        # Requests Serve confirmed, per replica (logs, benches).
        self.routed: Counter[str] = Counter()
        self.breaker = CircuitBreaker(
            config.circuit_breaker_failures, config.circuit_breaker_cooldown_s
        )
        # request id -> replica of recently routed requests, so a failure reported later is
        # attributed to its replica.
        self._recent: OrderedDict[str, str] = OrderedDict()
        self._stats_seen: dict[str, RoutingStats] = {}
        # The hashes each replica's lower KV tiers held at its last report (absent: tiers off).
        self.tier_hashes: dict[str, frozenset[int]] = {}
        # Exact holdings by tier from the replicas' KV events (router/kv_events.py), and when each
        # replica's were last applied (routing's plants since then still count).
        self.kv = KVIndex()
        self.kv_seen_at: dict[str, float] = {}
        self.in_flight = InFlightPrompts()
        self.pulls = PullsInFlight()  # the pulls planned that the pullers' events do not show yet
        self.sessions = SessionTable()
        # The replica set as last given, and sorted: it rarely changes between requests.
        self._given: tuple[str, ...] = ()
        self._sorted: list[str] = []

    def route(self, request: RouteRequest, replicas: Iterable[str], now: float) -> list[str]:
        """Replicas ranked best first for request, as Serve wants them: the choice (see choose()),
        then the other candidates least loaded first, where Serve goes while a replica is full."""
        return self.plan(request, replicas, now).ranking

    def plan(self, request: RouteRequest, replicas: Iterable[str], now: float) -> Route:
        """route()'s ranking, with the pull its first replica is to make (peer_pulls)."""
        candidates = self._candidates(replicas, now)
        if not candidates:
            return Route([])
        choice = self.policy.choose(candidates, request, self)
        # Before the charge: it plants the prompt on the choice, which would then seem to hold it.
        pull, joined = self._plan_pull(request, choice, candidates, now)
        if pull is not None and not joined:
            self.pulls.record(request.request_id, choice, pull, now + self.config.pull_timeout_s)
        self._picked(request, choice, now)
        ranking = [choice, *sorted((r for r in candidates if r != choice), key=self.loads.load)]
        return Route(ranking, pull, joined)

    def _plan_pull(
        self, request: RouteRequest, choice: str, candidates: list[str], now: float
    ) -> tuple[PeerPull | None, bool]:
        """The pull for request on choice: what choice's KV events show it holds (the approximate
        index when they are out of sync) against the longest device run a peer's events show.

        Not what routing planted on choice: a request sent there just before with the same
        prefix is still pulling or computing it, and one without a pull of its own would compute
        the prefix beside it (a burst of forks spilled to one replica did). A prefix that did
        reach choice is a device hit there, found before the pulled blocks are looked at; the
        pull then moved blocks for nothing, which the tail each output carries keeps rare.

        A pull planned before to choice that moves the first block it lacks is joined (True)
        instead: its blocks are on their way, and a second pull would move them again."""
        hashes = request.block_hashes
        if not self.config.peer_pulls or len(hashes) < self.config.min_pull_blocks:
            return None, False
        if self.kv.in_sync(choice):
            have = self.kv.match(hashes, [choice])[choice]
        else:
            have = TierRun(int(self.index.match(hashes, [choice])[choice]))
        joined = self.pulls.joinable(choice, hashes, have.blocks, now)
        if joined is not None:
            self.pulls.num_joined += 1
            return joined, True
        min_blocks = self.config.min_pull_blocks
        return plan_pull(self.kv, hashes, choice, have, candidates, min_blocks), False

    def choose(self, request: RouteRequest, replicas: Iterable[str], now: float) -> str | None:
        """The replica for request, charged with it (None: no replica to choose from): route()'s
        first, for a caller whose replicas never turn a request away (the simulator's)."""
        candidates = self._candidates(replicas, now)
        return self._choose(request, candidates, now) if candidates else None

    def _choose(self, request: RouteRequest, candidates: list[str], now: float) -> str:
        choice = self.policy.choose(candidates, request, self)
        self._picked(request, choice, now)
        return choice

    def _picked(self, request: RouteRequest, choice: str, now: float) -> None:
        self.breaker.on_picked(choice, now)
        # Charged now, not when Serve confirms: a burst routes before any confirmation comes back.
        self._charge(request, choice, now, confirmed=False)

    def _candidates(self, replicas: Iterable[str], now: float) -> list[str]:
        """The replicas a policy may choose from, in name order (a policy's ties go by position)."""
        given = tuple(replicas)
        if given != self._given:
            self._given, self._sorted = given, sorted(set(given))
        # A replica that reports itself failed, stalled or draining is never chosen.
        unhealthy = self.loads.unhealthy
        healthy = [r for r in self._sorted if r not in unhealthy]
        if not healthy:
            return []
        self.loads.expire(now)
        # An open circuit skips its replica, unless every circuit is open: then the requests' own
        # migration limit, not the router, decides when to give up.
        if self.breaker.any_open():
            return [r for r in healthy if self.breaker.allows(r, now)] or healthy
        return healthy

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
        self.pulls.finish(request_id)
        replica = self._recent.pop(request_id, None)
        if replica is None:
            return None
        if ok:
            self.breaker.record_success(replica, now)
        else:
            self.breaker.record_failure(replica, now)
        return replica

    def on_completed(self, request_id: str, now: float | None = None) -> None:
        self.loads.finish(request_id)
        self.pulls.finish(request_id)
        done = self.in_flight.finish(request_id)
        if done is not None and now is not None:
            # Planted anew: its blocks, no longer pinned, stand until events newer than this.
            self.index.insert(*done, now)

    def on_stats(self, replica: str, stats: RoutingStats, now: float) -> None:
        """Apply a replica's report once per distinct report."""
        # Serve re-broadcasts the last report with every replica-set change; re-applying an old
        # prefix report after the grace window would drop blocks planted since it was taken.
        if stats == self._stats_seen.get(replica):
            return
        self._stats_seen[replica] = stats
        self.loads.report(replica, stats)
        if self.loads.is_healthy(replica):
            self.breaker.record_healthy_report(replica, now)
        self._sync_holdings(replica, stats, now)
        if stats.kv_events is not None:
            before = self.kv.applied_seq(replica)
            self.kv.apply(replica, stats.kv_events)
            # Only news moves it: a report older than a tail already applied (Serve delivers
            # reports late) must not discount what routing planted since that tail.
            if self.kv.applied_seq(replica) != before:
                self.kv_seen_at[replica] = now
                self._pulls_landed(replica)

    def _sync_holdings(self, replica: str, stats: RoutingStats, now: float) -> None:
        """What a report says the replica holds: its prefix blocks (and the index's bound for
        it), its loaded adapters and its lower tiers' hashes."""
        blocks = self.config.index_blocks_per_replica or stats.scheduler.num_gpu_blocks
        if blocks and blocks != self.index.bound(replica):
            self.index.set_bound(replica, blocks)
        if stats.prefix is not None:
            self.index.sync_replica(replica, stats.prefix, now, self.config.stats_grace_s)
        loaded = stats.scheduler.loaded_loras
        self.adapters.sync_replica(replica, loaded, now, self.config.stats_grace_s)
        if stats.tier_hashes is not None:
            self.tier_hashes[replica] = frozenset(stats.tier_hashes)

    def on_kv_tail(self, tail: KVEventTail, now: float) -> None:
        """KV events a request's last output carried (router/kv_events.py `apply_tail`): applied
        before the client's next request is routed, not a report period later."""
        if self.kv.apply_tail(tail):
            self.kv_seen_at[tail.replica] = now
            self._pulls_landed(tail.replica)

    def _pulls_landed(self, replica: str) -> None:
        """Forget the pulls to replica whose blocks its events (in sync) now show on its device."""
        if self.kv.in_sync(replica):
            self.pulls.landed(
                replica, lambda hashes: self.kv.match(hashes, [replica])[replica].device
            )

    def reports(self) -> dict[str, RoutingStats]:
        """Each live replica's latest report, as this router last applied it."""
        return dict(self._stats_seen)

    def remove_replica(self, replica: str) -> bool:
        """Forget a dead or removed replica at once: its load, its requests, its index entries.

        False if there was nothing to forget (Serve reports a death once per failed request)."""
        known = self._knows(replica)
        self.loads.remove_replica(replica)
        self.kv.remove_replica(replica)
        self.kv_seen_at.pop(replica, None)
        self.in_flight.remove_replica(replica)
        self.pulls.remove_replica(replica)
        self.sessions.remove_replica(replica)
        self.index.remove_replica(replica)
        self.adapters.remove_replica(replica)
        self.breaker.forget(replica)
        self._stats_seen.pop(replica, None)
        self.tier_hashes.pop(replica, None)
        return known

    def _knows(self, replica: str) -> bool:
        return (
            replica in self.loads.replicas()
            or replica in self.index.replicas()
            or replica in self._stats_seen
            or replica in self.adapters.replicas()
            or replica in self.kv.replicas()
        )

    def retain(self, replicas: Iterable[str]) -> None:
        """Forget every replica not in replicas."""
        alive = set(replicas)
        known = (
            self.loads.replicas()
            | self.index.replicas()
            | set(self._stats_seen)
            | self.breaker.replicas()
            | self.adapters.replicas()
            | self.kv.replicas()
        )
        for replica in known - alive:
            self.remove_replica(replica)

    def _charge(self, request: RouteRequest, replica: str, now: float, confirmed: bool) -> None:
        self.loads.start(request.request_id, replica, request.num_tokens, now, confirmed)
        if confirmed:  # Serve completes each request it sent, and only those
            self.in_flight.start(request.request_id, replica, request.block_hashes)
        if request.block_hashes:
            self.index.insert(replica, request.block_hashes, now)
        if request.lora_name is not None:
            self.adapters.plant(replica, request.lora_name, now)
        if request.session is not None:
            self.sessions.record(request.session, replica)
