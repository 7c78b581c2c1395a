"""Adapter affinity, without Ray: a LoRA request goes to a replica holding its adapter within the
prefix-affinity load ceiling; a cold adapter goes by load; base requests route as before."""

import copy
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.adapter_affinity import AdapterIndex, routing_lora_key
from router.policies import RouteRequest
from router.stats import RoutingStats
from scheduler.block_hash import hash_prompt_blocks
from scheduler.outputs import SchedulerStats
from tests.router.scaffold import busy, fleet, report

A, B, C = "a", "b", "c"


def holding(*loras: str, num_running: int = 0) -> RoutingStats:
    """An OK report of a replica with these adapters in its device slots."""
    stats = report(num_running=num_running)
    return dataclasses.replace(
        stats, scheduler=dataclasses.replace(stats.scheduler, loaded_loras=loras)
    )


def lora(request_id: str, name: str | None, hashes=()) -> RouteRequest:
    return RouteRequest(request_id, 10, list(hashes), name)


def test_a_replica_that_holds_the_adapter_wins_within_the_ceiling():
    state = fleet(imbalance_threshold=4)
    state.on_stats(B, holding("x"), now=0)
    busy(state, B, 3)
    busy(state, C, 1)  # mean 1.33, ceiling 5.33: B is within it
    assert state.route(lora("q", "x"), [A, B, C], now=0)[0] == B
    # The base model sees no affinity: the least loaded replica.
    assert state.route(lora("q2", None), [A, B, C], now=0)[0] == A


def test_a_holder_past_the_ceiling_yields_to_the_least_loaded():
    state = fleet(imbalance_threshold=2, imbalance_ratio=1.0)
    state.on_stats(B, holding("x"), now=0)
    busy(state, B, 9)
    busy(state, C, 1)  # mean 3.33, ceiling 5.33
    assert state.route(lora("q", "x"), [A, B, C], now=0)[0] == A


def test_cold_adapters_spread_by_load_and_a_burst_follows_its_first_member():
    state = fleet()
    busy(state, A, 2)
    first = state.choose(lora("q0", "cold"), [A, B, C], now=0)
    assert first in (B, C)
    # Until a report says otherwise the first member's replica is loading the adapter: the rest of
    # the burst goes there while it stays within the ceiling.
    state.on_routed(lora("q0", "cold"), first, now=0)
    assert state.choose(lora("q1", "cold"), [A, B, C], now=0) == first
    # Different cold adapters take turns over the idle replicas.
    picks = {state.choose(lora(f"n{i}", f"other{i}"), [A, B, C], now=0) for i in range(2)}
    assert A not in picks


def test_a_planted_adapter_outlives_reports_lacking_it_only_for_the_grace_window():
    state = fleet(stats_grace_s=5.0)
    state.on_routed(lora("q", "x"), A, now=0)
    state.on_stats(A, holding(), now=3)
    assert state.adapters.holds(A, "x")
    state.on_stats(A, holding("y"), now=6)
    assert not state.adapters.holds(A, "x") and state.adapters.holds(A, "y")
    state.on_stats(A, holding(), now=7)  # unloaded since
    assert state.adapters.adapters_of(A) == set()


def test_the_longest_prefix_run_among_holders_wins():
    state = fleet()
    for r in (A, B, C):
        state.on_stats(r, holding("x") if r != A else holding(), now=0)
    state.index.insert(A, [1, 2, 3], now=0)  # longest run, but A lacks the adapter
    state.index.insert(C, [1, 2], now=0)
    assert state.route(lora("q", "x", [1, 2, 3]), [A, B, C], now=0)[0] == C


def test_adapter_affinity_off_routes_as_prefix_affinity_alone():
    state = fleet(adapter_affinity=False)
    state.on_stats(B, holding("x"), now=0)
    busy(state, B, 1)
    busy(state, C, 2)
    assert state.route(lora("q", "x"), [A, B, C], now=0)[0] == A


def test_a_removed_replica_is_forgotten():
    state = fleet()
    state.on_stats(A, holding("x"), now=0)
    state.on_routed(lora("q", "y"), A, now=0)
    state.retain([B])
    assert state.adapters.replicas() == set()


def test_loaded_loras_travel_through_the_report_dict():
    stats = holding("x", "tenant-7.summarise")
    sent = stats.to_dict()
    assert sent["loaded_loras"] == ["x", "tenant-7.summarise"]
    assert RoutingStats.from_dict(sent) == stats
    del sent["loaded_loras"]  # a replica without LoRA support
    assert RoutingStats.from_dict(sent).scheduler.loaded_loras == ()


@pytest.mark.parametrize(
    "value",
    [
        2**64,
        -1,
        float("nan"),
        "x" * 10_000_000,
        ["x" * 10_000_000],
        [""],
        [7],
        [None],
        ["a"] * 100_000,
    ],
)
def test_a_malformed_loaded_loras_is_refused_by_name(value):
    sent = {**holding().to_dict(), "loaded_loras": value}
    with pytest.raises(ValueError, match="routing stats field 'loaded_loras'"):
        RoutingStats.from_dict(sent)


# ---------------------------------------------------------------- properties over random fleets

NAMES = ["r0", "r1", "r2", "r3"]
ADAPTERS = ["x", "y", "z"]

events = st.lists(
    st.one_of(
        st.tuples(st.just("busy"), st.sampled_from(NAMES), st.integers(1, 6)),
        st.tuples(
            st.just("stats"),
            st.sampled_from(NAMES),
            st.lists(st.sampled_from(ADAPTERS), max_size=2, unique=True),
        ),
        st.tuples(st.just("prefix"), st.sampled_from(NAMES), st.integers(1, 3)),
    ),
    max_size=20,
)


def _apply(state, ops) -> None:
    for t, op in enumerate(ops):
        if op[0] == "busy":
            busy(state, op[1], op[2], now=t)
        elif op[0] == "stats":
            state.on_stats(op[1], holding(*op[2]), now=t)
        else:
            state.index.insert(op[1], list(range(op[2])), now=t)


@settings(max_examples=100, deadline=None)
@given(ops=events, adapter=st.sampled_from(ADAPTERS), hashes=st.integers(0, 3))
def test_the_choice_holds_the_adapter_if_any_acceptable_replica_does(ops, adapter, hashes):
    """Whatever the loads, prefixes and reports: the choice is within the load ceiling; it holds
    the adapter when a replica within the ceiling does, and is the least loaded otherwise."""
    state = fleet(imbalance_threshold=2.0, imbalance_ratio=1.2)
    _apply(state, ops)
    loads = {r: state.loads.load(r) for r in NAMES}
    mean = sum(loads.values()) / len(loads)
    ceiling = max(mean + 2.0, mean * 1.2)
    holders = [r for r in NAMES if loads[r] <= ceiling and state.adapters.holds(r, adapter)]
    choice = state.choose(lora("q", adapter, range(hashes)), NAMES, now=100)
    assert loads[choice] <= ceiling
    if holders:
        assert choice in holders
    else:
        assert loads[choice] == min(loads.values())


@settings(max_examples=100, deadline=None)
@given(ops=events, hashes=st.integers(0, 3), n=st.integers(1, 4))
def test_base_requests_route_as_if_no_adapter_were_loaded(ops, hashes, n):
    """Adapter reports change nothing for the base model: the same choices as a fleet whose
    replicas report no adapters."""
    with_adapters = fleet()
    _apply(with_adapters, ops)
    without = fleet()
    _apply(without, [op if op[0] != "stats" else (*op[:2], []) for op in ops])
    for i in range(n):
        request = lora(f"q{i}", None, range(hashes))
        assert with_adapters.route(request, NAMES, now=100) == without.route(
            request, NAMES, now=100
        )


def test_the_index_is_copied_with_the_fleet():
    """route() tests compare a deep copy's choice with the state's: the index must copy."""
    index = AdapterIndex()
    index.plant(A, "x", 0.0)
    twin = copy.deepcopy(index)
    index.remove_replica(A)
    assert twin.holds(A, "x") and not index.holds(A, "x")


def test_scheduler_stats_default_to_no_adapters():
    assert SchedulerStats(0, 0, 0, 0.0, 0.0, 0).loaded_loras == ()


# ---------------------------------------------------------------- adapter identities and prefixes


def test_lora_identities_travel_through_the_report_dict():
    stats = holding("x")
    stats = dataclasses.replace(
        stats, scheduler=dataclasses.replace(stats.scheduler, lora_identities=("x@ab12", "y@cd"))
    )
    sent = stats.to_dict()
    assert sent["lora_identities"] == ["x@ab12", "y@cd"]
    assert RoutingStats.from_dict(sent) == stats
    del sent["lora_identities"]  # a replica of an older release
    assert RoutingStats.from_dict(sent).scheduler.lora_identities == ()


@pytest.mark.parametrize(
    "value", [2**64, -1, float("nan"), ["x"], ["x@"], ["@ab"], ["x@" + "a" * 10_000_000], [7]]
)
def test_a_malformed_lora_identity_is_refused_by_name(value):
    sent = {**holding().to_dict(), "lora_identities": value}
    with pytest.raises(ValueError, match="routing stats field 'lora_identities'"):
        RoutingStats.from_dict(sent)


def test_an_adapter_request_is_hashed_under_the_identity_a_replica_reports():
    assert routing_lora_key("x", ["y@11", "x@22"]) == "x@22"
    assert routing_lora_key("x", ["xy@33"]) == "x"  # another adapter's name only begins alike
    assert routing_lora_key("x", []) == "x"  # no replica reported it yet: the name
    assert routing_lora_key(None, ["x@22"]) is None


def test_the_router_matches_an_adapter_prefix_that_a_replica_cached_under_its_identity():
    """The replica's cache keys an adapter's blocks by identity (engine/loras.py); the ingress,
    hashing under the identity the replica reports, finds that replica; hashed by name it would
    not."""
    prompt = list(range(100, 164))
    cached = hash_prompt_blocks(prompt, 16, lora_name="x@22")
    state = fleet()
    state.on_stats(A, holding("x"), now=0)
    state.index.insert(A, cached, now=0)
    key = routing_lora_key("x", ["x@22"])
    assert state.index.match(hash_prompt_blocks(prompt, 16, lora_name=key), [A, B]) == {A: 4, B: 0}
    by_name = hash_prompt_blocks(prompt, 16, lora_name="x")
    assert state.index.match(by_name, [A, B]) == {A: 0, B: 0}
