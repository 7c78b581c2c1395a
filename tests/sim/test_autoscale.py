"""The simulator with an autoscaling policy in the loop: the day curve, replicas started after their
delay and drained on the way down, every request finished, replica-hours paid for."""

from __future__ import annotations

import pytest

from router.autoscaling import AutoscalingPolicyConfig
from scheduler import SchedulerConfig
from sim.autoscale import (
    AutoscaleConfig,
    AutoscaleSim,
    DayWorkloadConfig,
    LLMSignalsPolicy,
    OngoingRequestsPolicy,
    day_workload,
)
from sim.cost import load_profile
from sim.fleet_config import SimConfig

# A day compressed to 90 s, so that the test runs in seconds.
DAY = DayWorkloadConfig(day_s=90, peak_rate=10, long_share_peak=0.1, long_share_trough=0.5)


def test_the_day_curve_peaks_mid_day_at_its_ratio():
    assert DAY.rate(0) == pytest.approx(1.0) and DAY.rate(45) == pytest.approx(10)
    workload = day_workload(DAY)
    assert workload == day_workload(DAY)  # seeded
    quarters = [
        sum(1 for r in workload if q * 22.5 <= r.arrival_s < (q + 1) * 22.5) for q in range(4)
    ]
    assert quarters[1] > 2 * quarters[0] and quarters[2] > 2 * quarters[3]
    night = [r for r in workload if r.arrival_s < 15 or r.arrival_s > 75]
    day = [r for r in workload if 30 < r.arrival_s < 60]
    assert sum(r.tenant == "batch" for r in night) / len(night) > 2 * sum(
        r.tenant == "batch" for r in day
    ) / len(day)


@pytest.mark.parametrize(
    "field,value",
    [("day_s", 0), ("peak_rate", float("nan")), ("peak_to_trough", 0.5), ("long_share_peak", 2)],
)
def test_bad_day_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        DayWorkloadConfig(**{field: value})
    with pytest.raises(ValueError, match="start_delay_s"):
        AutoscaleConfig(start_delay_s=-1)


@pytest.mark.parametrize(
    "policy",
    [
        LLMSignalsPolicy(
            AutoscalingPolicyConfig(min_replicas=1, max_replicas=16, downscale_delay_s=5)
        ),
        OngoingRequestsPolicy(target_ongoing_requests=4, max_replicas=16, downscale_delay_s=5),
    ],
    ids=["llm", "ongoing"],
)
def test_a_day_scales_up_and_back_down_finishing_every_request(policy):
    workload = day_workload(DAY)
    sim = AutoscaleSim(
        SimConfig(
            scheduler=SchedulerConfig(num_gpu_blocks=256, max_model_len=4096, max_num_seqs=8)
        ),
        load_profile("h100"),
        policy,
        AutoscaleConfig(decision_period_s=1, look_back_s=2, start_delay_s=3, initial_replicas=1),
    )
    out = sim.run_day(workload)
    assert all(r.finish_s is not None for r in out.result.records)  # none lost to a drain
    billed = [b for _, _, b in out.timeline]
    assert max(billed) > 1 and billed[-1] < max(billed)  # up for the peak, down after
    # Routed replicas lag the billed ones by the start delay.
    assert all(routed <= b for _, routed, b in out.timeline)
    end = out.result.end_s
    assert 1 * end / 3600 < out.replica_hours < max(billed) * end / 3600
    assert 0 < out.slo_attainment(1.0, 0.1) <= 1
