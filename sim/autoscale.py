"""The fleet simulator with an autoscaling policy in the loop, over a day-shaped arrival curve.

`AutoscaleSim` runs `FleetSim` (the production scheduler and router) with a replica count that a
policy sets while the run goes on, as Serve's controller would:

- every `decision_period_s` the policy reads the replicas' signals, averaged over
  `look_back_s` (Serve averages what replicas push over its look-back window), and returns a
  replica count;
- a replica it adds takes `start_delay_s` to start (placement, weights, KV, warm-up), is paid for
  from the decision on, and is routed to once it is ready;
- a replica it removes stops taking requests at once and is paid for until its last request has
  finished (the drain: no request is lost), then retired; a replica still starting is cancelled
  first;
- with `move_queued`, a replica that starts taking requests also takes queued ones that never ran
  from the others, as the production router routes them again (a hand-back to the ingress):
  a lever outside the policy, measured in bench/results/2026-11-29-autoscaling-levers.md.

Two policies can drive it: `router.autoscaling.decide` on LLM signals, the very function Serve runs
(cluster/autoscaling_policy.py), and `OngoingRequestsPolicy`, a model of Serve's default policy
(desired = ceil(ongoing requests / target_ongoing_requests), with the same delays). The run reports
replica-hours and SLO attainment (the share of requests whose TTFT and ITL p90 meet the SLO).
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from dataclasses import MISSING, dataclass, field
from functools import partial
from typing import Protocol

from router.autoscaling import (
    MAX_DELAY_S,
    MAX_REPLICAS,
    AutoscalingPolicyConfig,
    AutoscalingState,
    LatencyWindow,
    ReplicaSignals,
    ScaleDecision,
    decide,
)
from router.config import MAX_LOAD
from router.policies import RouteRequest
from scheduler import Request, RequestOutput
from settings import check_settings, setting
from sim.cost import CostModel
from sim.fleet import FleetSim
from sim.fleet_config import SimConfig
from sim.metrics import RequestRecord, SimResult
from sim.replica import SimReplica
from sim.workload import SimRequest, check_len_ranges

MAX_DAY_S = 7 * 86400.0
_PRODUCTION = AutoscalingPolicyConfig()
MAX_BURST = 100.0  # a burst of more than 100x the hour's rate is a typo


@dataclass(slots=True)
class DayWorkloadConfig:
    """A day of traffic: the rate follows a cosine from `trough` at the day's start and end to the
    peak at its middle; chat requests by day, long documents (batch jobs) taking a larger share by
    night. `day_s` compresses the day (86,400 is real time). A burst multiplies the rate by
    `burst_factor` from `burst_at` for `burst_len` (both fractions of the day): a day shaped unlike
    the one a policy was tuned on."""

    day_s: float = setting(86400.0, "seconds the day lasts", gt=0, le=MAX_DAY_S)
    peak_rate: float = setting(10.0, "requests per second at the peak", gt=0, le=1e6)
    peak_to_trough: float = setting(10.0, "peak rate / trough rate", ge=1, le=1e6)
    long_share_peak: float = setting(
        0.1, "share of requests at the peak that are long documents", ge=0, le=1
    )
    long_share_trough: float = setting(0.5, "...and at the trough", ge=0, le=1)
    tenants: int = setting(64, "tenants, each with its system prompt", ge=1, le=1 << 20)
    system_prompt_len: int = setting(256, "tokens of each system prompt", ge=0, le=1 << 20)
    chat_question_len: tuple[int, int] = (32, 512)
    chat_output_len: tuple[int, int] = (64, 512)
    long_prompt_len: tuple[int, int] = (1024, 3072)
    long_output_len: tuple[int, int] = (256, 1024)
    burst_at: float = setting(0.0, "where the burst starts, as a fraction of the day", ge=0, le=1)
    burst_len: float = setting(0.0, "how long it lasts, as a fraction of the day", ge=0, le=1)
    burst_factor: float = setting(1.0, "the burst's rate multiplier", ge=1, le=MAX_BURST)
    seed: int = setting(0, "seed of the day's draws", ge=0, lt=2**63)

    def __post_init__(self) -> None:
        check_settings(self)
        check_len_ranges(
            self, "chat_question_len", "chat_output_len", "long_prompt_len", "long_output_len"
        )

    def level(self, t: float) -> float:
        """0 at the trough (the day's start and end), 1 at the peak (its middle)."""
        return (1 - math.cos(2 * math.pi * t / self.day_s)) / 2

    def rate(self, t: float) -> float:
        trough = self.peak_rate / self.peak_to_trough
        base = trough + (self.peak_rate - trough) * self.level(t)
        return base * self.burst_factor if self.in_burst(t) else base

    def in_burst(self, t: float) -> bool:
        start = self.burst_at * self.day_s
        return start <= t < start + self.burst_len * self.day_s

    def top_rate(self) -> float:
        """The most the rate reaches (the envelope that arrivals are thinned from)."""
        return self.peak_rate * (self.burst_factor if self.burst_len > 0 else 1.0)


def day_workload(cfg: DayWorkloadConfig) -> list[SimRequest]:
    """Poisson arrivals at cfg.rate(t) (thinned from the top rate) over one day."""
    rng = random.Random(cfg.seed)
    out: list[SimRequest] = []
    t = 0.0
    top = cfg.top_rate()
    while True:
        t += rng.expovariate(top)
        if t >= cfg.day_s:
            return out
        if rng.random() * top > cfg.rate(t):
            continue
        level = cfg.level(t)
        long_share = cfg.long_share_trough + (cfg.long_share_peak - cfg.long_share_trough) * level
        rid = f"r{len(out)}"
        if rng.random() < long_share:
            out.append(
                SimRequest(
                    rid,
                    t,
                    rng.randint(*cfg.long_prompt_len),
                    rng.randint(*cfg.long_output_len),
                    tenant="batch",
                )
            )
            continue
        k = rng.randrange(cfg.tenants)
        out.append(
            SimRequest(
                rid,
                t,
                cfg.system_prompt_len + rng.randint(*cfg.chat_question_len),
                rng.randint(*cfg.chat_output_len),
                prefix_group=f"t{k}",
                prefix_len=cfg.system_prompt_len,
                tenant=f"t{k}",
            )
        )


@dataclass(slots=True)
class OngoingRequestsPolicy:
    """A model of Serve's default policy: desired = ceil(ongoing requests / target), where ongoing
    requests are the fleet's running and waiting requests averaged over the look-back window;
    the count changes once the desire has held for upscale_delay_s / downscale_delay_s (as
    ray.serve.autoscaling_policy applies them), within the bounds."""

    # The knob a plan sweeps: no default to drift from deploy's. The others are deploy.yaml's.
    target_ongoing_requests: float = setting(
        MISSING, "ongoing requests per replica", gt=0, le=MAX_LOAD
    )
    min_replicas: int = setting(_PRODUCTION.min_replicas, "fewest replicas", ge=0, le=MAX_REPLICAS)
    max_replicas: int = setting(64, "most replicas", ge=1, le=MAX_REPLICAS)
    upscale_delay_s: float = setting(
        _PRODUCTION.upscale_delay_s, "upscale delay", ge=0, le=MAX_DELAY_S
    )
    downscale_delay_s: float = setting(
        _PRODUCTION.downscale_delay_s, "downscale delay", ge=0, le=MAX_DELAY_S
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas: must be in [0, max_replicas], got {self.min_replicas}")

    def decide(
        self, signals: list[ReplicaSignals], current: int, state: AutoscalingState, now: float
    ) -> ScaleDecision:
        ongoing = sum(s.num_running + s.num_waiting for s in signals)
        desired = max(
            self.min_replicas,
            min(self.max_replicas, math.ceil(ongoing / self.target_ongoing_requests - 1e-9)),
        )
        if desired > current:
            since = state.up_since_s if state.up_since_s is not None else now
            if now - since >= self.upscale_delay_s:
                return ScaleDecision(desired, "ongoing_requests", AutoscalingState())
            return ScaleDecision(current, "upscale_delay", AutoscalingState(up_since_s=since))
        if desired < current:
            since = state.down_since_s if state.down_since_s is not None else now
            if now - since >= self.downscale_delay_s:
                return ScaleDecision(desired, "ongoing_requests", AutoscalingState())
            return ScaleDecision(current, "downscale_delay", AutoscalingState(down_since_s=since))
        return ScaleDecision(current, "steady", AutoscalingState())


@dataclass(slots=True)
class LLMSignalsPolicy:
    """router.autoscaling.decide, as Serve runs it."""

    config: AutoscalingPolicyConfig

    def decide(
        self, signals: list[ReplicaSignals], current: int, state: AutoscalingState, now: float
    ) -> ScaleDecision:
        return decide(signals, current, self.config, state, now)


class Policy(Protocol):
    def decide(
        self, signals: list[ReplicaSignals], current: int, state: AutoscalingState, now: float
    ) -> ScaleDecision: ...


@dataclass(slots=True)
class AutoscaleConfig:
    """The control loop around the policy: how often it decides, over what window, and how long a
    new replica takes to start."""

    decision_period_s: float = setting(
        5.0, "seconds between the policy's decisions", gt=0, le=MAX_DAY_S
    )
    look_back_s: float = setting(
        10.0, "signals averaged over this window (Serve's look_back_period_s)", gt=0, le=MAX_DAY_S
    )
    latency_window_s: float = setting(
        30.0, "each replica's TTFT and ITL p90 over this window", gt=0, le=MAX_DAY_S
    )
    start_delay_s: float = setting(
        30.0, "scale-up decision -> the replica takes requests", ge=0, le=MAX_DAY_S
    )
    initial_replicas: int = setting(1, "replicas at the start", ge=1, le=1 << 20)
    move_queued: bool = setting(
        False,
        "a replica that starts taking requests takes over the queued requests that never ran "
        "(handed back by their replica, routed again among it and the new ones)",
    )

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(slots=True)
class AutoscaleResult:
    result: SimResult
    replica_seconds: float
    decisions: Counter[str] = field(default_factory=Counter)  # replica-count changes by reason
    moved: int = 0  # queued requests moved to a replica that had just started (move_queued)
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, routed, billed)

    @property
    def replica_hours(self) -> float:
        return self.replica_seconds / 3600

    def slo_attainment(self, ttft_s: float, itl_s: float) -> float:
        done = [r for r in self.result.records if r.finish_s is not None]
        good = sum(1 for r in done if r.ttft_s <= ttft_s and r.itl_p90_s <= itl_s)
        return good / len(done) if done else 1.0


class AutoscaleSim(FleetSim):
    """FleetSim whose replica count a policy sets as the run goes (see the module doc)."""

    def __init__(
        self, config: SimConfig, cost: CostModel, policy: Policy, loop: AutoscaleConfig
    ) -> None:
        config.num_replicas = loop.initial_replicas
        super().__init__(config, cost)
        self.policy = policy
        self.loop = loop
        self._state = AutoscalingState()
        self._starting: list[tuple[float, SimReplica]] = []  # (ready at, replica)
        self._retired: list[SimReplica] = []
        self._history: dict[str, deque[tuple[float, ReplicaSignals]]] = {}
        self._ttft: dict[str, LatencyWindow] = {}
        self._itl: dict[str, LatencyWindow] = {}
        self._next_decision_s = loop.decision_period_s
        self._last_bill_s = 0.0
        self._serial = len(self.replicas)
        self.replica_seconds = 0.0
        self.decisions: Counter[str] = Counter()
        self.moved = 0
        self.timeline: list[tuple[float, int, int]] = []
        for r in self.replicas:
            self._watch(r)

    def run_day(self, workload: list[SimRequest]) -> AutoscaleResult:
        result = self.run(workload)
        self._bill(result.end_s)
        result.replicas = self._retired + self.replicas
        return AutoscaleResult(
            result, self.replica_seconds, self.decisions, self.moved, self.timeline
        )

    # ---- hooks into FleetSim -----------------------------------------------------------------
    def _take_stats(self, now: float) -> None:
        super()._take_stats(now)
        self._bill(now)
        self._start_ready(now)
        self._retire_drained()
        self._sample(now)
        if now >= self._next_decision_s:
            self._next_decision_s = now + self.loop.decision_period_s
            self._decide(now)

    def _complete(self, rec: RequestRecord, out: RequestOutput, now: float) -> None:
        super()._complete(rec, out, now)
        # Latency is known here at the latest; a replica measures TTFT at the first token, so the
        # simulated signal lags the real one by the request's decode time.
        if rec.replica in self._ttft:
            self._ttft[rec.replica].add(now, rec.ttft_s)
            self._itl[rec.replica].add(now, rec.itl_p90_s)

    # ---- the control loop ----------------------------------------------------------------------
    def _watch(self, replica: SimReplica) -> None:
        self._history[replica.name] = deque()
        self._ttft[replica.name] = LatencyWindow(self.loop.latency_window_s)
        self._itl[replica.name] = LatencyWindow(self.loop.latency_window_s)

    def _billed(self) -> int:
        return len(self.replicas) + len(self._starting)

    def _bill(self, now: float) -> None:
        self.replica_seconds += (now - self._last_bill_s) * self._billed()
        self._last_bill_s = now
        self.timeline.append((now, len(self.names), self._billed()))

    def _start_ready(self, now: float) -> None:
        ready = [r for at, r in self._starting if at <= now]
        if not ready:
            return
        self._starting = [(at, r) for at, r in self._starting if at > now]
        for r in ready:
            self.replicas.append(r)
            self._by_name[r.name] = r
            self._index[r.name] = len(self._index)
            self._watch(r)
        self.names = self.names + tuple(r.name for r in ready)
        if self.loop.move_queued:  # a timer: moving a request needs the run's records
            self._timer(now, partial(self._move_queued, [r.name for r in ready]))

    # ---- queued requests moved to a replica that has just started (move_queued) ---------------
    def _move_queued(self, fresh: list[str], now: float, records: dict[str, RequestRecord]) -> None:
        """The routed replicas' queued requests that never ran, oldest first, each routed again by
        the production router among its own replica and the fresh ones: as if its replica handed
        it back and the ingress resubmitted it (deploy/generation.py's migration). One that the
        router sends elsewhere moves; its place in the queue is its arrival."""
        targets = [n for n in fresh if n in self.names]
        if not targets:
            return
        queued = [
            (req, r)
            for r in self.replicas
            if r.name in self.names and r.name not in targets
            for req in r.scheduler.waiting
            if req.num_computed_tokens == 0 and not req.output_token_ids
        ]
        for req, source in sorted(queued, key=lambda pair: pair[0].arrival_time):
            self._move(req, source, [source.name, *targets], now, records)

    def _move(
        self,
        req: Request,
        source: SimReplica,
        candidates: list[str],
        now: float,
        records: dict[str, RequestRecord],
    ) -> None:
        """req (queued on source, never run) routed again among candidates; moved if sent away."""
        rid = req.request_id
        output_len = source.output_len[rid]
        full = req.num_prompt_tokens // self.config.scheduler.block_size
        hashes = list(req.block_hashes[:full])
        route = RouteRequest(rid, req.num_prompt_tokens + output_len, hashes, req.lora_name)
        name = self.fleet.choose(route, candidates, now)
        assert name is not None  # simulated replicas always report themselves OK
        self.fleet.on_routed(route, name, now)  # confirmed where it went, its own replica too
        if name == source.name:
            return
        source.scheduler.abort_requests([rid])
        del source.output_len[rid]
        target = self._by_name[name]
        self._before_add(target, now, records)
        records[rid].replica = name
        target.add(
            rid,
            req.prompt_token_ids,
            output_len,
            req.tenant,
            req.priority,
            req.arrival_time,
            hashes,
            req.lora_name,
        )
        self._after_add(target, now)
        self.moved += 1

    def _retire_drained(self) -> None:
        routed = set(self.names)
        done = [
            r
            for r in self.replicas
            if r.name not in routed
            and r.in_flight is None
            and not r.scheduler.has_unfinished_requests()
        ]
        for r in done:
            self.replicas.remove(r)
            self._retired.append(r)
            self.fleet.remove_replica(r.name)
            for table in (self._history, self._ttft, self._itl):
                del table[r.name]

    def _sample(self, now: float) -> None:
        cutoff = now - self.loop.look_back_s
        for name in self.names:
            r = self._by_name[name]
            stats = r.scheduler.stats()
            history = self._history[name]
            history.append(
                (
                    now,
                    ReplicaSignals(
                        stats.kv_cache_usage,
                        stats.num_waiting,
                        stats.num_waiting_prompt_tokens,
                        stats.num_running,
                        self.config.scheduler.max_num_seqs,
                        self._ttft[name].p90(now),
                        self._itl[name].p90(now),
                        stats.num_gpu_blocks * self.config.scheduler.block_size,
                    ),
                )
            )
            while history[0][0] < cutoff:
                history.popleft()

    def _averaged(self, name: str) -> ReplicaSignals:
        """The replica's signals averaged over the look-back window (latencies: the latest)."""
        samples = [s for _, s in self._history[name]]
        n = len(samples)
        last = samples[-1]
        return ReplicaSignals(
            sum(s.kv_cache_usage for s in samples) / n,
            round(sum(s.num_waiting for s in samples) / n),
            round(sum(s.num_waiting_prompt_tokens for s in samples) / n),
            round(sum(s.num_running for s in samples) / n),
            last.max_num_seqs,
            last.ttft_p90_s,
            last.itl_p90_s,
            last.kv_cache_tokens,
        )

    def _decide(self, now: float) -> None:
        signals = [self._averaged(name) for name in self.names if self._history[name]]
        current = len(self.names) + len(self._starting)
        decision = self.policy.decide(signals, current, self._state, now)
        self._state = decision.state
        if decision.replicas > current:
            for _ in range(decision.replicas - current):
                self._starting.append((now + self.loop.start_delay_s, self._new_replica()))
        elif decision.replicas < current:
            self._remove(current - decision.replicas)
        else:
            return
        self.decisions[decision.reason] += 1

    def _new_replica(self) -> SimReplica:
        self._serial += 1
        return self._new(f"replica-{self._serial - 1}")

    def _remove(self, count: int) -> None:
        """Cancel replicas still starting (the latest first), then drain the least busy."""
        while count and self._starting:
            self._starting.pop()
            count -= 1
        if not count:
            return
        by_load = sorted(
            self.names,
            key=lambda n: (
                len(self._by_name[n].scheduler.running) + len(self._by_name[n].scheduler.waiting)
            ),
        )
        drained = set(by_load[:count])
        self.names = tuple(n for n in self.names if n not in drained)
