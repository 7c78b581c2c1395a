"""Discrete-event simulation: arrivals -> production router -> N replicas -> completions."""

from __future__ import annotations

import bisect
import gc
import heapq
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from operator import sub
from typing import cast

from router.fleet import FleetState
from router.policies import RouteRequest
from router.stats import RoutingStats
from scheduler import RequestOutput, extend_block_hashes, hash_prompt_blocks
from sim.cost import CostModel
from sim.fleet_config import SimConfig
from sim.lora_replica import LoraSimReplica
from sim.metrics import GapTally, RequestRecord, SimResult
from sim.replica import AppliedStep, Cruise, SimReplica, StepPlan
from sim.speculation import SpecSimReplica
from sim.tiers import TierSimReplica
from sim.workload import SimRequest

logger = logging.getLogger(__name__)

# Allocations between young-generation collections while a run is in progress (Python's default:
# 700).
RUN_GC_THRESHOLD = 200_000


@contextmanager
def _rare_collections() -> Iterator[None]:
    """Collect garbage rarely while a run is in progress, and never rescan what existed before it.

    Steps allocate many short-lived objects that reference counting frees (outputs, token lists,
    step plans) while the workload, the records and the replicas' caches live on, and every
    collection scans those: at the default threshold a large fleet spends a good part of its wall
    time rescanning them. The run makes no reference cycles of its own, so collecting rarely costs
    it no memory (docs/decisions/0008 has the figures).
    """
    threshold = gc.get_threshold()
    frozen_by_caller = gc.get_freeze_count() > 0  # unfreeze() would thaw the caller's objects too
    gc.freeze()
    gc.set_threshold(RUN_GC_THRESHOLD, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if not frozen_by_caller:
            gc.unfreeze()


@dataclass(slots=True)
class _StatsRound:
    """One round of routing-stats reports: taken at one instant, delivered together after the delay.

    A replica running a step at the take answers once that step completes, as a production replica
    answers the router's prefix-hash call between steps; if that is after the delivery, its report
    reaches the router the moment it is taken.
    """

    reports: list[tuple[int, str, RoutingStats]] = field(
        default_factory=list
    )  # (replica index, name, stats)
    delivered: bool = False


# Event kinds, in the order events of one instant are handled.
# A kick starts an idle replica's step after every arrival of the same instant is queued (as an
# engine that is handed a batch of requests at once schedules them together). A timer is a
# subclass's own event (a KV transfer landing, sim/disagg.py): it queues work as an arrival does.
_ARRIVAL, _TIMER, _KICK, _STEP_END, _STATS_TAKE, _STATS_DELIVER, _STOP = 0, 1, 2, 3, 4, 5, 6

# Each kind's payload: an arrival carries (workload index, request), a timer its callback, a kick
# its replica, a step end (replica, the step or cruise it ends), a delivery its round; a stats take
# and the stop none.
_Arrival = tuple[int, SimRequest]
_StepEnd = tuple[SimReplica, StepPlan | Cruise | AppliedStep]
Timer = Callable[[float, dict[str, RequestRecord]], None]  # (now, the run's records)
_Payload = _Arrival | Timer | SimReplica | _StepEnd | _StatsRound | None


class FleetSim:
    """Runs a workload through the fleet; `run()` returns per-request records and fleet counters."""

    def __init__(
        self,
        config: SimConfig,
        cost: CostModel,
        on_step: Callable[[SimReplica, float], None] | None = None,
    ):
        """on_step(replica, now) runs after each step a replica completes (a k-step jump: once, at
        its end)."""
        self.config = config
        self.cost = cost
        self.on_step = on_step
        self.replicas = [self._new(f"replica-{i}") for i in range(config.num_replicas)]
        self._cohosts = self._cohost_map()
        self.names = tuple(r.name for r in self.replicas)
        self._by_name = {r.name: r for r in self.replicas}
        self.fleet = FleetState(config.routing)
        self._events: list[tuple[float, int, int, _Payload]] = []
        self._seq = 0
        self._next_stats_s = 0.0
        self._index = {r.name: i for i, r in enumerate(self.replicas)}
        # Replicas that report once their running step ends.
        self._awaiting: dict[str, _StatsRound] = {}
        self.coalesced_steps = 0  # steps run in place, without a trip through the event queue
        self.jumped_steps = 0  # steps applied by a cruise's k-step jump, without scheduler calls
        # a prefix group's leading blocks (keyed by (adapter, tokens) under an adapter)
        self._shared_hashes: dict[tuple, list[int]] = {}
        self._itl_tally = GapTally()  # finished requests' gaps

    def _cohost_map(self) -> dict[str, list[SimReplica]]:
        """Each replica's co-hosts (the others of its host), when hosts share cores."""
        host = self.config.host
        if not host.shared:
            return {}
        per = host.replicas_per_host
        return {
            r.name: [o for o in self.replicas[i // per * per : (i // per + 1) * per] if o is not r]
            for i, r in enumerate(self.replicas)
        }

    def _new(self, name: str) -> SimReplica:
        """A replica as the config has it: with adapter slots, with a CPU tier, or plain."""
        config = self.config
        if config.adapters is not None:
            return LoraSimReplica(
                name, config.scheduler, self.cost, config.max_tokens, config.adapters
            )
        if config.spec is not None:
            return SpecSimReplica(name, config.scheduler, self.cost, config.max_tokens, config.spec)
        if config.scheduler.cpu_tier_blocks:
            return TierSimReplica(
                name, config.scheduler, self.cost, config.max_tokens, config.tier_link
            )
        return SimReplica(name, config.scheduler, self.cost, config.max_tokens)

    def _push(self, t: float, kind: int, payload: _Payload) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, kind, self._seq, payload))

    def run(self, workload: list[SimRequest], until_s: float = math.inf) -> SimResult:
        """Simulate until every request has finished, or up to simulated second until_s.

        Requests still in flight at until_s are left unfinished (finish_s None). Arrivals enter the
        event queue one at a time, so a long workload costs no queue memory.
        """
        with _rare_collections():
            return self._run(workload, until_s)

    def _run(self, workload: list[SimRequest], until_s: float) -> SimResult:
        records = {
            r.request_id: RequestRecord(
                r.request_id, r.tenant, r.arrival_s, r.prompt_len, r.output_len
            )
            for r in workload
        }
        # Stable: arrivals at the same instant keep their workload order, as before streaming.
        arrivals = iter(sorted(enumerate(workload), key=lambda pair: pair[1].arrival_s))
        self._push_arrival(arrivals)
        if workload:
            self._push(0.0, _STATS_TAKE, None)
        if until_s < math.inf:
            self._push(until_s, _STOP, None)  # also bounds coalesced stretches
        remaining = len(workload)
        now = 0.0
        while self._events and remaining:
            now, kind, _, payload = heapq.heappop(self._events)
            # The kind says which payload it carries (see _Payload).
            if kind == _ARRIVAL:
                self._arrive(*cast(_Arrival, payload), now, records)
                self._push_arrival(arrivals)
            elif kind == _TIMER:
                cast(Timer, payload)(now, records)
            elif kind == _KICK:
                replica = cast(SimReplica, payload)
                if replica.in_flight is None:
                    self._step(replica, now)
            elif kind == _STEP_END:
                remaining -= self._end_step(cast(_StepEnd, payload), now, records)
            elif kind == _STATS_TAKE:
                self._take_stats(now)
            elif kind == _STATS_DELIVER:
                round_ = cast(_StatsRound, payload)
                round_.delivered = True
                for _, name, stats in sorted(round_.reports, key=lambda report: report[0]):
                    self.fleet.on_stats(name, stats, now)
            else:
                return self._result(records, until_s)
        # The last event popped may precede the end of a coalesced stretch: end at the last finish.
        end = max((r.finish_s for r in records.values() if r.finish_s is not None), default=now)
        return self._result(records, end)

    def _result(self, records: dict[str, RequestRecord], end_s: float) -> SimResult:
        self._itl_tally.discount([r for r in records.values() if r.finish_s is None])
        return SimResult(
            list(records.values()),
            end_s,
            self.replicas,
            self.coalesced_steps,
            self.jumped_steps,
            self._itl_tally,
        )

    def _take_stats(self, now: float) -> None:
        """Idle replicas report now; busy ones once their running step (or cruise) ends."""
        round_ = _StatsRound()
        for i, r in enumerate(self.replicas):
            if r.in_flight is None:
                round_.reports.append((i, r.name, r.routing_stats()))
            else:
                self._awaiting[r.name] = round_
        self._push(now + self.config.stats_delay_s, _STATS_DELIVER, round_)
        self._next_stats_s = now + self.config.stats_period_s
        self._push(self._next_stats_s, _STATS_TAKE, None)

    def _report_if_awaited(self, replica: SimReplica, now: float) -> None:
        round_ = self._awaiting.pop(replica.name, None)
        if round_ is None:
            return
        stats = replica.routing_stats()
        if round_.delivered:
            self.fleet.on_stats(replica.name, stats, now)
        else:
            round_.reports.append((self._index[replica.name], replica.name, stats))

    def _push_arrival(self, arrivals: Iterator[tuple[int, SimRequest]]) -> None:
        nxt = next(arrivals, None)
        if nxt is not None:
            self._push(nxt[1].arrival_s + self.config.serving_overhead_s, _ARRIVAL, nxt)

    def _arrive(
        self, i: int, req: SimRequest, now: float, records: dict[str, RequestRecord]
    ) -> None:
        """Route request i of the workload and queue it at its replica."""
        prompt = req.prompt_token_ids(i)
        lora = (req.lora_name or None) if self.config.adapters is not None else None
        hashes = self._hashes(req, prompt, lora)
        route = RouteRequest(req.request_id, req.prompt_len + req.output_len, hashes, lora)
        name = self.fleet.choose(route, self.names, now)
        assert name is not None  # simulated replicas always report themselves OK
        self.fleet.on_routed(route, name, now)
        replica = self._by_name[name]
        self._before_add(replica, now, records)
        records[req.request_id].replica = name
        replica.add(
            req.request_id,
            prompt,
            req.output_len,
            req.tenant,
            req.priority,
            now,
            hashes,
            lora,
        )
        self._after_add(replica, now)

    def _before_add(
        self, replica: SimReplica, now: float, records: dict[str, RequestRecord]
    ) -> None:
        """A request is about to join replica's queue: a cruise in flight ends first."""
        if isinstance(replica.in_flight, Cruise):
            self._interrupt(replica, now, records)

    def _after_add(self, replica: SimReplica, now: float) -> None:
        """A request joined replica's queue: an idle replica starts a step once the instant's other
        arrivals are queued."""
        if replica.in_flight is None:
            self._push(now, _KICK, replica)

    def _hashes(self, req: SimRequest, prompt: list[int], lora: str | None) -> list[int]:
        """hash_prompt_blocks(prompt, lora_name=lora), hashing a prefix group's shared full blocks
        once per group and adapter."""
        bs = self.config.scheduler.block_size
        shared = (min(req.prefix_len, req.prompt_len) if req.prefix_group else 0) // bs * bs
        key = tuple(prompt[:shared])
        cache_key = key if lora is None else (lora, key)
        hashes = self._shared_hashes.get(cache_key)
        if hashes is None:
            hashes = self._shared_hashes[cache_key] = hash_prompt_blocks(key, bs, lora_name=lora)
        return extend_block_hashes(list(hashes), prompt, bs, len(prompt) // bs, lora)

    def _stretch(self, replica: SimReplica) -> float:
        """The host-sharing factor for a step this replica starts now (it counts as busy)."""
        if not self._cohosts:
            return 1.0
        return self.config.host.stretch(
            1 + sum(1 for o in self._cohosts[replica.name] if o.in_flight is not None)
        )

    def _retime_cohosts(self, replica: SimReplica, now: float, became_busy: bool) -> None:
        """replica just started or stopped running steps: the co-hosted steps in flight change
        speed.

        Each keeps the work it has left (its remaining time over the old factor) and finishes it at
        the new factor; the event at its old end time is then ignored.
        """
        others = [
            (o, plan)
            for o in self._cohosts[replica.name]
            if isinstance(plan := o.in_flight, StepPlan)
        ]
        if not others:
            return
        busy = len(others) + 1 if became_busy else len(others)
        before = self.config.host.stretch(busy - 1 if became_busy else busy + 1)
        after = self.config.host.stretch(busy)
        if before == after:
            return
        for o, plan in others:
            end = now + (plan.end_s - now) / before * after
            o.busy_s += end - plan.end_s
            plan.end_s = end
            self._push(end, _STEP_END, (o, plan))

    def _step(self, replica: SimReplica, now: float) -> None:
        was_idle = replica.in_flight is None
        plan = replica.start_step(now, self._stretch(replica))
        if plan is not None:
            self._push(plan.end_s, _STEP_END, (replica, plan))
            if was_idle and self._cohosts:
                self._retime_cohosts(replica, now, became_busy=True)

    def _next(self, replica: SimReplica, now: float) -> StepPlan | Cruise | None:
        # A cruise ends with the step running at the next stats take: the report must see the
        # replica's exact state once that step completes. With shared hosts a co-hosted replica's
        # start or stop would change the cruise's step times: none.
        if self.config.coalesce and not self._cohosts:
            cruise = replica.plan_cruise(now, self._next_stats_s)
            if cruise is not None:
                return cruise
        return replica.start_step(now, self._stretch(replica))

    def _end_step(self, payload: _StepEnd, now: float, records: dict[str, RequestRecord]) -> int:
        """Finish replica's step (or cruise) and, while no other event comes first, run the next in
        place."""
        replica, ended = payload
        # A cruise an arrival interrupted (its steps are applied), or a step re-timed by host
        # sharing.
        if replica.in_flight is not ended or ended.end_s != now:
            return 0
        finished = 0
        while True:
            finished += self._apply(replica, now, records)
            plan = self._next(replica, now)
            if plan is None:
                if self._cohosts:
                    self._retime_cohosts(replica, now, became_busy=False)
                return finished
            if not (self.config.coalesce and (not self._events or plan.end_s < self._events[0][0])):
                self._push(plan.end_s, _STEP_END, (replica, plan))
                return finished
            now = plan.end_s
            self.coalesced_steps += 1

    def _interrupt(
        self, replica: SimReplica, now: float, records: dict[str, RequestRecord]
    ) -> None:
        """An arrival reaches a cruising replica: the steps ended before now and the one running end
        the cruise.

        The running step is applied now, before the arrival joins the queue (it was scheduled
        before), and the replica stays busy until its end. Nothing observes the replica's state
        before then: reports wait for the step's end, and scheduling starts after it. The cruise's
        last step may finish requests, which the router must learn of at its end: that one is
        scheduled now and runs as a single step.
        """
        cruise = replica.in_flight
        assert isinstance(cruise, Cruise)
        done = bisect.bisect_left(
            cruise.ends, now
        )  # arrivals precede step ends at the same instant
        if (
            done == len(cruise.ends) - 1
        ):  # the last step, which may finish requests: seen at its end
            if done > cruise.applied:
                self._apply_jump(replica, cruise, done, records)
            plan: StepPlan | AppliedStep = replica.step_singly()
        else:
            # The ended steps and the running one in one jump, which ends with the running step:
            # on_step sees it then.
            finished = self._apply_jump(replica, cruise, done + 1, records, notify=False)
            assert finished == 0, "only a cruise's last step can finish a request"
            plan = replica.in_flight = AppliedStep(cruise.ends[done])
        self._push(plan.end_s, _STEP_END, (replica, plan))

    def _apply(self, replica: SimReplica, now: float, records: dict[str, RequestRecord]) -> int:
        plan = replica.in_flight
        if isinstance(plan, Cruise):
            finished = self._apply_jump(replica, plan, len(plan.ends), records)
            replica.in_flight = None
            self._report_if_awaited(replica, now)
            return finished
        if isinstance(plan, AppliedStep):
            replica.in_flight = None
            if self.on_step is not None:
                self.on_step(replica, now)
            self._report_if_awaited(replica, now)
            return 0
        finished = 0
        for out in replica.finish_step():
            rec = records[out.request_id]
            gap = rec.on_tokens(now, len(out.new_token_ids), out.num_cached_tokens)
            if gap is not None:
                self._itl_tally.add(gap)
            if out.finished:
                finished += self._on_finished(replica, rec, out, now)
        if self.on_step is not None:
            self.on_step(replica, now)
        self._report_if_awaited(replica, now)
        return finished

    def _timer(self, t: float, callback: Timer) -> None:
        """Call callback(now, records) at simulated second t (a subclass's own events)."""
        self._push(t, _TIMER, callback)

    def _on_finished(
        self, replica: SimReplica, rec: RequestRecord, out: RequestOutput, now: float
    ) -> int:
        """replica finished out's request at now: 1 if that ends the request in the fleet (a
        disaggregated fleet's prefill replica hands it on instead, sim/disagg.py)."""
        self._complete(rec, out, now)
        return 1

    def _complete(self, rec: RequestRecord, out: RequestOutput, now: float) -> None:
        """out finished its request at now: record it and tell the router."""
        rec.finish(now, out.num_output_tokens, out.finish_reason, self.config.keep_itl)
        self.fleet.on_completed(out.request_id)

    def _apply_jump(
        self,
        replica: SimReplica,
        cruise: Cruise,
        upto: int,
        records: dict[str, RequestRecord],
        notify: bool = True,
    ) -> int:
        """Apply the cruise's steps up to `upto`; notify: on_step at the last one's end (it has
        ended).

        Returns how many requests the last step finished (only a cruise's last step can).
        """
        times = cruise.ends[cruise.applied : upto]
        gaps = list(map(sub, times[1:], times))
        outputs = replica.jump(upto)
        tally = self._itl_tally
        finished = 0
        for out in outputs:
            rec = records[out.request_id]
            lead = rec.on_token_run(times, gaps, out.num_cached_tokens)
            if lead is not None:
                tally.add(lead)
            if out.finished:
                finished += self._on_finished(replica, rec, out, times[-1])
        tally.add_shared(gaps, len(outputs))
        self.jumped_steps += len(times)
        if notify and self.on_step is not None:
            self.on_step(replica, times[-1])
        return finished
