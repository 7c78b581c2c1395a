"""The fleet as one KV cache, simulated: KV events, peer-to-peer prefix pulls and sessions.

Every piece is the production one, driven on the simulated clock:
- Each replica's scheduler records its KV events into a `KVEventLog` attached as a served
  replica's is (`scheduler.kv_events.attach_kv_log`); its routing-stats reports carry
  `log.report()`, and each request's last output carries `log.tail()` to the router before the
  next arrival is routed (cluster/kv_event_pub.py). The router (router/fleet.py `FleetState`)
  keeps its exact index from them (router/kv_events.py) and scores replicas by it.
- With `routing.peer_pulls`, `FleetState.plan` plans the pull (router/peer_pull.py `plan_pull`);
  the chosen replica weighs it with `PullCost` from the same routing settings, as a served replica
  does (cluster/kv_pull.py), and asks the peer, which exports the leading run of the named blocks
  its device cache still holds (`BlockPool.cached_run`, as engine/peer_pull.py) between its steps.
  The blocks cross `pull_link` (sim/kv_copy.py `LinkConfig`) into the puller's receive buffer;
  the request then joins the puller's queue and its production scheduler loads them through the
  KV connector ("KV arriving", `LOADING_KV`), as a disaggregated decode replica loads a prefill's
  (sim/disagg.py `DecodeSimReplica`): it computes only what neither its cache nor the pull holds.
  A pull that does not pay, whose peer holds nothing of it any more, or that would outlast
  `pull_timeout_s` is computed instead.
- The router remembers the pulls it planned (router/peer_pull.py `PullsInFlight`): a fork routed
  to a replica a pull of its context is on its way to joins that pull (`Route.joined`). The
  replica does not ask the peer again for blocks a pull of its own is bringing: the request is
  queued once the request that pulls them has landed them on the device (at a step boundary),
  where its scheduler finds them as a prefix hit; queued as soon as they land in the receive
  buffer, it would load a second copy of them beside the first request in the same step.
- With `sessions`, a request names its session (`SimRequest.session`): `PrefixAffinity` keeps it
  on the replica of the session's last turn unless the load ceiling drops that replica.

Not modelled: the peer's export is not charged to the peer's steps (a device-to-host copy beside
its forward), and the peer's cache is read when the pull is asked, not at the export a step later.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from router.peer_pull import PeerPull, PullCost
from router.policies import RouteRequest
from router.stats import MAX_REPORTED_PREFIX_HASHES, RoutingStats
from scheduler import (
    RequestOutput,
    SchedulerConfig,
    SchedulerOutput,
    extend_block_hashes,
    hash_prompt_blocks,
)
from scheduler.kv_events import attach_kv_log
from scheduler.request import RequestStatus
from sim.cost import CostModel
from sim.disagg import DecodeSimReplica
from sim.fleet import FleetSim
from sim.fleet_config import SimConfig
from sim.kv_copy import LinkConfig
from sim.metrics import RequestRecord
from sim.replica import AppliedStep, Cruise, SimReplica, StepPlan, step_shape
from sim.workload import SimRequest

# What the served pull measured end to end beside its bytes: the peer's export call through the
# deployment handle, about 50 ms (bench/results/2026-11-29-p2p-pulls.md).
PULL_LATENCY_S = 0.05
# How often a request waiting for another's pull to land looks again while its replica is idle
# (a busy replica is looked at each step boundary).
JOIN_POLL_S = 1e-3
# A request still bringing its pulled blocks onto the device: neither admitted nor landed yet.
_NOT_LANDED = (RequestStatus.WAITING, RequestStatus.LOADING_KV)


@dataclass(frozen=True, slots=True)
class FleetKVConfig:
    """What the replicas tell the router and how requests name sessions; pulls are the routing
    config's own `peer_pulls` (and its cost model's settings)."""

    kv_events: bool = True  # replicas publish KV events (reports and each last output's tail)
    sessions: bool = False  # requests name their session (SimRequest.session)
    # Peer -> puller: the blocks' bytes at this bandwidth after this latency.
    pull_link: LinkConfig = field(default_factory=lambda: LinkConfig(latency_s=PULL_LATENCY_S))

    def __post_init__(self) -> None:
        for name in ("kv_events", "sessions"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.pull_link, LinkConfig):
            raise ValueError(f"pull_link: must be a LinkConfig, got {self.pull_link!r}")


@dataclass(slots=True)
class PullRecord:
    """One pull a request made: from whom, how many blocks, when they landed."""

    request_id: str
    peer: str
    replica: str
    hashes: tuple[int, ...]  # the blocks sent
    asked_s: float
    landed_s: float

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)


@dataclass(slots=True)
class PullCounts:
    """The fleet's pulls, as a served replica counts its own (cluster/kv_pull.py)."""

    planned: int = 0  # the router named a peer
    pulled: int = 0
    declined: int = 0  # the cost model said computing is cheaper
    failed: int = 0  # the peer held nothing past what the puller has, or too slow
    records: list[PullRecord] = field(default_factory=list)
    # (request id, when its blocks land): pulls whose blocks were all on their way already,
    # waited for instead of asked again
    joins: list[tuple[str, float]] = field(default_factory=list)

    @property
    def joined(self) -> int:
        return len(self.joins)

    @property
    def blocks(self) -> int:
        return sum(p.num_blocks for p in self.records)


class KVSimReplica(DecodeSimReplica):
    """A replica that publishes KV events and loads pulled blocks from its receive buffer; counts
    the prompt tokens its steps compute."""

    def __init__(
        self,
        name: str,
        config: SchedulerConfig,
        cost: CostModel,
        max_tokens: int,
        land: LinkConfig,
        publish: bool,
    ) -> None:
        super().__init__(name, config, cost, max_tokens, land)
        # After the receive buffer is installed, as a served replica attaches after its pulls.
        self.log = attach_kv_log(self.scheduler)
        self.publish = publish
        self.prefill_tokens = 0

    def step_seconds(self, out: SchedulerOutput) -> float:
        self.prefill_tokens += step_shape(out, self.scheduler.requests)[0]
        return super().step_seconds(out)

    def plan_cruise(self, now: float, horizon_s: float, min_steps: int = 2) -> Cruise | None:
        # A cruise's first step may compute requests' last prompt token (start_step's count).
        last = sum(1 for r in self.scheduler.running if r.num_computed_tokens < r.num_prompt_tokens)
        cruise = super().plan_cruise(now, horizon_s, min_steps)
        if cruise is not None:
            self.prefill_tokens += last
        return cruise

    def routing_stats(self, max_hashes: int = MAX_REPORTED_PREFIX_HASHES) -> RoutingStats:
        stats = super().routing_stats(max_hashes)
        if not self.publish:
            return stats
        return dataclasses.replace(stats, kv_events=self.log.report())

    def next_boundary(self, now: float) -> float:
        """When the step running now ends (now if idle): a peer exports between its steps."""
        plan = self.in_flight
        if plan is None:
            return now
        if isinstance(plan, Cruise):
            return next((t for t in plan.ends if t >= now), plan.end_s)
        assert isinstance(plan, StepPlan | AppliedStep)
        return max(now, plan.end_s)


class KVFleetSim(FleetSim):
    """FleetSim whose replicas publish KV events and pull prefixes from each other (see the module
    doc)."""

    def __init__(self, config: SimConfig, cost: CostModel, kv: FleetKVConfig):
        if config.adapters is not None or config.spec is not None or config.host.shared:
            raise ValueError("kv: not with adapters, speculation or shared hosts in this simulator")
        if config.scheduler.cpu_tier_blocks:
            raise ValueError("kv: not with a CPU tier in this simulator")
        if config.routing.peer_pulls and not kv.kv_events:
            raise ValueError("routing.peer_pulls: needs kv_events (pulls are planned from them)")
        self.kv = kv
        super().__init__(config, cost)
        routing = config.routing
        self.pull_cost = PullCost(
            routing.pull_bytes_per_s, routing.pull_fixed_s, routing.prefill_tokens_per_s
        )
        self.pulls = PullCounts()
        # replica -> moved hash -> (when it lands, the request whose pull moves it): the replica's
        # pulls until their requests complete (the blocks are on its device by then, or evicted)
        self._moving: dict[str, dict[int, tuple[float, str]]] = {}
        self._moved: dict[str, tuple[str, tuple[int, ...]]] = {}  # request id -> replica, hashes
        self._contexts: dict[tuple[str, int], list[int]] = {}

    def _new(self, name: str) -> SimReplica:
        land = LinkConfig(bandwidth_bytes_per_s=self.cost.bytes_per_s)
        config = self.config
        return KVSimReplica(
            name, config.scheduler, self.cost, config.max_tokens, land, self.kv.kv_events
        )

    def prefill_tokens(self) -> int:
        """Prompt tokens the fleet's steps computed."""
        return sum(r.prefill_tokens for r in self._kv_replicas())

    def loaded_blocks(self) -> int:
        """Pulled blocks the replicas' schedulers loaded (a pull's blocks the puller's own cache
        held by the time it landed are not loaded)."""
        return sum(r.buffer.stats.num_loaded_blocks for r in self._kv_replicas())

    def _kv_replicas(self) -> list[KVSimReplica]:
        return [r for r in self.replicas if isinstance(r, KVSimReplica)]

    def _hashes(self, req: SimRequest, prompt: list[int], lora: str | None) -> list[int]:
        """The prompt's block hashes, its shared context's hashed once per context."""
        context = req.shared_context_len
        if not context:
            return super()._hashes(req, prompt, lora)
        bs = self.config.scheduler.block_size
        key = (req.context_group, context // bs * bs)
        hashes = self._contexts.get(key)
        if hashes is None:
            hashes = self._contexts[key] = hash_prompt_blocks(prompt[: key[1]], bs)
        return extend_block_hashes(list(hashes), prompt, bs, len(prompt) // bs)

    def _arrive(
        self, i: int, req: SimRequest, now: float, records: dict[str, RequestRecord]
    ) -> None:
        """Route request i (planning its pull) and queue it at its replica, or at the pull's
        landing."""
        prompt = req.prompt_token_ids(i)
        hashes = self._hashes(req, prompt, None)
        session = (req.session or None) if self.kv.sessions else None
        route = RouteRequest(req.request_id, req.prompt_len + req.output_len, hashes, None, session)
        plan = self.fleet.plan(route, self.names, now)
        name = plan.ranking[0]
        self.fleet.on_routed(route, name, now)
        replica = self._by_name[name]
        assert isinstance(replica, KVSimReplica)
        records[req.request_id].replica = name
        pulled = self._pull(plan.pull, replica, req, now) if plan.pull is not None else None
        if pulled is None:
            self._queue(replica, req, prompt, hashes, now, records)
            return
        landed_s, moved, pullers = pulled

        def land(t: float, recs: dict[str, RequestRecord]) -> None:
            if any(self._not_landed(replica, rid) for rid in pullers):
                self._timer(max(replica.next_boundary(t), t + JOIN_POLL_S), land)
                return
            if moved:
                replica.buffer.expect(req.request_id, moved)
            self._queue(replica, req, prompt, hashes, t, recs)

        self._timer(landed_s, land)

    @staticmethod
    def _not_landed(replica: SimReplica, request_id: str) -> bool:
        """Whether request_id (queued on replica) has yet to bring its pulled blocks on device."""
        req = replica.scheduler.requests.get(request_id)
        return req is not None and req.status in _NOT_LANDED

    def _queue(
        self,
        replica: SimReplica,
        req: SimRequest,
        prompt: list[int],
        hashes: list[int],
        now: float,
        records: dict[str, RequestRecord],
    ) -> None:
        self._before_add(replica, now, records)
        replica.add(req.request_id, prompt, req.output_len, req.tenant, req.priority, now, hashes)
        self._after_add(replica, now)

    def _pull(
        self, pull: PeerPull, replica: KVSimReplica, req: SimRequest, now: float
    ) -> tuple[float, tuple[int, ...], set[str]] | None:
        """The replica's side of a planned pull (cluster/kv_pull.py `ReplicaPulls.start`): when
        the request may be queued, the blocks the peer sends it into the receive buffer and the
        requests whose pulls bring the rest (it waits for them to land), or None when the request
        computes its prompt. Blocks a pull of the replica's own is bringing are not asked again."""
        self.pulls.planned += 1
        if pull.peer == replica.name:
            return None
        first, waited_s, pullers = self._on_their_way(replica.name, pull)
        if first == len(pull.hashes):
            self.pulls.joins.append((req.request_id, waited_s))
            return max(now, waited_s), (), pullers
        if first > pull.first:
            pull = PeerPull(pull.peer, pull.hashes, first)
        record = self._ask(pull, replica, req, now)
        if record is None:
            return None
        moving = self._moving.setdefault(replica.name, {})
        for h in record.hashes:
            moving[h] = (record.landed_s, req.request_id)
        self._moved[req.request_id] = (replica.name, record.hashes)
        return max(record.landed_s, waited_s), record.hashes, pullers

    def _on_their_way(self, replica: str, pull: PeerPull) -> tuple[int, float, set[str]]:
        """How far from pull.first the replica's own pulls are bringing the blocks pull names,
        when the last of those lands, and the requests pulling them."""
        moving = self._moving.get(replica, {})
        first, landed_s, pullers = pull.first, 0.0, set()
        while first < len(pull.hashes) and pull.hashes[first] in moving:
            when, rid = moving[pull.hashes[first]]
            landed_s = max(landed_s, when)
            pullers.add(rid)
            first += 1
        return first, landed_s, pullers

    def _ask(
        self, pull: PeerPull, replica: KVSimReplica, req: SimRequest, now: float
    ) -> PullRecord | None:
        """Weigh the pull and ask the peer: the blocks it sends and when they land, or None."""
        bs = self.config.scheduler.block_size
        token_bytes = self.kv.pull_link.token_bytes(self.cost)
        if not self.pull_cost.pays(pull.num_blocks, bs, round(token_bytes * bs)):
            self.pulls.declined += 1
            return None
        peer = self._by_name[pull.peer]
        assert isinstance(peer, KVSimReplica)
        sent = len(peer.scheduler.kv.pool.cached_run(pull.hashes)) - pull.first
        landed_s = peer.next_boundary(now) + self.kv.pull_link.seconds(sent * bs, self.cost)
        if sent <= 0 or landed_s - now > self.config.routing.pull_timeout_s:
            self.pulls.failed += 1
            return None
        record = PullRecord(
            req.request_id,
            pull.peer,
            replica.name,
            pull.hashes[pull.first : pull.first + sent],
            now,
            landed_s,
        )
        self.pulls.pulled += 1
        self.pulls.records.append(record)
        return record

    def _on_finished(
        self, replica: SimReplica, rec: RequestRecord, out: RequestOutput, now: float
    ) -> int:
        """The last output carries the replica's newest KV events to the router first."""
        if isinstance(replica, KVSimReplica) and replica.publish:
            self.fleet.on_kv_tail(replica.log.tail(replica.name), now)
        return super()._on_finished(replica, rec, out, now)

    def _complete(self, rec: RequestRecord, out: RequestOutput, now: float) -> None:
        rec.finish(now, out.num_output_tokens, out.finish_reason, self.config.keep_itl)
        self._forget_pull(out.request_id)
        self.fleet.on_completed(out.request_id, now)  # as the served router: planted anew

    def _forget_pull(self, request_id: str) -> None:
        """The request's pull is over: its blocks are on the replica's device (or evicted)."""
        replica, hashes = self._moved.pop(request_id, ("", ()))
        moving = self._moving.get(replica, {})
        for h in hashes:
            if moving.get(h, (0.0, ""))[1] == request_id:  # not a later pull's entry
                del moving[h]
        if not moving:
            self._moving.pop(replica, None)
