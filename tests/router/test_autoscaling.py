"""The LLM-signal autoscaling policy: bounded settings, monotone in load, hysteresis, bounds, and no
flapping on a noisy constant load."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from router.autoscaling import (
    REASONS,
    AutoscalingPolicyConfig,
    AutoscalingState,
    LatencyWindow,
    ReplicaSignals,
    SignalTargets,
    SloTargets,
    decide,
)

SEQS = 64
POOL = 8192  # a replica's KV-cache tokens


def config(**kw) -> AutoscalingPolicyConfig:
    base = dict(min_replicas=1, max_replicas=32, upscale_delay_s=0.0, downscale_delay_s=60.0)
    return AutoscalingPolicyConfig(**{**base, **kw})


def busy(kv: float, running: int = 0, waiting: int = 0, tokens: int = 0, **kw) -> ReplicaSignals:
    return ReplicaSignals(kv, waiting, tokens, running, SEQS, **kw)


@pytest.mark.parametrize(
    "cls,field,value",
    [
        (AutoscalingPolicyConfig, "min_replicas", -1),
        (AutoscalingPolicyConfig, "max_replicas", 2**64),
        (AutoscalingPolicyConfig, "max_replicas", 0),
        (AutoscalingPolicyConfig, "upscale_delay_s", float("nan")),
        (AutoscalingPolicyConfig, "downscale_delay_s", -1),
        (SloTargets, "ttft_p90_s", float("nan")),
        (SloTargets, "itl_p90_s", 0),
        (SloTargets, "itl_p90_s", 2**64),
        (SignalTargets, "kv_cache_usage", 1.5),
        (SignalTargets, "queued_prompt_tokens", 2**64),
        (SignalTargets, "downscale_headroom", 1.0),
        (SignalTargets, "slo_cooldown_s", float("inf")),
        (SignalTargets, "lead_s", 2**64),
        (SignalTargets, "lead_s", -1),
        (SignalTargets, "lead_s", float("nan")),
        (SignalTargets, "lead_s", 1e300),
        (ReplicaSignals, "kv_cache_usage", float("nan")),
        (ReplicaSignals, "num_waiting", -1),
        (ReplicaSignals, "num_waiting_prompt_tokens", 2**64),
        (ReplicaSignals, "max_num_seqs", 0),
        (ReplicaSignals, "ttft_p90_s", float("nan")),
    ],
)
def test_bad_values_are_refused_naming_the_field(cls, field, value):
    with pytest.raises(ValueError, match=field):
        cls(**{field: value})


def test_min_above_max_and_sections_from_mappings():
    with pytest.raises(ValueError, match="min_replicas"):
        AutoscalingPolicyConfig(min_replicas=3, max_replicas=2)
    cfg = AutoscalingPolicyConfig(slo={"ttft_p90_s": 1}, targets={"kv_cache_usage": 0.5})  # type: ignore[arg-type]
    assert cfg.slo.ttft_p90_s == 1.0 and cfg.targets.kv_cache_usage == 0.5
    with pytest.raises(ValueError, match="slo.ttft_p90_s"):
        AutoscalingPolicyConfig(slo={"ttft_p90_s": -1})  # type: ignore[arg-type]


def test_each_signal_scales_up_with_its_reason():
    cfg = config()
    state = AutoscalingState()
    cases = [
        ([busy(0.9), busy(0.9)], "kv_cache"),
        ([busy(0.1, running=SEQS, waiting=40)] * 2, "batch"),
        ([busy(0.1, waiting=2, tokens=40_000)] * 2, "queued_tokens"),
        ([busy(0.7, waiting=2, tokens=2000, kv_cache_tokens=8192)] * 2, "kv_cache"),
        ([busy(0.1, waiting=1, ttft_p90_s=3.0)] * 2, "ttft_slo"),
        ([busy(0.1, itl_p90_s=0.5)] * 2, "itl_slo"),
    ]
    for signals, reason in cases:
        decision = decide(signals, 2, cfg, state, now=0.0)
        assert decision.replicas > 2 and decision.reason == reason, (reason, decision)
        assert decision.reason in REASONS


def test_latency_over_the_slo_waits_out_the_cooldown_after_a_scale_up():
    cfg = config(targets={"slo_cooldown_s": 30})  # type: ignore[arg-type]
    slow = [busy(0.1, waiting=1, ttft_p90_s=3.0)] * 2
    first = decide(slow, 2, cfg, AutoscalingState(), now=100.0)
    assert first.replicas == 3
    assert decide(slow, 3, cfg, first.state, now=110.0).replicas == 3  # cooling down
    assert decide(slow, 3, cfg, first.state, now=131.0).replicas > 3


def test_scale_down_waits_out_the_delay_and_keeps_the_most_the_wait_asked_for():
    cfg = config(downscale_delay_s=60, targets=SignalTargets(lead_s=0))  # the delay alone
    state = AutoscalingState()
    d = decide([busy(0.05)] * 8, 8, cfg, state, now=0.0)
    assert (d.replicas, d.reason) == (8, "downscale_delay")
    d = decide([busy(0.3)] * 8, 8, cfg, d.state, now=30.0)  # asks for ceil(2.4 / 0.75 / 0.7) = 5
    assert d.replicas == 8
    d = decide([busy(0.05)] * 8, 8, cfg, d.state, now=61.0)
    assert (d.replicas, d.reason) == (5, "low_load")
    # A break in the wait (load back in the dead band) starts it again.
    d = decide([busy(0.05)] * 5, 5, cfg, AutoscalingState(), now=100.0)
    d = decide([busy(0.6)] * 5, 5, cfg, d.state, now=130.0)
    assert d.reason == "steady"
    d = decide([busy(0.05)] * 5, 5, cfg, d.state, now=170.0)
    assert (d.replicas, d.reason) == (5, "downscale_delay")


def _ramp(lead_s: float) -> list[tuple[float, float, int]]:
    """A load rising by one replica's worth a minute from 2 to 6, a decision every 5 s: (time,
    the load in replicas, the count the policy keeps)."""
    cfg = config(targets=SignalTargets(lead_s=lead_s))
    n, state, out = 3, AutoscalingState(), []
    for tick in range(49):
        now = tick * 5.0
        load = 2 + now / 60
        usage = load * cfg.targets.kv_cache_usage / n
        d = decide([busy(min(1.0, usage))] * n, n, cfg, state, now)
        n, state = d.replicas, d.state
        out.append((now, load, n))
    return out


def test_a_rising_load_is_met_lead_s_ahead_and_without_a_lead_only_once_it_arrives():
    """With lead_s 30 the count reaches each level about 30 s before the load does (a new replica
    takes that long to start); with lead_s 0 only when the load is there."""
    ahead, late = _ramp(30.0), _ramp(0.0)
    # Once the trend is known (after a minute), the count covers the load 30 s later.
    assert all(n >= ahead[i + 6][1] for i, (t, _, n) in enumerate(ahead[:-6]) if t >= 60)
    assert any(n < late[i + 6][1] for i, (t, _, n) in enumerate(late[:-6]) if t >= 60)
    # Never more than one replica beyond that.
    assert all(n <= ahead[i + 6][1] + 1 for i, (t, _, n) in enumerate(ahead[:-6]))


def test_once_a_burst_has_ended_its_trend_asks_for_no_replica():
    """Four replicas' load for 25 s, lead_s 30, a decision every 0.25 s, a 2 s downscale delay:
    the fleet grows for the burst and, once it has ended and the fleet is back at one, stays
    there. (The trend learnt on the rise still points up for about lead_s; a load below its own
    mean is not rising.)"""
    cfg = config(downscale_delay_s=2.0, targets=SignalTargets(lead_s=30.0, batch_fraction=0.75))
    n, state, counts = 1, AutoscalingState(), []
    for tick in range(320):
        now = tick * 0.25
        running = int(4.0 * SEQS * 0.75) if 10 <= now < 35 else 0
        d = decide([busy(0.05, running=running // n)] * n, n, cfg, state, now)
        n, state = d.replicas, d.state
        counts.append(n)
    assert max(counts) >= 4
    back = counts.index(1, 140)
    assert counts[back:] == [1] * (len(counts) - back)


def test_a_backlog_adds_at_most_twice_the_reporting_replicas_while_others_start():
    """Five replicas report a backlog worth 20 replicas of queued prompt tokens while two more are
    starting: the count goes to 10, not 20, and holds there until the ones asked for report."""
    cfg = config(max_replicas=64, targets=SignalTargets(lead_s=0))
    backlog = [busy(1.0, waiting=50, tokens=8 * POOL, kv_cache_tokens=POOL)] * 5
    d = decide(backlog, 7, cfg, AutoscalingState(), now=0.0)
    assert (d.replicas, d.reason) == (10, "queued_tokens")
    d = decide(backlog, 10, cfg, d.state, now=5.0)
    assert (d.replicas, d.reason) == (10, "steady")
    d = decide(backlog * 2, 10, cfg, d.state, now=35.0)  # the new ones report: it may go on
    assert d.replicas == 20


def test_a_queue_counts_at_most_as_much_kv_again_as_its_replica_holds():
    """Queued prompts do not move to a new replica: five full replicas with 3 pools of prompts
    queued each, beside five that just started, ask for (5 x (1 + 1) + 5 x 0.05) / 0.75 = 13.7
    replicas of KV, not the 26.7 that counting every queued prompt as KV would ask for."""
    cfg = config(max_replicas=64, targets=SignalTargets(lead_s=0))
    full = busy(1.0, waiting=6, tokens=3 * POOL, kv_cache_tokens=POOL)
    fresh = busy(0.05, kv_cache_tokens=POOL)
    d = decide([full] * 5 + [fresh] * 5, 10, cfg, AutoscalingState(), now=0.0)
    assert (d.replicas, d.reason) == (14, "kv_cache")


def test_ttft_over_the_slo_counts_only_while_requests_wait():
    """The TTFT window remembers a drained backlog: with nothing waiting it neither adds replicas
    nor holds off the scale-down; with a queue it adds them."""
    cfg = config(downscale_delay_s=0, targets=SignalTargets(lead_s=0, slo_cooldown_s=0))
    stale = [busy(0.1, ttft_p90_s=9.0)] * 8
    assert (d := decide(stale, 8, cfg, AutoscalingState(), now=0.0)).replicas < 8
    assert d.reason == "low_load"
    queued = [busy(0.1, waiting=1, ttft_p90_s=9.0)] * 8
    assert (d := decide(queued, 8, cfg, AutoscalingState(), now=0.0)).replicas == 16
    assert d.reason == "ttft_slo"
    # ITL has no queue to wait for: over its SLO it scales up whatever waits.
    assert decide([busy(0.1, itl_p90_s=0.5)] * 8, 8, cfg, AutoscalingState(), 0.0).replicas > 8


def test_replicas_still_starting_go_at_once_when_the_load_that_asked_for_them_halves():
    """A burst shorter than a start-up: 5 replicas report a load of 13.3 and the count goes to 10;
    while the 5 new ones start the burst ends (load 2.7): they are cancelled at once, down to the 5
    that report (not waiting out the 120 s delay), and those wait out the delay as usual. A load
    over half the one that asked keeps the starting ones."""
    cfg = config(max_replicas=64, downscale_delay_s=120, targets=SignalTargets(lead_s=0))
    burst = [busy(1.0, waiting=4, tokens=POOL, kv_cache_tokens=POOL)] * 5  # 2 x 5 / 0.75 = 13.3
    d = decide(burst, 5, cfg, AutoscalingState(), now=0.0)
    assert (d.replicas, d.reason) == (10, "kv_cache")  # twice the 5 that report
    after = [busy(0.4)] * 5  # 2.7 replicas of load, under 0.5 x 13.3
    over = decide(after, 10, cfg, d.state, now=20.0)
    assert (over.replicas, over.reason) == (5, "low_load")
    # The 5 that report wait out the delay before going down to ceil(2.7 / 0.7) = 4.
    d2 = decide(after, 5, cfg, over.state, now=25.0)
    assert (d2.replicas, d2.reason) == (5, "downscale_delay")
    assert decide(after, 5, cfg, d2.state, now=150.0).replicas == 4
    # TTFT 1.5x its SLO asks 4 -> 6 at a load of 2.13 (4 x 0.4 / 0.75); the queue drains and the
    # load is 1.87 (a dip a noisy steady load shows), over 0.5 x 2.13: the two starting ones stay;
    # at 0.8 they go.
    slow = decide([busy(0.4, waiting=1, ttft_p90_s=3.0)] * 4, 4, cfg, AutoscalingState(), 0.0)
    assert (slow.replicas, slow.reason) == (6, "ttft_slo")
    held = decide([busy(0.35)] * 4, 6, cfg, slow.state, now=5.0)
    assert (held.replicas, held.reason) == (6, "downscale_delay")
    assert decide([busy(0.15)] * 4, 6, cfg, slow.state, now=5.0).replicas == 4


def test_a_dip_of_a_steady_load_cancels_nothing_where_the_end_of_a_burst_does():
    """With lead_s 30 the cancel reads the load's mean: a steady load of 3 rises to 4, asks for
    more replicas and dips to 1.8 for one decision (the 10 s averages do that with long
    documents): the starting replicas stay. After 30 s of a backlog worth 13.3 replicas the load
    falls to 2.7 and stays: once its mean is under half of 13.3, a few decisions later, what is
    still starting goes."""
    cfg = config(max_replicas=64, targets=SignalTargets(lead_s=30))
    state = AutoscalingState()
    for tick in range(12):  # a minute at 3 replicas of load: the mean settles there
        d = decide([busy(0.75)] * 3, 3, cfg, state, now=tick * 5.0)
        state = d.state
    d = decide([busy(1.0)] * 3, 3, cfg, state, now=60.0)  # a rise to 4 asks for more
    assert d.replicas > 3
    dip = decide([busy(0.45)] * 3, d.replicas, cfg, d.state, now=65.0)  # 1.8 for one decision
    assert (dip.replicas, dip.reason) == (d.replicas, "downscale_delay")
    burst = [busy(1.0, waiting=4, tokens=POOL, kv_cache_tokens=POOL)] * 5
    n = 5
    for t in range(60, 90, 5):  # 30 s of burst on the 5 that report: the mean follows it
        d = decide(burst, n, cfg, state, now=float(t))
        n, state = d.replicas, d.state
    assert n == 10
    ends = []
    for t in range(90, 120, 5):  # the burst is over: 2.7 replicas of load
        d = decide([busy(0.4)] * 5, n, cfg, state, now=float(t))
        ends.append(d.replicas)
        n, state = d.replicas, d.state
    # Not at the first decision after the burst, and well before a 30 s start-up is over.
    assert ends[0] == 10 and 5 in ends[1:4], ends


def test_upscale_delay_and_bounds():
    cfg = config(upscale_delay_s=10, max_replicas=4)
    hot = [busy(1.0)] * 2
    d = decide(hot, 2, cfg, AutoscalingState(), now=0.0)
    assert (d.replicas, d.reason) == (2, "upscale_delay")
    d = decide(hot, 2, cfg, d.state, now=10.0)
    assert (d.replicas, d.reason) == (3, "kv_cache")
    assert decide([busy(1.0)] * 4, 4, cfg, AutoscalingState(), 0.0).reason == "max_replicas"
    assert decide([], 0, cfg, AutoscalingState(), 0.0).replicas == 1
    assert decide([busy(0.1)] * 6, 6, cfg, AutoscalingState(), 0.0).replicas == 4
    assert decide([], 3, cfg, AutoscalingState(), 0.0).reason == "no_signals"


def test_min_replicas_zero_scales_to_zero_only_when_idle():
    cfg = config(min_replicas=0, downscale_delay_s=0)
    assert decide([busy(0.0)], 1, cfg, AutoscalingState(), 0.0).replicas == 0
    assert decide([busy(0.0, waiting=1)], 1, cfg, AutoscalingState(), 0.0).replicas == 1


signal = st.builds(
    ReplicaSignals,
    st.floats(0, 1),
    st.integers(0, 200),
    st.integers(0, 100_000),
    st.integers(0, SEQS),
    st.just(SEQS),
    st.none() | st.floats(0, 10),
    st.none() | st.floats(0, 1),
    st.sampled_from([0, 4096]),
)


@given(
    st.lists(signal, min_size=1, max_size=8),
    st.floats(1, 3),
    st.integers(0, 2),
    st.integers(1, 40),
    st.sampled_from(
        [
            AutoscalingState(),
            AutoscalingState(down_since_s=0.0, down_to=2),
            AutoscalingState(down_since_s=150.0, down_to=3, asked_load=12.0),
        ]
    ),
    st.floats(0, 200),
)
def test_more_load_never_asks_for_fewer_replicas(signals, factor, extra, current, state, now):
    """Raising any signal of any replica never lowers the decision (same state, time, count)."""
    cfg = config(max_replicas=64)
    heavier = [
        ReplicaSignals(
            min(1.0, s.kv_cache_usage * factor),
            s.num_waiting + extra,
            int(s.num_waiting_prompt_tokens * factor),
            s.num_running,
            SEQS,
            None if s.ttft_p90_s is None else s.ttft_p90_s * factor,
            None if s.itl_p90_s is None else s.itl_p90_s * factor,
            s.kv_cache_tokens,
        )
        for s in signals
    ]
    light = decide(signals, current, cfg, state, now)
    heavy = decide(heavier, current, cfg, state, now)
    assert heavy.replicas >= light.replicas
    for d in (light, heavy):
        assert cfg.min_replicas <= d.replicas <= cfg.max_replicas


@given(st.floats(0.5, 20), st.floats(0, 0.12), st.integers(1, 24), st.integers(0, 2**32))
# From 1 replica the saturated fleet's load rose as it grew; a trend learnt from it went to 13
# for a load of 9, and the dead band took one back.
@example(mean_replicas=9.0, noise=0.109375, start=1, seed=3)
def test_noisy_constant_load_never_flaps(mean_replicas, noise, start, seed):
    """A constant load swaying by up to +-12% around its mean (inside the 0.7 dead band) moves the
    count in one direction at most, then holds: never up then down, or down then up."""
    cfg = config(max_replicas=64, downscale_delay_s=20)
    rng = random.Random(seed)
    n, state, moves = start, AutoscalingState(), []
    for tick in range(300):
        total = mean_replicas * cfg.targets.kv_cache_usage * (1 + rng.uniform(-noise, noise))
        # The fleet's KV spread over its replicas; what does not fit waits as queued prompt tokens.
        used = min(1.0, total / n)
        queued = round((total / n - used) * POOL)
        signals = [busy(used, waiting=1 if queued else 0, tokens=queued, kv_cache_tokens=POOL)] * n
        d = decide(signals, n, cfg, state, now=tick * 5.0)
        if d.replicas != n:
            moves.append(d.replicas > n)
        n, state = d.replicas, d.state
    assert len(set(moves)) <= 1, moves


def test_latency_window_p90_over_its_window():
    window = LatencyWindow(window_s=10)
    assert window.p90(0.0) is None
    for i in range(10):
        window.add(float(i), float(i + 1))  # values 1..10 at t 0..9
    assert window.p90(9.0) == 9.0
    assert window.p90(15.0) == 10.0  # only the samples at t >= 5 remain: 6..10
    assert window.p90(100.0) is None
    with pytest.raises(ValueError, match="window_s"):
        LatencyWindow(window_s=math.nan)
