"""Routing policies, without Ray: each chooses one replica; load beats affinity past the threshold,
the longest prefix run wins otherwise, and a new prefix goes where the fewest prefixes live."""

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.policies import LeastLoaded, PowerOfTwo, PrefixAffinity, RoundRobin, RouteRequest
from tests.router.scaffold import busy, fail_on, fleet, report

A, B, C = "a", "b", "c"


def test_round_robin_cycles_blind_to_load():
    state = fleet(router_policy="round_robin")
    busy(state, A, 10)
    firsts = [state.route(RouteRequest(f"r{i}"), [A, B, C], now=0)[0] for i in range(6)]
    assert firsts == [A, B, C, A, B, C]
    policy = RoundRobin()
    assert [policy.choose([A, B], RouteRequest("q"), state) for _ in range(3)] == [A, B, A]


def test_least_loaded_prefers_the_idle_replica_and_rotates_ties():
    state = fleet()
    busy(state, A, 2)
    policy = LeastLoaded()
    firsts = [policy.choose([A, B, C], RouteRequest(f"q{i}"), state) for i in range(4)]
    assert A not in firsts and set(firsts) == {B, C}  # B and C take turns
    busy(state, B, 1)
    assert policy.choose([A, B, C], RouteRequest("q"), state) == C


def test_power_of_two_picks_the_less_loaded_of_its_pair():
    state = fleet()
    busy(state, A, 5)
    policy = PowerOfTwo(seed=3)
    assert {policy.choose([A, B], RouteRequest(f"q{i}"), state) for i in range(20)} == {B}
    # Of three, the loaded one loses whichever pair is drawn; the other two share the rest.
    chosen = [policy.choose([A, B, C], RouteRequest(f"q{i}"), state) for i in range(40)]
    assert set(chosen) == {B, C}


def test_power_of_two_with_a_seed_draws_the_same_choices():
    state = fleet()
    busy(state, A, 1)
    draws = [
        [policy.choose([A, B, C, "d"], RouteRequest(f"q{i}"), state) for i in range(20)]
        for policy in (PowerOfTwo(seed=7), PowerOfTwo(seed=7))
    ]
    assert draws[0] == draws[1]


def test_longest_prefix_run_wins_when_load_is_balanced():
    state = fleet(imbalance_threshold=4)
    state.index.insert(A, [1, 2], now=0)
    state.index.insert(B, [1, 2, 3], now=0)
    busy(state, B, 2)  # within the threshold of idle A and C
    assert state.route(RouteRequest("q", 10, [1, 2, 3, 4]), [A, B, C], now=0)[0] == B


@pytest.mark.parametrize(
    "c_device,c_tier,winner",
    [
        ([], [1, 2, 3], A),  # three tier blocks (1.5) lose to two device blocks
        ([1], [2, 3, 4], C),  # one device block and three tier blocks (2.5) win
        ([1], [3, 4], A),  # a tier run counts only where it follows the device run
    ],
)
def test_a_lower_tier_run_counts_at_its_discount(c_device, c_tier, winner):
    state = fleet(imbalance_threshold=4, tier_hit_discount=0.5)
    state.index.insert(A, [1, 2], now=0)
    if c_device:
        state.index.insert(C, c_device, now=0)
    state.tier_hashes[C] = frozenset(c_tier)
    assert state.route(RouteRequest("q", 10, [1, 2, 3, 4]), [A, C], now=0)[0] == winner
    state.on_stats(C, report(), now=1)  # a report without tiers leaves C's as they were
    assert C in state.tier_hashes
    state.remove_replica(C)
    assert C not in state.tier_hashes


def test_load_imbalance_beats_affinity_past_the_threshold():
    policy = PrefixAffinity(imbalance_threshold=3, min_match_blocks=1)
    state = fleet()
    state.index.insert(A, [1, 2, 3], now=0)
    busy(state, A, 3)
    assert policy.choose([A, B], RouteRequest("q", 0, [1, 2, 3]), state) == A  # at the threshold
    busy(state, A, 4)
    assert policy.choose([A, B], RouteRequest("q", 0, [1, 2, 3]), state) == B


def test_under_heavy_load_a_relative_skew_keeps_affinity():
    policy = PrefixAffinity(imbalance_threshold=3, min_match_blocks=1, imbalance_ratio=1.5)
    state = fleet()
    state.index.insert(A, [1, 2, 3], now=0)
    busy(state, B, 20)
    busy(state, A, 29)  # 9 ahead, but within 1.5x of 20
    assert policy.choose([A, B], RouteRequest("q", 0, [1, 2, 3]), state) == A
    busy(state, A, 2)  # 31 > max(20 + 3, 30)
    assert policy.choose([A, B], RouteRequest("q", 0, [1, 2, 3]), state) == B


def test_an_overloaded_longest_holder_yields_to_a_shorter_run_before_no_run():
    policy = PrefixAffinity(imbalance_threshold=2, min_match_blocks=1)
    state = fleet()
    state.index.insert(A, [1, 2, 3], now=0)
    state.index.insert(B, [1], now=0)
    busy(state, A, 6)
    busy(state, B, 1)
    assert policy.choose([A, B, C], RouteRequest("q", 0, [1, 2, 3]), state) == B


def test_equal_runs_go_to_the_less_loaded_holder():
    policy = PrefixAffinity(imbalance_threshold=4, min_match_blocks=1)
    state = fleet()
    for replica in (A, B, C):
        state.index.insert(replica, [1, 2], now=0)
    busy(state, A, 2)
    busy(state, B, 1)
    busy(state, C, 2)
    assert policy.choose([A, B, C], RouteRequest("q", 0, [1, 2]), state) == B


def test_request_without_block_hashes_is_routed_by_load():
    state = fleet()
    state.index.insert(A, [1], now=0)
    busy(state, A, 1)
    assert state.route(RouteRequest("q", 10, []), [A, B], now=0)[0] == B


def test_a_new_prefix_goes_to_the_replica_holding_the_fewest_blocks_within_the_threshold():
    policy = PrefixAffinity(imbalance_threshold=2, min_match_blocks=1)
    state = fleet()
    state.index.insert(A, [1, 2, 3], now=0)
    state.index.insert(B, [4], now=0)
    busy(state, C, 1)
    assert policy.choose([A, B, C], RouteRequest("q", 0, [9, 9]), state) == C
    busy(state, C, 2)  # now 3 ahead of the idle replicas: past the threshold
    assert policy.choose([A, B, C], RouteRequest("q", 0, [9, 9]), state) == B


def test_short_match_below_min_match_blocks_is_ignored():
    policy = PrefixAffinity(imbalance_threshold=4, min_match_blocks=2)
    state = fleet()
    state.index.insert(A, [1], now=0)
    busy(state, A, 1)
    assert policy.choose([A, B], RouteRequest("q", 0, [1, 2]), state) == B


# ---------------------------------------------------------------- the route derived from the choice

NAMES = ["r0", "r1", "r2", "r3", "r4"]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("route"), st.lists(st.integers(0, 3), max_size=4)),
        st.tuples(st.just("confirm"), st.sampled_from(NAMES)),
        st.tuples(st.just("complete"), st.integers(0, 40)),
        st.tuples(
            st.just("stats"),
            st.sampled_from(NAMES),
            st.integers(0, 3),
            st.sampled_from(["ok", "ok", "ok", "draining", "failed"]),
        ),
        st.tuples(st.just("fail"), st.sampled_from(NAMES)),
    ),
    max_size=50,
)


@settings(max_examples=200, deadline=None)
@given(
    policy=st.sampled_from(["round_robin", "least_loaded", "power_of_two", "prefix_affinity"]),
    threshold=st.sampled_from([0.0, 1.0, 4.0]),
    ops=ops,
)
def test_the_route_starts_with_the_policys_choice_and_ranks_every_candidate_once(
    policy, threshold, ops
):
    """Whatever the loads, reports, prefixes and open circuits: route() is the policy's choice
    followed by every other candidate, least loaded first, and each candidate appears once. The
    candidates: the replicas reporting themselves OK, less those with an open circuit (all of them
    if every circuit is open)."""
    state = fleet(
        router_policy=policy,
        seed=1,
        imbalance_threshold=threshold,
        max_index_blocks=8,
        circuit_breaker_failures=2,
    )
    last = RouteRequest("none")
    for t, op in enumerate(ops):
        if op[0] == "route":
            last = RouteRequest(f"q{t}", 100, [h * 10 + i for i, h in enumerate(op[1])])
            healthy = [r for r in NAMES if state.loads.is_healthy(r)]
            candidates = [r for r in healthy if state.breaker.allows(r, t)] or healthy
            twin = copy.deepcopy(state)  # the same state: the same turn and random draws
            twin.loads.expire(t)  # as route() does first
            ranking = state.route(last, reversed(NAMES), now=t)
            if not candidates:
                assert ranking == []
                continue
            assert ranking[0] == twin.policy.choose(candidates, last, twin)
            assert sorted(ranking) == candidates
            loads = [state.loads.load(r) for r in ranking[1:]]
            assert loads == sorted(loads)
        elif op[0] == "confirm":
            state.on_routed(last, op[1], now=t)
        elif op[0] == "complete":
            state.on_completed(f"q{op[1]}")
        elif op[0] == "stats":
            state.on_stats(op[1], report(num_running=op[2], state=op[3]), now=t)
        else:
            fail_on(state, op[1], 1, now=t)


def test_the_mean_reference_keeps_a_holder_that_only_an_idle_replica_undercuts():
    """Of many replicas one is nearly always idle, so a ceiling above the least loaded spills a
    holder with a few requests more; one above the mean keeps it while it is near the fleet's
    typical load."""
    state = fleet()
    state.index.insert(A, [1, 2, 3], now=0)
    for replica in (A, B, C):
        busy(state, replica, 6)
    replicas = [A, B, C, "idle"]
    least = PrefixAffinity(imbalance_threshold=3, min_match_blocks=1, reference="least")
    mean = PrefixAffinity(imbalance_threshold=3, min_match_blocks=1, reference="mean")
    assert least.choose(replicas, RouteRequest("q", 0, [1, 2, 3]), state) == "idle"
    assert mean.choose(replicas, RouteRequest("q", 0, [1, 2, 3]), state) == A
    busy(state, A, 3)  # 9 > 4.5 + 3 (the mean 4.5 is now 5.25: 9 > 8.25)
    assert mean.choose(replicas, RouteRequest("q", 0, [1, 2, 3]), state) == "idle"
