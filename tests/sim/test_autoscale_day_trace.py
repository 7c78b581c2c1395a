"""bench/autoscale_day_trace.py: one autoscaled day replayed with its decisions in view gives the
same day as `sim plan` does, holds a standing floor where asked, and refuses bad windows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sim import autoscale_plan as plan
from sim.autoscale_protocol import shaped_day

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from autoscale_day_trace import _args, misses_by_arrival, traced_policy

# A short day with a burst (the loop's constants shrunk with it, as in test_autoscale_plan.py).
DAY = [
    "--profile", "h100", "--day-s", "40", "--rate", "5", "--blocks", "256",
    "--max-num-seqs", "8", "--tenants", "64", "--slo-itl", "0.1", "--start-delay", "3",
    "--decision-period", "1", "--look-back", "2", "--downscale-delay", "5",
    "--initial-replicas", "1", "--max-replicas", "16", "--shaped-seeds", "3",
    "--shaped-burst-at", "0.4", "--shaped-burst-len", "0.2", "--shaped-burst-factor", "2",
]  # fmt: skip


def _day(*own: str):
    a, day = _args([*own, "--", *DAY])
    cfg = shaped_day(plan.config_of(day), day, 0)
    return a, cfg


@pytest.fixture(scope="module")
def traced_day():
    """The day with a floor of 6 replicas from 12 to 28 s and the decisions from 12 to 20 s."""
    a, cfg = _day("--log", "12", "20", "--floor", "12", "28", "6")
    traced = traced_policy(a, cfg)
    out, _ = plan.simulate_day(cfg, traced)
    return cfg, traced, out


def test_without_a_floor_the_trace_replays_the_day_sim_plan_replays():
    a, cfg = _day()
    out, requests = plan.simulate_day(cfg, traced_policy(a, cfg))
    row = plan.replay_day(cfg, "llm", 0.75, 0.7)
    assert requests == row.requests > 0
    assert out.replica_hours * plan.REAL_DAY_S / cfg.day.day_s == row.replica_hours_day
    assert out.slo_attainment(cfg.slo.ttft_p90_s, cfg.slo.itl_p90_s) == row.attainment
    assert sum(out.decisions.values()) == row.changes


def test_the_floor_holds_the_count_in_its_window_and_the_log_lists_its_decisions(traced_day):
    _, traced, out = traced_day
    # The first decision at or after 12 s sets the count; until 28 s it stays at 6 or more.
    held = [billed for t, _, billed in out.timeline if 13 <= t <= 28]
    assert held and min(held) >= 6
    assert max(billed for t, _, billed in out.timeline if t < 12) < 6  # the floor did it
    assert len(traced.lines) == 9  # one decision a second, 12 to 20 s
    assert all(" -> " in line and "load" in line for line in traced.lines)


def test_misses_by_arrival_count_every_finished_request_that_missed(traced_day):
    cfg, _, out = traced_day
    done = [r for r in out.result.records if r.finish_s is not None]
    met = out.slo_attainment(cfg.slo.ttft_p90_s, cfg.slo.itl_p90_s)
    misses = misses_by_arrival(out, cfg.slo.ttft_p90_s, cfg.slo.itl_p90_s)
    assert sum(misses.values()) == round(len(done) * (1 - met))
    assert all(k % 30 == 0 for k in misses)


@pytest.mark.parametrize(
    ("own", "field"),
    [
        (["--floor", "12", "28", str(2.0**64)], "floor"),
        (["--floor", "12", "28", "-1"], "floor"),
        (["--floor", "12", "28", "nan"], "floor"),
        (["--floor", "nan", "28", "2"], "floor"),
        (["--log", "30", "20"], "log"),
        (["--log", "0", "1e300"], "log"),
        (["--log", "-1", "10"], "log"),
        (["--policy", "ongoing"], "knob"),
    ],
)
def test_bad_windows_and_floors_are_refused_naming_the_flag(own, field):
    a, cfg = _day(*own)
    with pytest.raises(ValueError, match=field):
        traced_policy(a, cfg)
