"""Peer-to-peer prefix pulls, the router's part (router/peer_pull.py, router/fleet.py `plan`): a
request that load sends away from the replica holding its prefix carries a pull from that peer
when the peer's KV events (in sync) show it holds at least min_pull_blocks more than the chosen
replica; the cost model weighs the bytes against the prefill; every bound is checked."""

from __future__ import annotations

import math

import pytest

from router.config import RoutingConfig
from router.kv_events import KVIndex, TierRun
from router.peer_pull import MAX_PULL_BLOCKS, PeerPull, PullCost, plan_pull
from router.policies import RouteRequest
from router.stats import RoutingStats
from scheduler.kv_events import KVEventReport, KVSnapshot
from tests.router.scaffold import busy, fleet, report

A, B = "a", "b"
CONTEXT = list(range(100, 112))  # 12 blocks


def events(state, replica: str, device=(), seq: int = 1) -> None:
    stats = RoutingStats(
        report().scheduler, kv_events=KVEventReport([], KVSnapshot(seq, list(device)), seq)
    )
    state.on_stats(replica, RoutingStats.from_dict(stats.to_dict()), 0.0)


def routed(state, hashes, rid: str = "q"):
    return state.plan(RouteRequest(rid, 0, list(hashes)), [A, B], 1.0)


def test_a_request_spilled_off_the_holder_pulls_what_the_holder_has_beyond_its_own():
    state = fleet(peer_pulls=True, imbalance_threshold=1, imbalance_ratio=1)
    events(state, A, CONTEXT)
    events(state, B, CONTEXT[:2])
    busy(state, A, 6)  # past the load ceiling: load sends the fork to B
    route = routed(state, CONTEXT + [900, 901])
    assert route.ranking[0] == B
    assert route.pull == PeerPull(A, tuple(CONTEXT), 2)
    assert route.pull.num_blocks == 10


def test_no_pull_when_off_when_the_choice_holds_it_or_the_gain_is_under_min_pull_blocks():
    for config, a_holds, b_holds in (
        (dict(peer_pulls=False), CONTEXT, []),  # off
        (dict(peer_pulls=True), CONTEXT, CONTEXT),  # B holds it all
        (dict(peer_pulls=True, min_pull_blocks=5), CONTEXT[:8], CONTEXT[:4]),  # 4 < 5 more
    ):
        state = fleet(imbalance_threshold=1, imbalance_ratio=1, **config)
        events(state, A, a_holds)
        events(state, B, b_holds)
        busy(state, A, 6)
        route = routed(state, CONTEXT)
        assert route.ranking[0] == B and route.pull is None, config


def test_the_holder_within_the_ceiling_is_chosen_and_pulls_nothing():
    state = fleet(peer_pulls=True)
    events(state, A, CONTEXT)
    events(state, B)
    route = routed(state, CONTEXT)
    assert route.ranking[0] == A and route.pull is None


def test_never_a_pull_on_a_guess_a_peer_out_of_sync_is_not_asked():
    index = KVIndex()
    index.apply(A, KVEventReport([], KVSnapshot(1, CONTEXT), 1))
    assert plan_pull(index, CONTEXT, B, TierRun(), [A, B], 4) == PeerPull(A, tuple(CONTEXT), 0)
    index.apply(A, KVEventReport([], None, 5))  # batches 2-5 lost: out of sync
    assert not index.in_sync(A)
    assert plan_pull(index, CONTEXT, B, TierRun(), [A, B], 4) is None


def test_each_fork_spilled_to_a_replica_pulls_though_an_earlier_one_is_on_its_way_there():
    """A second fork routed to B while the first's pull is still on its way there pulls too:
    without a pull of its own it would compute the context beside the first."""
    state = fleet(peer_pulls=True, imbalance_threshold=1, imbalance_ratio=1)
    events(state, A, CONTEXT)
    events(state, B)
    busy(state, A, 6)
    first = routed(state, CONTEXT + [1], "q1")
    second = routed(state, CONTEXT + [2], "q2")
    assert first.ranking[0] == second.ranking[0] == B
    assert first.pull == second.pull == PeerPull(A, tuple(CONTEXT), 0)
    # Once B's events show the context, a fork there pulls nothing.
    events(state, B, CONTEXT, seq=2)
    assert routed(state, CONTEXT + [3], "q3").pull is None


def test_the_cost_model_weighs_bytes_moved_against_tokens_prefilled():
    cost = PullCost(bytes_per_s=1e9, fixed_s=0.01, prefill_tokens_per_s=5000)
    # 100 blocks of 16 tokens at 256 KiB a block: 26 ms + 10 ms to move, 320 ms to compute
    assert cost.pays(100, 16, 256 << 10)
    # one block: 10 ms fixed against 3.2 ms of prefill
    assert not cost.pays(1, 16, 256 << 10)
    assert math.isclose(cost.pull_s(1_000_000_000), 1.01)
    assert math.isclose(cost.prefill_s(5000), 1.0)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(peer="", hashes=(1,)), "pull.peer"),
        (dict(peer="x" * 257, hashes=(1,)), "pull.peer"),
        (dict(peer=7, hashes=(1,)), "pull.peer"),
        (dict(peer="a", hashes=()), "pull.hashes"),
        (dict(peer="a", hashes=[1]), "pull.hashes"),
        (dict(peer="a", hashes=(1,) * (MAX_PULL_BLOCKS + 1)), "pull.hashes"),
        (dict(peer="a", hashes=(-1,)), "pull.hashes"),
        (dict(peer="a", hashes=(2**128,)), "pull.hashes"),
        (dict(peer="a", hashes=(1.0,)), "pull.hashes"),
        (dict(peer="a", hashes=(1, 2), first=2), "pull.first"),
        (dict(peer="a", hashes=(1, 2), first=-1), "pull.first"),
        (dict(peer="a", hashes=(1, 2), first=2**64), "pull.first"),
        (dict(peer="a", hashes=(1, 2), first=float("nan")), "pull.first"),
    ],
)
def test_a_pull_out_of_bounds_is_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PeerPull(**kwargs)


@pytest.mark.parametrize(
    "field",
    [
        "min_pull_blocks",
        "pull_timeout_s",
        "pull_bytes_per_s",
        "pull_fixed_s",
        "prefill_tokens_per_s",
    ],
)
@pytest.mark.parametrize("value", [2**64, -1, float("nan"), 1e300])
def test_the_pull_settings_refuse_values_out_of_bounds_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        RoutingConfig.from_router_kwargs({field: value})


def test_peer_pulls_is_a_boolean():
    with pytest.raises(ValueError, match="peer_pulls"):
        RoutingConfig(peer_pulls=2**64)
    assert RoutingConfig.from_router_kwargs({"peer_pulls": True}).peer_pulls
