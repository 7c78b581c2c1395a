"""Peer-to-peer prefix pulls, the router's part (router/peer_pull.py, router/fleet.py `plan`): a
request that load sends away from the replica holding its prefix carries a pull from that peer
when the peer's KV events (in sync) show it holds at least min_pull_blocks more than the chosen
replica; the cost model weighs the bytes against the prefill; a later request routed to the
same replica joins a pull in flight there instead of moving the same blocks again, until the
replica's events show them, the pull times out or its request completes; every bound is
checked."""

from __future__ import annotations

import math

import pytest

from router.config import RoutingConfig
from router.kv_events import KVIndex, TierRun
from router.peer_pull import MAX_PULL_BLOCKS, PeerPull, PullCost, PullsInFlight, plan_pull
from router.policies import RouteRequest
from router.stats import RoutingStats
from scheduler.kv_events import DEVICE, STORED, KVEventBatch, KVEventReport, KVEventTail, KVSnapshot
from tests.router.scaffold import busy, fleet, report

A, B = "a", "b"
CONTEXT = list(range(100, 112))  # 12 blocks


def events(state, replica: str, device=(), seq: int = 1) -> None:
    stats = RoutingStats(
        report().scheduler, kv_events=KVEventReport([], KVSnapshot(seq, list(device)), seq)
    )
    state.on_stats(replica, RoutingStats.from_dict(stats.to_dict()), 0.0)


def routed(state, hashes, rid: str = "q", now: float = 1.0):
    return state.plan(RouteRequest(rid, 0, list(hashes)), [A, B], now)


def spilled_to_b(**config):
    """A fleet where A holds the context and is past the load ceiling: forks go to B and pull."""
    state = fleet(peer_pulls=True, imbalance_threshold=1, imbalance_ratio=1, **config)
    events(state, A, CONTEXT)
    events(state, B)
    busy(state, A, 6)
    return state


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


def test_two_forks_spilled_to_one_replica_plan_one_pull_the_second_joins_it():
    """The second fork's missing prefix is the first's pull in flight to B: it carries that pull,
    marked joined (B waits for it rather than asking A again), and nothing new is recorded."""
    state = spilled_to_b()
    first = routed(state, CONTEXT + [1], "q1")
    second = routed(state, CONTEXT + [2], "q2")
    assert first.ranking[0] == second.ranking[0] == B
    assert first.pull == PeerPull(A, tuple(CONTEXT), 0) and not first.joined
    assert second.pull is first.pull and second.joined
    assert len(state.pulls) == 1 and state.pulls.num_blocks(B) == 12
    assert state.pulls.num_joined == 1


def test_once_the_events_show_the_blocks_stored_the_entry_clears_and_a_fork_pulls_nothing():
    state = spilled_to_b()
    routed(state, CONTEXT + [1], "q1")
    # A request's last output carries B's events: the context stored on its device.
    batch = KVEventBatch(2, [(STORED, DEVICE, h) for h in CONTEXT])
    state.on_kv_tail(KVEventTail(B, [batch], 2), 1.5)
    assert len(state.pulls) == 0 and state.pulls.num_blocks(B) == 0
    third = routed(state, CONTEXT + [3], "q3", now=1.6)
    assert third.pull is None and not third.joined


def test_a_pull_in_flight_expires_after_its_timeout_then_a_fork_pulls_again():
    state = spilled_to_b(pull_timeout_s=2.0)
    first = routed(state, CONTEXT + [1], "q1", now=1.0)
    assert routed(state, CONTEXT + [2], "q2", now=2.9).joined  # 1.9 s: still in flight
    # Past 1.0 + 2.0 s the replica gave up on the peer and computed: a new fork pulls anew.
    late = routed(state, CONTEXT + [3], "q3", now=3.0)
    assert late.pull == first.pull and late.pull is not first.pull and not late.joined
    assert len(state.pulls) == 1  # q3's own


def test_a_pull_ends_with_its_request_and_the_next_fork_pulls_for_itself():
    """A failed or finished first request leaves nothing to join: the next fork's own pull is its
    fallback (and if that fails too, it computes, as any failed pull does)."""
    for end in ("completed", "failed"):
        state = spilled_to_b()
        routed(state, CONTEXT + [1], "q1")
        state.on_routed(RouteRequest("q1", 0, CONTEXT + [1]), B, 1.0)
        if end == "completed":
            state.on_completed("q1", 1.2)
        else:
            assert state.on_outcome("q1", ok=False, now=1.2) == B
        assert len(state.pulls) == 0, end
        second = routed(state, CONTEXT + [2], "q2", now=1.3)
        assert second.pull == PeerPull(A, tuple(CONTEXT), 0) and not second.joined, end


def test_removing_a_replica_forgets_the_pulls_to_it_and_from_it():
    state = spilled_to_b()
    routed(state, CONTEXT + [1], "q1")
    state.remove_replica(B)
    assert len(state.pulls) == 0 and state.pulls.num_blocks(B) == 0
    pulls = PullsInFlight()
    pulls.record("q1", B, PeerPull(A, tuple(CONTEXT)), 10.0)
    pulls.record("q2", "c", PeerPull(B, tuple(CONTEXT)), 10.0)
    pulls.remove_replica(A)  # the peer of q1's pull: its blocks never come
    assert len(pulls) == 1 and pulls.joinable("c", CONTEXT, 0, 0.0) is not None
    assert pulls.joinable(B, CONTEXT, 0, 0.0) is None


def test_a_fork_holding_part_of_the_pull_joins_from_the_block_it_lacks():
    pulls = PullsInFlight()
    pull = PeerPull(A, tuple(CONTEXT), 2)  # moves blocks 2..11
    pulls.record("q1", B, pull, 10.0)
    assert pulls.joinable(B, CONTEXT + [5], 4, 0.0) is pull
    assert pulls.joinable(B, CONTEXT + [5], 0, 0.0) is None  # blocks 0-1 are not on their way
    assert pulls.joinable(B, CONTEXT + [5], 12, 0.0) is None  # past the pull: its own blocks
    assert pulls.joinable("c", CONTEXT, 2, 0.0) is None  # in flight to B, not to c


def test_the_entries_per_replica_are_bounded_the_oldest_pulls_go_first():
    pulls = PullsInFlight(max_blocks_per_replica=20)
    pulls.record("q1", B, PeerPull(A, tuple(range(0, 12))), 10.0)
    pulls.record("q2", B, PeerPull(A, tuple(range(100, 112))), 10.0)  # 24 > 20: q1 goes
    assert len(pulls) == 1 and pulls.num_blocks(B) == 12
    assert pulls.joinable(B, list(range(12)), 0, 0.0) is None
    assert pulls.joinable(B, list(range(100, 112)), 0, 0.0) is not None
    pulls.record("q3", "c", PeerPull(A, tuple(range(0, 12))), 10.0)  # each replica its own bound
    assert len(pulls) == 2


@pytest.mark.parametrize("value", [2**64, -1, float("nan"), 1 << 30, 0, True])
def test_the_bound_on_pulls_in_flight_refuses_values_out_of_bounds(value):
    with pytest.raises(ValueError, match="max_blocks_per_replica"):
        PullsInFlight(value)


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
