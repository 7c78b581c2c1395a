"""The KV CPU tier in the simulator: the production connector's saves and loads, timed over a link;
bounds and block counts hold, a returning turn loads instead of prefilling, and its copies cost
time."""

from __future__ import annotations

import dataclasses
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler import SchedulerConfig
from sim import FleetSim, SimConfig, load_profile
from sim.kv_copy import LinkConfig
from sim.replica import SimReplica
from sim.tier_study import ConversationConfig, conversations
from sim.tier_study import main as study_main
from sim.tiers import TierSimReplica, tier_figures

CPU = load_profile("cpu")


def _config(tier_blocks: int, blocks: int = 64, replicas: int = 1, link: LinkConfig | None = None):
    sched = SchedulerConfig(
        num_gpu_blocks=blocks,
        max_model_len=blocks * 16,
        max_num_batched_tokens=256,
        num_cpu_tier_blocks=tier_blocks,
    )
    return SimConfig(num_replicas=replicas, scheduler=sched, tier_link=link or LinkConfig())


def _conversations(users: int = 6, turns: int = 3, seed: int = 0):
    return conversations(
        ConversationConfig(
            users=users,
            turns=turns,
            question_len=(20, 80),
            answer_len=(4, 12),
            think_s=(2.0, 4.0),
            start_spread_s=2.0,
            seed=seed,
        )
    )


@given(
    seed=st.integers(0, 1000),
    tier_blocks=st.integers(1, 80),
    replicas=st.integers(1, 2),
)
def test_every_turn_finishes_and_the_tier_stays_in_bounds(seed, tier_blocks, replicas):
    wl = _conversations(seed=seed)
    sim = FleetSim(_config(tier_blocks, replicas=replicas), CPU)
    result = sim.run(wl)
    assert {r.request_id: r.num_output_tokens for r in result.records} == {
        r.request_id: r.output_len for r in wl
    }
    for rep in sim.replicas:
        assert isinstance(rep, TierSimReplica)
        connector = rep.scheduler.connector
        assert connector is not None and len(connector.cpu) <= tier_blocks
        assert not rep.scheduler.loading and not connector.plans
        kv = rep.scheduler.kv
        assert kv.num_free_blocks == kv.pool.num_blocks
    f = tier_figures(result)
    assert f.device_hit_tokens >= 0 and f.device_hit_tokens + f.tier_hit_tokens <= f.queried_tokens


def test_returning_turns_load_what_the_device_pool_evicted():
    wl = _conversations(users=8, turns=2)
    off = FleetSim(_config(0), CPU).run(wl)
    on = FleetSim(_config(256), CPU).run(wl)
    assert all(type(r) is SimReplica for r in off.replicas)  # tier off: the plain replica
    f_off, f_on = tier_figures(off), tier_figures(on)
    assert f_off.tier_hit_tokens == 0 and f_on.tier_hit_tokens > 0
    assert f_on.saved_blocks > 0 and f_on.loaded_blocks > 0
    computed = [f.queried_tokens - f.device_hit_tokens - f.tier_hit_tokens for f in (f_off, f_on)]
    assert computed[1] < computed[0]


def test_loads_take_the_links_time():
    """The same run over a slow link: the tier's copies take longer and returning turns wait."""
    wl = _conversations(users=8, turns=2)
    results = {}
    for bandwidth in (25e9, 1e7):
        sim = FleetSim(_config(256, link=LinkConfig(bandwidth)), CPU)
        results[bandwidth] = (sim.run(wl), sim.replicas[0])
    (fast, fast_rep), (slow, slow_rep) = results[25e9], results[1e7]
    assert isinstance(slow_rep, TierSimReplica) and isinstance(fast_rep, TierSimReplica)
    assert slow_rep.copy_s > 100 * fast_rep.copy_s > 0
    back = [r.request_id for r in wl if r.tenant != "turn0"]
    fast_ttft, slow_ttft = ({r.request_id: r.ttft_s for r in res.records} for res in (fast, slow))
    assert sum(slow_ttft[i] for i in back) > sum(fast_ttft[i] for i in back)


def test_a_tier_replica_reports_its_tier_to_the_router():
    wl = _conversations(users=8, turns=2)
    sim = FleetSim(_config(256), CPU)
    sim.run(wl)
    stats = sim.replicas[0].routing_stats()
    connector = sim.replicas[0].scheduler.connector
    assert connector is not None
    assert stats.tier_hashes and set(stats.tier_hashes) == set(connector.cpu.slots)


def test_a_turn_begins_with_the_previous_turns_prompt():
    wl = _conversations(users=3, turns=3)
    by_user: dict[str, list] = {}
    for i, r in enumerate(wl):
        by_user.setdefault(r.prefix_group, []).append(r.prompt_token_ids(i))
    for prompts in by_user.values():
        for before, after in pairwise(prompts):
            assert after[: len(before)] == before and len(after) > len(before)


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("users", {"users": 0}),
        ("turns", {"turns": 2**64}),
        ("question_len", {"question_len": (5, 1)}),
        ("answer_len", {"answer_len": (0, 3)}),
        ("think_s", {"think_s": (float("nan"), 1.0)}),
        ("start_spread_s", {"start_spread_s": -1.0}),
    ],
)
def test_bad_conversation_settings_name_their_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        ConversationConfig(**kwargs)


def test_tiers_with_adapters_are_refused():
    from sim.adapters import AdapterSlotsConfig

    with pytest.raises(ValueError, match="num_cpu_tier_blocks"):
        SimConfig(scheduler=_config(8).scheduler, adapters=AdapterSlotsConfig())


def test_the_study_prints_both_runs(capsys):
    study_main(["--users", "6", "--turns", "2", "--blocks", "64", "--think", "1", "2"])
    out = capsys.readouterr().out
    assert "| off |" in out and "| on |" in out and "with the tier" in out


@given(seed=st.integers(0, 1000))
def test_coalesced_runs_equal_step_by_step_ones(seed):
    wl = _conversations(users=6, turns=3, seed=seed)

    def fingerprint(coalesce: bool):
        config = dataclasses.replace(_config(48, replicas=2), coalesce=coalesce)
        result = FleetSim(config, CPU).run(wl)
        return [
            (r.request_id, r.replica, r.first_token_s, r.finish_s, tuple(r.itl_s))
            for r in result.records
        ]

    assert fingerprint(True) == fingerprint(False)
