"""`python -m sim plan --autoscale`: a day replayed with each policy in the loop, each tuned to the
SLO, the replica-hours and SLO attainment reported per seed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from router.autoscaling import AutoscalingPolicyConfig
from sim.__main__ import command_line, main
from sim.autoscale import LLMSignalsPolicy, OngoingRequestsPolicy
from sim.autoscale_plan import DayRow, config_of, saving, tuned

# A short, quick day: the control loop's constants shrunk with it, so both policies scale.
DAY = [
    "plan", "--autoscale", "llm", "ongoing", "--profile", "h100", "--day-s", "60", "--rate", "5",
    "--blocks", "256", "--max-num-seqs", "8", "--tenants", "64", "--slo-itl", "0.1",
    "--start-delay", "3", "--decision-period", "1", "--look-back", "2", "--downscale-delay", "5",
    "--initial-replicas", "1", "--max-replicas", "16", "--ongoing-targets", "4",
    "--kv-targets", "0.75", "--target", "0.5",
]  # fmt: skip


def test_a_day_reports_both_policies_tuned_per_seed(capsys):
    main([*DAY, "--seeds", "0", "1"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| 0 |", "| 1 |"))]
    # Two settings per seed, then one summary line per seed.
    assert len(rows) == 6
    summary = rows[-2:]
    assert all("target_ongoing_requests 4" in r and "kv/batch target 0.75" in r for r in summary)
    assert all(r.rstrip(" |").endswith("%") for r in summary)  # the saving, both tuned


def _row(policy: str, hours: float, attainment: float) -> DayRow:
    return DayRow(policy, 1.0, 0.7, 0, 10, hours, attainment, 0.1, 0.01, 2, 1, {}, 1.0)


def test_tuned_is_the_cheapest_setting_that_meets_the_target():
    rows = [
        _row("ongoing", 100, 0.995),
        _row("ongoing", 80, 0.98),  # cheaper, misses the target
        _row("ongoing", 90, 0.99),
        _row("llm", 60, 0.999),
        _row("llm", 70, 0.999),
    ]
    best = tuned(rows, "ongoing", 0.99)
    assert best is not None and best.replica_hours_day == 90
    assert saving(rows, 0.99) == pytest.approx(1 - 60 / 90)
    assert saving(rows, 0.9999) is None  # neither reaches it


@pytest.mark.parametrize(
    ("flag", "value", "field"),
    [
        ("--day-s", "-1", "day_s"),
        ("--day-s", "nan", "day_s"),
        ("--peak-to-trough", "0.5", "peak_to_trough"),
        ("--target", "1.5", "target"),
        ("--jobs", "0", "jobs"),
        ("--kv-targets", "2", "kv_cache_usage"),
        ("--ongoing-targets", "-1", "target_ongoing_requests"),
        ("--start-delay", "1e300", "start_delay_s"),
        ("--rate", "1e100", "peak_rate"),
    ],
)
def test_bad_day_settings_are_refused_naming_the_field(capsys, flag, value, field):
    with pytest.raises(SystemExit) as exc:
        main([*DAY, flag, value])
    assert exc.value.code == 2 and field in capsys.readouterr().err


def test_without_autoscale_plan_sizes_a_fixed_fleet_as_before():
    assert command_line().parse_args(["plan"]).autoscale is None


def test_the_day_replays_with_the_production_defaults_of_both_policies():
    """The simulator declares no autoscaling default of its own: what deploy.yaml gets when it
    leaves a setting out is what the plan replays, for the llm policy and for Serve's."""
    production = AutoscalingPolicyConfig()
    a = command_line().parse_args(["plan", "--autoscale", "llm", "ongoing"])
    assert (a.upscale_delay, a.downscale_delay) == (
        production.upscale_delay_s,
        production.downscale_delay_s,
    )
    assert a.kv_targets == [production.targets.kv_cache_usage]
    assert a.headrooms == [production.targets.downscale_headroom]
    cfg = config_of(a)
    llm = cfg.policy("llm", a.kv_targets[0], a.headrooms[0])
    assert isinstance(llm, LLMSignalsPolicy)
    assert replace(llm.config, max_replicas=production.max_replicas) == replace(
        production, slo=cfg.slo
    )
    ongoing = OngoingRequestsPolicy(target_ongoing_requests=3)
    assert (ongoing.upscale_delay_s, ongoing.downscale_delay_s) == (
        production.upscale_delay_s,
        production.downscale_delay_s,
    )
