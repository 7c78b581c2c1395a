"""Speculative decoding in the simulator: the production Scheduler's SpecDecoding feature and
SpecPolicy run with a stand-in proposer whose acceptance is drawn from an input distribution;
every request gets its tokens, no block leaks, the policy's rules decide who verifies, and a
verify row costs k + 1 query tokens."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler import SchedulerConfig
from scheduler.speculative import SpeculativeConfig
from sim import FleetSim, SimConfig, load_profile
from sim.spec_study import batch
from sim.spec_study import main as study_main
from sim.speculation import AcceptanceConfig, SpecSimConfig, SpecSimReplica

SCHED = SchedulerConfig(num_gpu_blocks=96, max_model_len=1024, max_num_batched_tokens=256)


def _run(
    spec: SpecSimConfig | None,
    size: int,
    output_len: int = 40,
    profile: str = "cpu",
    sched: SchedulerConfig = SCHED,
):
    sim = FleetSim(SimConfig(num_replicas=1, scheduler=sched, spec=spec), load_profile(profile))
    result = sim.run(batch(size, prompt_len=40, output_len=output_len))
    return result, sim.replicas[0]


def _spec(probs, k: int = 4, max_batch: int = 4, min_rate: float = 0.4, graphs: bool = False):
    return SpecSimConfig(
        SpeculativeConfig(num_tokens=k, max_batch_size=max_batch, min_acceptance_rate=min_rate),
        AcceptanceConfig(tuple(probs)),
        graphs,
    )


@given(
    probs=st.lists(st.floats(0, 1), min_size=2, max_size=9).filter(lambda p: sum(p) > 0),
    k=st.integers(1, 8),
    size=st.integers(1, 6),
    max_batch=st.integers(1, 6),
    output_len=st.integers(2, 60),
    blocks=st.sampled_from([20, 96]),  # 20: tight enough that requests are preempted
)
def test_every_request_gets_its_tokens_and_no_block_leaks(
    probs, k, size, max_batch, output_len, blocks
):
    sched = SchedulerConfig(
        num_gpu_blocks=blocks, max_model_len=blocks * 16, max_num_batched_tokens=256
    )
    result, replica = _run(_spec(probs, k, max_batch), size, output_len, sched=sched)
    assert isinstance(replica, SpecSimReplica)
    assert [r.num_output_tokens for r in result.records] == [output_len] * size
    kv = replica.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks  # the pool is whole again
    stats = replica.scheduler.stats()
    assert stats.num_spec_accepted_tokens <= stats.num_spec_proposed_tokens
    assert stats.num_spec_proposed_tokens <= k * stats.num_spec_verify_rows


def test_full_acceptance_emits_k_plus_one_tokens_a_step():
    result, replica = _run(_spec([0, 0, 0, 0, 1]), 1, output_len=41)
    stats = replica.scheduler.stats()
    assert stats.num_spec_accepted_tokens == 4 * stats.num_spec_verify_rows
    assert stats.num_spec_verify_rows == 8  # 40 tokens after the first, 5 a step
    assert len(result.records[0].itl_s) == 8


def test_the_policy_stops_verifying_a_request_that_accepts_nothing():
    """SpecPolicy's estimate is 1.0 until the first verify row, which replaces it: one row that
    accepts nothing takes it under min_acceptance_rate 0.4, and its shadows keep it there."""
    _, replica = _run(_spec([1, 0, 0, 0, 0]), 3, output_len=60)
    assert replica.scheduler.stats().num_spec_verify_rows == 3 * 1


def test_no_request_verifies_in_a_batch_over_max_batch_size():
    _, replica = _run(_spec([0, 0, 0, 0, 1], max_batch=4), 8)
    assert replica.scheduler.stats().num_spec_verify_rows == 0


def test_verify_steps_cost_their_query_tokens():
    """On the H100 profile a verify step runs eagerly (no CUDA graph), at a prefill step's fixed
    cost: slower than plain decoding at this acceptance; priced as a graph replay, faster."""
    ends = {}
    for name, spec in [
        ("plain", None),
        ("eager", _spec([0, 0, 0, 0, 1])),
        ("graphs", _spec([0, 0, 0, 0, 1], graphs=True)),
    ]:
        result, _ = _run(spec, 1, output_len=41, profile="h100")
        ends[name] = result.records[0].finish_s
    assert ends["graphs"] < ends["plain"] < ends["eager"]


def test_per_token_acceptance_matches_its_mean():
    acc = AcceptanceConfig.per_token(0.825, 4)
    assert acc.mean_accepted(4) == pytest.approx(sum(0.825**a for a in range(1, 5)))
    assert acc.mean_accepted(2) == pytest.approx(0.825 + 0.825**2)


@pytest.mark.parametrize(
    "probs",
    [(1.0,), (math.nan, 1.0), (-0.1, 1.0), (0.0, 0.0), (math.inf, 1.0), (True, 1.0), (1.0,) * 66],
)
def test_a_bad_acceptance_distribution_is_refused_naming_it(probs):
    with pytest.raises(ValueError, match="probs"):
        AcceptanceConfig(probs)


def test_speculation_with_a_cpu_tier_is_refused():
    tiered = SchedulerConfig(num_gpu_blocks=96, max_model_len=1024, num_cpu_tier_blocks=8)
    with pytest.raises(ValueError, match="spec"):
        SimConfig(scheduler=tiered, spec=SpecSimConfig())


def test_the_study_prints_every_engine(capsys):
    study_main(["--profiles", "cpu", "--batches", "1", "2", "--output-len", "20"])
    out = capsys.readouterr().out
    assert out.count("| cpu | 1 |") == 3 and "spec (defaults)" in out
