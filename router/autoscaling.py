"""Autoscaling on LLM signals: how many replicas a model needs, as a pure function of what its
replicas report.

Serve's default policy counts ongoing requests, and a replica with ten short chats looks like one
with ten long essays. What limits an LLM replica is its KV cache, its running batch against
`max_num_seqs`, the prompts queued behind them, and the latency it delivers against the model's
SLO; `decide` reads those. Each load signal is turned into a demand in replicas (the fleet's total
over a per-replica target), and the fleet needs the largest of them:

- up: the largest demand, plus its rising trend over `lead_s` (a new replica takes about that long
  to start, so the count is set for where the load will be then; a load measured while a queue
  is beyond what it counts is a lower bound, and the trend forgets it), rounds up above the current
  count (at most to twice the replicas that report: a backlog that grows while new replicas start
  is not counted again at every decision), or the measured TTFT or ITL p90 is over its SLO (then
  the count grows by the ratio, at most doubling; after a scale-up the latency signals are ignored
  for `slo_cooldown_s`, while the new replica starts and the window refills);
- down: the largest demand over `downscale_headroom` (a dead band under the targets) still fits in
  fewer replicas, and both latencies are under `downscale_headroom` of their SLO, for
  `downscale_delay_s` without a break; the count falls to the most that the wait asked for.
  Replicas still starting serve nothing yet, so they go at once, without the wait, once the load's
  mean over `lead_s` is under half the load that asked for them (`CANCEL_BELOW`): a burst shorter
  than a start-up is over before its replicas are ready, and paying for them through the delay
  buys nothing.

A queue is a backlog, not a standing need: requests wait on the replica they were routed to, so a
new replica takes only new arrivals. Queued prompts therefore count as KV at most as much again as
the replica holds (a full replica with a queue needs about another), and the TTFT p90 counts only
while some request waits: the window remembers a drained backlog for its whole length, and read
without a queue it would add replicas after the burst and hold them (on the 2026-11-28 shaped day
it took the count from 20 to 40 after the burst was over).

The dead band keeps a noisy load from flapping: a load that sways by less than the band around its
mean scales once and then holds. The function is pure: the state (`AutoscalingState`) goes in and
comes out, so Serve (cluster/autoscaling_policy.py) and the simulator (sim/autoscale.py) run the
same decisions.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from settings import check_settings, setting

# A fleet this large is a typo, not a setting.
MAX_REPLICAS = 1 << 20
MAX_DELAY_S = 86400.0
# Replicas still starting are cancelled, without the downscale delay, once the load's mean (over
# lead_s) is under this share of the load that asked for them: halved, it is a burst that ended.
# The 10 s averages of a steady load sway by 30-50% between decisions with long documents in the
# mix (development day 17, tuning day 0), so neither the load itself nor the downscale band (0.7)
# will do: on those a cancel flapped, or took away the replicas a rise needed.
CANCEL_BELOW = 0.5
# Why a decision went the way it did; the dashboards count decisions by these.
REASONS = (
    "kv_cache",  # KV-cache usage over its target
    "batch",  # running + waiting requests over the batch target
    "queued_tokens",  # prompt tokens queued over their target
    "ttft_slo",  # measured TTFT p90 over the SLO
    "itl_slo",  # measured ITL p90 over the SLO
    "low_load",  # every signal fits in fewer replicas, with headroom
    "min_replicas",  # below the lower bound
    "max_replicas",  # above the upper bound (or capped there)
    "upscale_delay",  # would scale up: waiting out upscale_delay_s
    "downscale_delay",  # would scale down: waiting out downscale_delay_s
    "steady",  # nothing to do
    "no_signals",  # no replica has reported yet
)


@dataclass(slots=True)
class SloTargets:
    """The latency a model promises: the p90 of time to first token and of inter-token gaps."""

    ttft_p90_s: float = setting(
        2.0, "time to first token, p90, that replicas must meet", gt=0, le=3600
    )
    itl_p90_s: float = setting(
        0.2, "gap between output tokens, p90, that replicas must meet", gt=0, le=3600
    )

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(slots=True)
class SignalTargets:
    """Per-replica load the `llm` policy aims at, and its dead band."""

    kv_cache_usage: float = setting(0.75, "KV-cache usage (0-1) per replica", gt=0, le=1)
    batch_fraction: float = setting(
        0.75, "running + waiting requests over max_num_seqs, per replica", gt=0, le=8
    )
    queued_prompt_tokens: int = setting(
        16384, "prompt tokens waiting to be scheduled, per replica", ge=1, le=1 << 40
    )
    downscale_headroom: float = setting(
        0.7,
        "scale down only while every signal stays under this fraction of its target (and of the "
        "SLO) with fewer replicas: the dead band that keeps a noisy load from flapping",
        gt=0,
        lt=1,
    )
    slo_cooldown_s: float = setting(
        30.0,
        "after a scale-up, latency over the SLO adds no replica for this long (the new replica "
        "starts and the measurement window refills)",
        ge=0,
        le=MAX_DELAY_S,
    )
    lead_s: float = setting(
        30.0,
        "scale up for the load expected this far ahead (about a new replica's start-up time): "
        "the demand plus how far it has risen above its own average over the last lead_s; "
        "0 reacts to the demand as it is",
        ge=0,
        le=MAX_DELAY_S,
    )

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(slots=True)
class AutoscalingPolicyConfig:
    """What the `llm` policy needs: bounds, delays, the SLO and the per-replica targets."""

    min_replicas: int = setting(1, "fewest replicas", ge=0, le=MAX_REPLICAS)
    max_replicas: int = setting(1, "most replicas", ge=1, le=MAX_REPLICAS)
    upscale_delay_s: float = setting(
        0.0, "load over target this long adds replicas", ge=0, le=MAX_DELAY_S
    )
    downscale_delay_s: float = setting(
        120.0, "load under target (with headroom) this long removes replicas", ge=0, le=MAX_DELAY_S
    )
    slo: SloTargets = field(default_factory=SloTargets)
    targets: SignalTargets = field(default_factory=SignalTargets)

    def __post_init__(self) -> None:
        check_settings(self)
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas: must be <= max_replicas ({self.max_replicas}), "
                f"got {self.min_replicas}"
            )


def _check_number(name: str, value: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: must be a number, got {value!r}")
    if not (math.isfinite(value) and 0 <= value <= high):
        raise ValueError(f"{name}: must be in [0, {high:g}], got {value!r}")


@dataclass(frozen=True, slots=True)
class ReplicaSignals:
    """One replica's figures, as it last reported them (cluster/replica.py
    `record_autoscaling_stats`, or a simulated replica)."""

    kv_cache_usage: float = 0.0  # 0-1
    num_waiting: int = 0
    num_waiting_prompt_tokens: int = 0
    num_running: int = 0
    max_num_seqs: int = 1
    ttft_p90_s: float | None = None  # over the replica's recent window; None: no samples
    itl_p90_s: float | None = None
    kv_cache_tokens: int = 0  # the KV pool's size in tokens (0: unknown)

    def __post_init__(self) -> None:
        _check_number("kv_cache_usage", self.kv_cache_usage, 1.0)
        for name in ("num_waiting", "num_waiting_prompt_tokens", "num_running", "kv_cache_tokens"):
            _check_number(name, getattr(self, name), float(1 << 62))
        _check_number("max_num_seqs", self.max_num_seqs, float(1 << 62))
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        for name in ("ttft_p90_s", "itl_p90_s"):
            value = getattr(self, name)
            if value is not None:
                _check_number(name, value, 1e9)

    @classmethod
    def from_dict(cls, report: Mapping[str, float]) -> ReplicaSignals:
        """From the flat report Serve carries (record_autoscaling_stats); a latency < 0 is "no
        samples" (Serve's custom metrics must be numbers)."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in report:
                continue
            value = report[f.name]
            if f.name in ("ttft_p90_s", "itl_p90_s"):
                values[f.name] = None if value < 0 else float(value)
            elif f.name == "kv_cache_usage":
                values[f.name] = float(value)
            else:
                values[f.name] = round(value)  # Serve averages over its window
        return cls(**values)

    def to_dict(self) -> dict[str, float]:
        out = {k: float(v) if v is not None else -1.0 for k, v in asdict(self).items()}
        return out


@dataclass(frozen=True, slots=True)
class AutoscalingState:
    """What the policy remembers between decisions (Serve keeps it in policy_state)."""

    up_since_s: float | None = None  # load first asked for more replicas (upscale_delay_s)
    down_since_s: float | None = None  # load first fitted in fewer (downscale_delay_s)
    down_to: int = 0  # the most replicas the load asked for during the downscale wait
    last_scale_up_s: float | None = None
    # The demand's average over the last lead_s (an exponential one) and when it was updated: the
    # trend that scales up ahead of a rising load.
    mean_load: float | None = None
    mean_load_s: float | None = None
    trend: float = 0.0  # replicas per second
    # The load (replicas) that the last scale-up was asked for: replicas still starting are
    # cancelled once the load's mean is under CANCEL_BELOW of it.
    asked_load: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AutoscalingState:
        """From Serve's policy_state, which holds Serve's own keys too: those are skipped."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    replicas: int
    reason: str  # one of REASONS
    state: AutoscalingState


@dataclass(frozen=True, slots=True)
class Demand:
    """The fleet's load in replicas, per signal (each the fleet's total over its target)."""

    kv_cache: float
    batch: float
    queued_tokens: float

    def largest(self) -> tuple[float, str]:
        return max(
            (self.kv_cache, "kv_cache"),
            (self.batch, "batch"),
            (self.queued_tokens, "queued_tokens"),
        )


def _kv_needed(s: ReplicaSignals) -> float:
    """The replica's KV in use plus what its waiting requests will take, as a share of its pool:
    a full cache with a queue behind it needs more than one replica's KV. The queue counts at most
    as much again as the replica holds: it stays where it was routed, and what a new replica
    takes over is the arrivals, not the backlog (the module doc)."""
    queued = s.num_waiting_prompt_tokens / s.kv_cache_tokens if s.kv_cache_tokens else 0.0
    return s.kv_cache_usage + min(queued, s.kv_cache_usage)


def _saturated(s: ReplicaSignals) -> bool:
    """The replica's queue is beyond what `_kv_needed` counts: its load is measured only in part."""
    return (
        s.kv_cache_tokens > 0 and s.num_waiting_prompt_tokens > s.kv_cache_usage * s.kv_cache_tokens
    )


def demand(signals: Sequence[ReplicaSignals], targets: SignalTargets) -> Demand:
    """Replicas each load signal asks for: non-decreasing in every signal."""
    return Demand(
        kv_cache=sum(map(_kv_needed, signals)) / targets.kv_cache_usage,
        batch=sum((s.num_running + s.num_waiting) / s.max_num_seqs for s in signals)
        / targets.batch_fraction,
        queued_tokens=sum(s.num_waiting_prompt_tokens for s in signals)
        / targets.queued_prompt_tokens,
    )


def _latency_ratio(signals: Sequence[ReplicaSignals], slo: SloTargets) -> tuple[float, str]:
    """The worse of the fleet's TTFT and ITL p90 (mean over the replicas with samples) over its
    SLO; 0 without samples. TTFT only while some request waits: without a queue its window holds
    the latencies of a backlog already drained, which more replicas cannot shorten."""
    out = (0.0, "ttft_slo")
    queued = any(s.num_waiting for s in signals)
    for name, target, reason in (
        ("ttft_p90_s", slo.ttft_p90_s, "ttft_slo"),
        ("itl_p90_s", slo.itl_p90_s, "itl_slo"),
    ):
        if reason == "ttft_slo" and not queued:
            continue
        values = [v for s in signals if (v := getattr(s, name)) is not None]
        if values:
            out = max(out, (sum(values) / len(values) / target, reason))
    return out


def _ceil(x: float) -> int:
    # A load of exactly 3.0 replicas fits in 3, whatever rounding left in the sum.
    return math.ceil(x - 1e-9)


def _anticipate(
    load: float, lead_s: float, state: AutoscalingState, now: float
) -> tuple[AutoscalingState, float]:
    """The state with the load's trend updated, and the load expected lead_s ahead.

    A new replica takes its start-up time to serve, so a policy that waits for the load to exceed
    the fleet scales after the queue has formed. The trend is the rate of rise of the load's
    exponential mean (time constant lead_s), itself averaged the same way: smoothed twice, a load
    that only sways around its mean has next to no trend, while a rising one has its slope. A
    falling load adds nothing (scaling down is the dead band's and the delay's business)."""
    if lead_s <= 0 or state.mean_load is None or state.mean_load_s is None:
        return replace(state, mean_load=load, mean_load_s=now, trend=0.0), load
    dt = max(0.0, now - state.mean_load_s)
    weight = 1 - math.exp(-dt / lead_s)
    mean = state.mean_load + weight * (load - state.mean_load)
    slope = (mean - state.mean_load) / dt if dt > 0 else 0.0
    trend = state.trend + weight * (slope - state.trend)
    new = replace(state, mean_load=mean, mean_load_s=now, trend=trend)
    if load < mean:
        # Smoothed twice, the trend outlives the rise it learnt by about lead_s: once a burst
        # ended, it asked for a replica for an idle fleet right after the scale-down that the
        # burst's end had earned, and the cancel took it back, again and again.
        return new, load
    return new, load + max(0.0, trend) * lead_s


def decide(
    signals: Sequence[ReplicaSignals],
    current: int,
    config: AutoscalingPolicyConfig,
    state: AutoscalingState,
    now: float,
) -> ScaleDecision:
    """The replica count for the model now (current: its target count, replicas starting
    included), why, and the state for the next call."""
    lo, hi = config.min_replicas, config.max_replicas
    if current < lo:
        return ScaleDecision(lo, "min_replicas", AutoscalingState(last_scale_up_s=now))
    if current > hi:
        return ScaleDecision(
            hi, "max_replicas", AutoscalingState(last_scale_up_s=state.last_scale_up_s)
        )
    if not signals:
        return ScaleDecision(current, "no_signals", state)
    load, reason = demand(signals, config.targets).largest()
    state, ahead = _anticipate(load, config.targets.lead_s, state, now)
    if any(map(_saturated, signals)):
        # The load is a lower bound (the queue beyond the cap is not counted), and it rises as the
        # fleet grows, not as the load does: a trend learnt from it overshoots once the fleet
        # catches up (from 1 replica to a load of 9 the trend added 3, and the dead band removed
        # one again). The mean starts afresh from the first load the fleet measures in full.
        state = replace(state, mean_load=None, mean_load_s=None, trend=0.0)
    # At most twice the replicas that report: a backlog grows while the replicas asked for start,
    # and counting it again every decision would scale to the cap for a burst that a few drain.
    up = min(_ceil(ahead), max(current, 2 * len(signals)))
    ratio, slo_reason = _latency_ratio(signals, config.slo)
    cooling = (
        state.last_scale_up_s is not None
        and now - state.last_scale_up_s < config.targets.slo_cooldown_s
    )
    if ratio > 1 and not cooling and _ceil(current * min(ratio, 2.0)) > up:
        up, reason = max(current + 1, _ceil(current * min(ratio, 2.0))), slo_reason
    if up > current:
        return _scale_up(min(up, hi), reason, current, config, state, now, load)
    headroom = config.targets.downscale_headroom
    down = max(lo, _ceil(load / headroom), 1 if lo == 0 and load > 0 else 0)
    if down < current and ratio < headroom:
        waited = _scale_down(down, current, config, state, now)
        cancel = max(down, len(signals))
        # The load's mean over lead_s, not the load: a dip of the 10 s averages is not the end of
        # a burst (on a tuning day a cancel on one cost the replicas of the rise that followed).
        smoothed = load if state.mean_load is None else state.mean_load
        if smoothed < CANCEL_BELOW * state.asked_load and cancel < waited.replicas:
            return _cancel_starting(cancel, state)
        return waited
    return ScaleDecision(
        current, "steady", replace(state, up_since_s=None, down_since_s=None, down_to=0)
    )


def _settled(state: AutoscalingState, last_scale_up_s: float | None) -> AutoscalingState:
    """After a change of the count: no wait under way; the load's mean goes on."""
    return replace(
        state, up_since_s=None, down_since_s=None, down_to=0, last_scale_up_s=last_scale_up_s
    )


def _scale_up(
    target: int,
    reason: str,
    current: int,
    config: AutoscalingPolicyConfig,
    state: AutoscalingState,
    now: float,
    load: float,
) -> ScaleDecision:
    since = state.up_since_s if state.up_since_s is not None else now
    if target <= current:  # capped at max_replicas already
        return ScaleDecision(
            current, "max_replicas", replace(state, up_since_s=None, down_since_s=None, down_to=0)
        )
    if now - since < config.upscale_delay_s:
        return ScaleDecision(
            current, "upscale_delay", replace(state, up_since_s=since, down_since_s=None, down_to=0)
        )
    return ScaleDecision(target, reason, replace(_settled(state, now), asked_load=load))


def _cancel_starting(target: int, state: AutoscalingState) -> ScaleDecision:
    """Replicas still starting serve nothing yet: once the load's mean is half the load that asked
    for them they go at once, without the downscale delay (a burst shorter than a start-up is
    over before its replicas are ready)."""
    return ScaleDecision(target, "low_load", _settled(state, state.last_scale_up_s))


def _scale_down(
    target: int,
    current: int,
    config: AutoscalingPolicyConfig,
    state: AutoscalingState,
    now: float,
) -> ScaleDecision:
    since = state.down_since_s
    down_to = target if since is None else max(target, state.down_to)
    if since is None:
        since = now
    if now - since < config.downscale_delay_s:
        return ScaleDecision(
            current,
            "downscale_delay",
            replace(state, up_since_s=None, down_since_s=since, down_to=down_to),
        )
    return ScaleDecision(
        down_to, "low_load", _settled(state, last_scale_up_s=state.last_scale_up_s)
    )


class LatencyWindow:
    """Latency samples of the last `window_s` seconds, for their p90 (the replica's measured TTFT
    and ITL that the policy compares with the SLO). Bounded: at most `max_samples` kept, the
    oldest dropped first."""

    def __init__(self, window_s: float = 30.0, max_samples: int = 4096) -> None:
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"window_s: must be a finite number > 0, got {window_s!r}")
        if not 1 <= max_samples <= 1 << 24:
            raise ValueError(f"max_samples: must be in [1, 2^24], got {max_samples!r}")
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, now: float, value: float) -> None:
        self._samples.append((now, value))

    def p90(self, now: float) -> float | None:
        """The p90 (nearest rank) of the samples within the window; None without any."""
        cutoff = now - self.window_s
        samples = self._samples
        while samples and samples[0][0] < cutoff:
            samples.popleft()
        if not samples:
            return None
        values = sorted(v for _, v in samples)
        return values[max(0, math.ceil(0.9 * len(values)) - 1)]
