"""Tuning days apart from evaluation days: each policy's setting is picked on the tuning days only
(the cheapest that meets the SLO target on every one of them), and only the evaluation days, among
them a day of another shape, are reported."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from sim.__main__ import command_line, main
from sim.autoscale import DayWorkloadConfig, day_workload
from sim.autoscale_plan import DayRow, config_of
from sim.autoscale_protocol import evaluation_days, pick, verdict
from tests.sim.test_autoscale_plan import DAY


def _row(policy: str, knob: float, seed: int, hours: float, attainment: float, changes: int = 1):
    return DayRow(policy, knob, 0.7, seed, 10, hours, attainment, 0.1, 0.01, 2, changes, {}, 1.0)


def test_the_pick_is_the_cheapest_setting_that_meets_the_target_on_every_tuning_day():
    rows = [
        # target 3: cheapest on average, misses on day 1.
        _row("ongoing", 3, 0, 80, 0.995),
        _row("ongoing", 3, 1, 82, 0.985),
        _row("ongoing", 2.5, 0, 95, 0.999),
        _row("ongoing", 2.5, 1, 97, 0.992),
        _row("ongoing", 2, 0, 120, 0.999),
        _row("ongoing", 2, 1, 121, 0.999),
    ]
    best = pick(rows, "ongoing", 0.99)
    assert best is not None
    assert best.knobs == ("ongoing", 2.5, 0.7)
    assert best.meets and best.hours == pytest.approx(96) and best.worst == pytest.approx(0.992)
    assert pick(rows, "llm", 0.99) is None


def test_when_no_setting_meets_the_target_the_closest_worst_day_is_picked_and_marked():
    rows = [
        _row("llm", 0.9, 0, 80, 0.98),
        _row("llm", 0.9, 1, 80, 0.95),
        _row("llm", 0.8, 0, 90, 0.97),
        _row("llm", 0.8, 1, 90, 0.96),
    ]
    best = pick(rows, "llm", 0.99)
    assert best is not None and not best.meets
    assert best.knobs[1] == 0.8 and best.worst == pytest.approx(0.96)


def test_the_verdict_sums_replica_hours_over_the_evaluation_days_and_takes_the_worst_day():
    rows = [
        _row("ongoing", 3, 7, 100, 0.995, changes=10),
        _row("llm", 0.75, 7, 70, 0.991, changes=25),
        _row("ongoing", 3, 8, 120, 0.999, changes=4),
        _row("llm", 0.75, 8, 90, 0.989, changes=4),
    ]
    v = verdict(rows)
    assert v is not None
    assert v.saving == pytest.approx(1 - 160 / 220)
    assert v.llm_worst == pytest.approx(0.989) and v.ongoing_worst == pytest.approx(0.995)
    assert v.changes_ratio == pytest.approx(2.5)
    assert verdict(rows[:3]) is None  # the llm policy never replayed day 8


def test_a_burst_raises_the_rate_inside_its_window_only_and_no_burst_changes_nothing():
    day = DayWorkloadConfig(day_s=100, peak_rate=10, peak_to_trough=1)
    burst = replace(day, burst_at=0.2, burst_len=0.1, burst_factor=3)
    assert [burst.rate(t) for t in (19.9, 20, 29.9, 30)] == [10, 30, 30, 10]
    in_window = sum(1 for r in day_workload(burst) if 20 <= r.arrival_s < 30)
    assert in_window > 2 * sum(1 for r in day_workload(day) if 20 <= r.arrival_s < 30)
    # A burst of length 0 (the default) leaves the day's arrivals as they were.
    assert day_workload(replace(day, burst_at=0.5, burst_factor=4)) == day_workload(day)


@pytest.mark.parametrize("value", [2.0**64, -1.0, math.nan, 1e300])
@pytest.mark.parametrize("field", ["burst_at", "burst_len", "burst_factor"])
def test_bad_burst_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        DayWorkloadConfig(**{field: value})


PROTOCOL = [*DAY, "--ongoing-targets", "4", "6", "--tune-seeds", "0"]


def test_the_protocol_reports_evaluation_days_only_with_the_settings_tuning_picked(capsys):
    main([*PROTOCOL, "--eval-seeds", "1", "--shaped-seeds", "2"])
    out = capsys.readouterr().out
    tuning, evaluation = out.split("## Evaluation days")
    picked = [line for line in tuning.splitlines() if "**picked**" in line]
    assert len(picked) == 2  # one setting per policy
    days = [line for line in evaluation.splitlines() if line.startswith(("| 1 |", "| shaped 2 |"))]
    # Each policy's pick on each evaluation day, then one comparison line per day.
    assert len(days) == 6
    assert not any(line.startswith("| 0 |") for line in evaluation.splitlines())
    assert "evaluation days: llm worst-day attainment" in evaluation
    ongoing_pick = next(line for line in picked if line.startswith("| ongoing"))
    knob = ongoing_pick.split("|")[2].strip()
    assert all(knob in line for line in days[:4] if "| ongoing |" in line)


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--eval-seeds", "0"], "eval_seeds"),  # a tuning day judged on
        (["--shaped-seeds", "1", "--shaped-burst-factor", "nan"], "burst_factor"),
        (["--shaped-seeds", "1", "--shaped-burst-len", "-1"], "burst_len"),
        (["--shaped-seeds", "1", "--shaped-burst-at", str(2.0**64)], "burst_at"),
        (["--shaped-seeds", "1", "--shaped-peak-to-trough", "1e300"], "peak_to_trough"),
    ],
)
def test_bad_protocol_settings_are_refused_before_any_day_is_replayed(capsys, flags, field):
    with pytest.raises(SystemExit) as exc:
        main([*PROTOCOL, *flags])
    err = capsys.readouterr()
    assert exc.value.code == 2 and field in err.err and "done:" not in err.out


def _shaped(*flags: str) -> list[DayWorkloadConfig]:
    a = command_line().parse_args([*PROTOCOL, *flags])
    return [d.day for d in evaluation_days(config_of(a), a)]


def test_each_shaped_flag_gives_one_value_for_every_shaped_seed_or_one_per_seed():
    """Two shapes judged in one run: a value per shaped seed, or one shared by all of them."""
    one, two = _shaped(
        "--shaped-seeds", "15", "16", "--shaped-burst-at", "0.3", "0.7",
        "--shaped-long-share-peak", "0.5",
    )  # fmt: skip
    assert (one.seed, one.burst_at, one.long_share_peak) == (15, 0.3, 0.5)
    assert (two.seed, two.burst_at, two.long_share_peak) == (16, 0.7, 0.5)
    assert one.burst_len == two.burst_len == 0.05  # the default, for both
    with pytest.raises(ValueError, match="burst_len: one value, or one per shaped seed"):
        _shaped("--shaped-seeds", "15", "16", "--shaped-burst-len", "0.1", "0.2", "0.3")
