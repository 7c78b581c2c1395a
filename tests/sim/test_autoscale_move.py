"""Queued requests moved to a replica as it starts (`AutoscaleConfig.move_queued`): a request that
waits on a full replica and never ran is handed back and routed again by the production router,
so the replica that a scale-up brings serves the backlog, not only the arrivals after it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from router.autoscaling import AutoscalingState, ReplicaSignals, ScaleDecision
from scheduler import SchedulerConfig
from sim.autoscale import AutoscaleConfig, AutoscaleResult, AutoscaleSim
from sim.cost import load_profile
from sim.fleet_config import SimConfig
from sim.workload import SimRequest

# 30 requests at once on one replica whose 120 blocks hold two of them: a backlog.
BURST = [SimRequest(f"r{i}", 0.01 * i, 600, 256) for i in range(30)]


@dataclass(slots=True)
class TwoReplicas:
    """A scale-up to two replicas at the first decision, and none after: the test's fixed plan,
    so that only the move differs between the two runs."""

    def decide(
        self, signals: list[ReplicaSignals], current: int, state: AutoscalingState, now: float
    ) -> ScaleDecision:
        return ScaleDecision(2, "steady" if current == 2 else "kv_cache", AutoscalingState())


def _run(move: bool) -> AutoscaleResult:
    sim = AutoscaleSim(
        SimConfig(scheduler=SchedulerConfig(num_gpu_blocks=120, max_model_len=1024)),
        load_profile("h100"),
        TwoReplicas(),
        AutoscaleConfig(decision_period_s=1, look_back_s=1, start_delay_s=2, move_queued=move),
    )
    return sim.run_day(list(BURST))


@pytest.fixture(scope="module")
def runs() -> dict[bool, AutoscaleResult]:
    return {move: _run(move) for move in (False, True)}


def _served_by(out: AutoscaleResult) -> dict[str, int]:
    by: dict[str, int] = {}
    for r in out.result.records:
        by[r.replica] = by.get(r.replica, 0) + 1
    return by


def test_without_the_move_the_new_replica_gets_nothing_of_the_backlog(runs):
    out = runs[False]
    assert out.moved == 0
    assert _served_by(out) == {"replica-0": 30}  # every request arrived before it started


def test_the_new_replica_takes_the_queue_and_every_request_still_finishes_once(runs):
    out = runs[True]
    assert all(r.finish_s is not None for r in out.result.records)
    served = _served_by(out)
    # What the router sent to the new replica when it started (the load it then held balances
    # the rest), and nothing else: every arrival came before it was up.
    assert out.moved == served["replica-1"] >= 5
    assert served["replica-0"] + served["replica-1"] == 30
    # A moved request ran only on the new replica: none of its first tokens came before it was up.
    starts = [r.first_token_s for r in out.result.records if r.replica == "replica-1"]
    assert min(starts) > 2.0


def test_the_backlog_waits_less_for_the_same_replica_count(runs):
    before, after = runs[False], runs[True]
    assert after.timeline[-1][2] == before.timeline[-1][2] == 2
    mean_ttft = {m: sum(r.ttft_s for r in o.result.records) / 30 for m, o in runs.items()}
    assert mean_ttft[True] < 0.9 * mean_ttft[False]
    # Simulated seconds (the simulator's deterministic clock), not a wall-clock timing.
    assert after.result.end_s < before.result.end_s


@pytest.mark.parametrize("value", [2**64, -1, math.nan, 10**300, 1, "yes"])
def test_move_queued_is_a_bool(value):
    with pytest.raises(ValueError, match="move_queued"):
        AutoscaleConfig(move_queued=value)
