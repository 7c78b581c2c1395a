"""FleetState, the router's whole state, without Ray: charges at the choice, confirmation and
completion, reports applied once, dead and unhealthy replicas never chosen, circuits that open on
failures reported by the caller."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.fleet import FleetState
from router.policies import RouteRequest
from router.stats import RoutingStats
from scheduler.outputs import SchedulerStats
from tests.router.scaffold import busy, fail_on, fleet, report

A, B, C = "a", "b", "c"


def test_a_burst_sharing_a_prefix_stays_together_until_the_threshold_then_spills():
    state = fleet(imbalance_threshold=2, imbalance_reference="least")
    prefix = [11, 12, 13]
    firsts = [state.route(RouteRequest(f"r{i}", 0, prefix), [A, B], now=0)[0] for i in range(6)]
    # Charged at decision time, so the burst sees its own earlier members before any confirmation:
    # the holder takes requests until it is 2 ahead of the idle replica (3 vs 0), then it spills.
    assert firsts[:3] == [firsts[0]] * 3
    assert firsts[3] != firsts[0]
    # Both replicas now hold the prefix: the next one goes to the less loaded of the two.
    assert state.index.replicas_of(11) == {A, B}


def test_after_the_choice_the_route_lists_the_others_least_loaded_first():
    state = fleet(imbalance_threshold=10)
    state.index.insert(A, [1, 2], now=0)
    busy(state, A, 3)
    busy(state, B, 2)
    busy(state, C, 1)
    assert state.route(RouteRequest("q", 0, [1, 2]), [C, B, A, "d"], now=0) == [A, "d", C, B]


def test_confirmation_moves_the_charge_and_completion_releases_it():
    state = fleet()
    first = state.route(RouteRequest("r1", 64, [1]), [A, B], now=0)[0]
    other = B if first == A else A
    state.on_routed(RouteRequest("r1", 64, [1]), other, now=0)  # Serve found `first` full
    assert state.loads.get(first).inflight_requests == 0
    assert state.loads.get(other).inflight_requests == 1
    assert other in state.index.replicas_of(1)
    state.on_completed("r1")
    assert state.loads.get(other).inflight_requests == 0
    assert state.routed == {other: 1}


def test_stats_are_applied_once_per_distinct_report():
    state = fleet(stats_grace_s=1)
    state.index.insert(A, [1, 2], now=0)
    state.on_stats(A, report(num_waiting=1, num_running=2, prefix=[1]), now=10)
    assert state.loads.get(A).reported_requests == 3
    assert state.index.blocks_of(A) == {1}
    state.index.insert(A, [2], now=20)
    # The same report re-broadcast (Serve does, with every replica-set change): nothing new.
    state.on_stats(A, report(num_waiting=1, num_running=2, prefix=[1]), now=30)
    assert state.index.blocks_of(A) == {1, 2}
    state.on_stats(A, report(num_waiting=1, num_running=3, prefix=[1]), now=31)
    assert state.index.blocks_of(A) == {1}


def test_dead_replica_is_forgotten_and_never_chosen():
    state = fleet()
    state.route(RouteRequest("r1", 10, [1, 2]), [A, B], now=0)
    state.on_routed(RouteRequest("r1", 10, [1, 2]), A, now=0)
    state.on_stats(A, report(num_running=1, kv_cache_usage=0.1), now=0)
    assert state.remove_replica(A) is True
    assert state.remove_replica(A) is False  # Serve reports a death once per failed request
    assert A not in state.loads.replicas() and A not in state.index.replicas()
    assert state.index.replicas_of(1) == set()
    assert state.route(RouteRequest("r2", 10, [1, 2]), [B], now=1) == [B]
    state.on_completed("r1")  # a late completion for the dead replica is harmless
    assert state.loads.get(A).inflight_requests == 0


def test_retain_drops_replicas_no_longer_in_the_deployment():
    state = fleet()
    state.on_routed(RouteRequest("r1", 10, [1]), A, now=0)
    state.on_routed(RouteRequest("r2", 10, [2]), B, now=0)
    state.retain([B])
    assert state.index.replicas() == {B}
    assert state.loads.replicas() == {B}


def test_no_replicas_no_ranking():
    assert fleet().route(RouteRequest("r"), [], now=0) == []


@pytest.mark.parametrize("unhealthy", ["failed", "stalled", "draining"])
def test_a_replica_that_reports_itself_unhealthy_is_never_chosen(unhealthy):
    state = fleet(router_policy="least_loaded")
    state.on_stats(A, report(state=unhealthy), now=0)
    state.on_stats(B, report(num_waiting=9, num_running=9, kv_cache_usage=0.9), now=0)
    for i in range(5):
        assert state.route(RouteRequest(f"r{i}", 10, []), [A, B], now=1) == [B]
    state.on_stats(A, report(), now=2)
    assert state.route(RouteRequest("back", 10, []), [A, B], now=3)[0] == A
    state.on_stats(B, report(state=unhealthy), now=4)
    state.on_stats(A, report(state=unhealthy), now=4)
    assert state.route(RouteRequest("none", 10, []), [A, B], now=5) == []


hashes = st.lists(st.integers(0, 30), max_size=8)
op = st.one_of(
    st.tuples(st.just("route"), hashes, st.integers(0, 4000)),
    st.tuples(st.just("confirm"), st.sampled_from([A, B, C])),
    st.tuples(st.just("complete"), st.integers(0, 30)),
    st.tuples(st.just("stats"), st.sampled_from([A, B, C]), st.integers(0, 8), hashes),
    st.tuples(st.just("kill"), st.sampled_from([A, B, C])),
)


@settings(max_examples=200, deadline=None)
@given(
    policy=st.sampled_from(["round_robin", "least_loaded", "power_of_two", "prefix_affinity"]),
    ops=st.lists(op, max_size=60),
)
def test_never_routes_to_a_dead_replica_and_keeps_no_state_for_it(policy, ops):
    state = fleet(router_policy=policy, max_index_blocks=16, seed=0)
    alive = {A, B, C}
    dead: set[str] = set()
    last: RouteRequest | None = None
    for t, o in enumerate(ops):
        if o[0] == "route":
            last = RouteRequest(f"r{t}", o[2], o[1])
            ranking = state.route(last, alive, now=t)
            assert set(ranking) <= alive
            assert bool(ranking) == bool(alive)
        elif o[0] == "confirm" and last is not None and o[1] in alive:
            state.on_routed(last, o[1], now=t)
        elif o[0] == "complete":
            state.on_completed(f"r{o[1]}")
        elif o[0] == "stats" and o[1] in alive:
            blocks = list(dict.fromkeys(o[3]))
            state.on_stats(o[1], report(num_running=o[2], prefix=blocks), now=t)
        elif o[0] == "kill":
            alive.discard(o[1])
            dead.add(o[1])
            state.remove_replica(o[1])
        assert not (state.loads.replicas() | state.index.replicas()) & dead
        assert all(state.loads.get(r).inflight_requests >= 0 for r in (A, B, C))


# ---------------------------------------------------------------- circuit breaker


def breaking(**config) -> FleetState:
    return fleet(router_policy="least_loaded", **config)


def test_consecutive_failures_reported_by_the_caller_open_the_circuit_and_the_router_skips_it():
    state = breaking(circuit_breaker_failures=3, circuit_breaker_cooldown_s=10)
    fail_on(state, A, 2, now=0)
    assert A in state.route(RouteRequest("still", 10, []), [A, B], now=1)
    fail_on(state, A, 1, now=1)
    busy(state, B, 5, now=1)  # even a much busier B beats a replica with an open circuit
    for i in range(5):
        assert state.route(RouteRequest(f"r{i}", 10, []), [A, B], now=2) == [B]


def test_an_open_circuit_closes_on_a_fresh_ok_report_after_the_cool_down():
    state = breaking(circuit_breaker_failures=1, circuit_breaker_cooldown_s=10)
    busy(state, B, 5, now=0)
    fail_on(state, A, 1, now=0)
    state.on_stats(A, report(num_running=1), now=5)  # too early: may predate the failure
    assert state.route(RouteRequest("early", 10, []), [A, B], now=5) == [B]
    state.on_stats(A, report(), now=11)
    assert state.route(RouteRequest("back", 10, []), [A, B], now=11)[0] == A


def test_a_success_reported_by_the_caller_resets_the_count():
    state = breaking(circuit_breaker_failures=2)
    for i in range(5):
        fail_on(state, A, 1, now=i)
        state.on_routed(RouteRequest(f"fine-{i}", 10, []), A, now=i)
        assert state.on_outcome(f"fine-{i}", ok=True, now=i) == A
    assert not state.breaker.is_open(A)


def test_when_every_circuit_is_open_the_router_still_routes():
    # Refusing everything would strand requests; their own migration limit decides when to give up.
    state = breaking(circuit_breaker_failures=1)
    fail_on(state, A, 1, now=0)
    fail_on(state, B, 1, now=0)
    assert sorted(state.route(RouteRequest("any", 10, []), [A, B], now=1)) == [A, B]


def test_after_the_cool_down_one_probe_goes_to_the_replica_and_its_success_closes_the_circuit():
    state = breaking(circuit_breaker_failures=1, circuit_breaker_cooldown_s=10)
    fail_on(state, A, 1, now=0)
    busy(state, B, 5, now=0)
    probe = RouteRequest("probe", 10, [])
    assert state.route(probe, [A, B], now=10)[0] == A
    # One probe at a time.
    assert state.route(RouteRequest("second", 10, []), [A, B], now=10.5) == [B]
    state.on_routed(probe, A, now=10)
    assert state.on_outcome("probe", ok=True, now=11) == A
    assert state.route(RouteRequest("back", 10, []), [A, B], now=11)[0] == A


def test_outcomes_of_unknown_requests_are_ignored_and_removal_forgets_the_circuit():
    state = fleet(circuit_breaker_failures=1)
    assert state.on_outcome("never-routed", ok=False, now=0) is None
    fail_on(state, A, 1, now=0)
    state.remove_replica(A)
    assert not state.breaker.replicas()
    fail_on(state, B, 1, now=0)
    state.retain([A])
    assert not state.breaker.replicas()


def test_a_replicas_reported_kv_blocks_bound_its_index_entries():
    state = fleet()
    state.index.insert(A, list(range(10)), now=0)
    figures = SchedulerStats(0, 0, 0, 0.0, 0.0, 0, num_gpu_blocks=4)
    state.on_stats(A, RoutingStats(figures), now=1)
    assert state.index.bound(A) == 4 and state.index.footprint(A) == 4
    assert state.index.blocks_of(A) == {0, 1, 2, 3}  # the leading blocks, inserted last
    # A setting overrides what replicas report.
    pinned = fleet(index_blocks_per_replica=2)
    pinned.on_stats(A, RoutingStats(figures), now=1)
    assert pinned.index.bound(A) == 2
