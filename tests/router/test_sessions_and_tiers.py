"""Sessions keep an agent's turns on one replica within the load ceiling; replicas whose KV events
are in sync are scored by their exact run, by tier (router/policies.py, router/sessions.py)."""

from __future__ import annotations

import math

import pytest

from router.kv_events import TierRun
from router.policies import PrefixAffinity, RouteRequest
from router.sessions import MAX_SESSION_ID_CHARS, SessionTable, check_session_id
from router.stats import RoutingStats
from scheduler.kv_events import KVEventReport, KVSnapshot
from tests.router.scaffold import busy, fleet, report

A, B, C = "a", "b", "c"


def synced(state, replica: str, device=(), cpu=(), disk=(), now: float = 0.0) -> None:
    """replica's KV events say it holds these hashes (a snapshot, through its stats' dict)."""
    stats = RoutingStats(
        report().scheduler,
        kv_events=KVEventReport([], KVSnapshot(0, list(device), list(cpu), list(disk))),
    )
    state.on_stats(replica, RoutingStats.from_dict(stats.to_dict()), now)


def turn(state, n: int, session: str = "agent-1", hashes=(), now: float = 0.0) -> str:
    choice = state.choose(
        RouteRequest(f"{session}-turn-{n}", 0, list(hashes), None, session), [A, B, C], now
    )
    assert choice is not None
    return choice


def test_a_sessions_turns_stay_on_its_replica_while_it_is_within_the_ceiling():
    state = fleet(imbalance_threshold=2, imbalance_reference="least")
    first = turn(state, 0)
    state.on_completed("agent-1-turn-0")
    busy(state, first, 2)  # other work there: the busiest, but within the ceiling
    for n in range(1, 4):
        assert turn(state, n) == first
        state.on_completed(f"agent-1-turn-{n}")  # an agent's next turn follows its answer
    assert state.sessions.replica_of("agent-1") == first
    # Another session, no prefix: goes by load, not to the first session's replica.
    assert turn(state, 0, session="agent-2") != first


def test_a_session_spills_when_its_replica_passes_the_ceiling_and_follows_the_spill():
    state = fleet(imbalance_threshold=2, imbalance_reference="least")
    first = turn(state, 0)
    busy(state, first, 3)  # 4 in flight against 0: past least + 2
    second = turn(state, 1)
    assert second != first
    assert state.sessions.replica_of("agent-1") == second  # the context is there now
    assert turn(state, 2) == second


def test_a_session_beats_a_longer_prefix_elsewhere_within_the_ceiling():
    state = fleet(imbalance_threshold=4)
    synced(state, A, device=[1, 2, 3, 4])
    synced(state, B, device=[1])
    state.sessions.record("agent-1", B)
    assert turn(state, 5, hashes=[1, 2, 3, 4]) == B


def test_sessions_are_bounded_least_recently_routed_first_and_forgotten_with_their_replica():
    table = SessionTable(max_sessions=2)
    table.record("s1", A)
    table.record("s2", B)
    table.record("s1", A)  # s1 routed again: s2 is the oldest
    table.record("s3", C)
    assert len(table) == 2 and table.replica_of("s2") is None and table.replica_of("s1") == A
    table.remove_replica(A)
    assert table.replica_of("s1") is None and table.replica_of("s3") == C
    state = fleet()
    turn(state, 0)
    state.remove_replica(state.sessions.replica_of("agent-1"))
    assert state.sessions.replica_of("agent-1") is None


@pytest.mark.parametrize("bad", [2**64, -1, math.nan, "", "x" * (MAX_SESSION_ID_CHARS + 1), None])
def test_a_bad_session_id_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="^session_id"):
        check_session_id(bad)
    if bad is not None:
        with pytest.raises(ValueError, match="^session_id"):
            RouteRequest("r", session=bad)
    assert check_session_id("x" * MAX_SESSION_ID_CHARS) == "x" * MAX_SESSION_ID_CHARS


@pytest.mark.parametrize("bad", [2**64, -1, math.nan, 10**30, 0])
def test_the_session_bound_is_checked(bad):
    with pytest.raises(ValueError, match="^max_sessions"):
        SessionTable(bad)


@pytest.mark.parametrize(
    ("a", "b", "winner"),
    [
        # (device, cpu, disk) runs of A and B over a 4-block prompt
        ((2, 0, 0), (0, 2, 0), A),  # a device block beats a CPU-tier block
        ((0, 2, 0), (0, 0, 2), A),  # a CPU-tier block beats a disk-tier block
        ((1, 0, 0), (0, 3, 0), B),  # 1 < 3 x 0.5
        ((0, 1, 0), (0, 0, 4), B),  # 0.5 < 4 x 0.25
        ((1, 1, 0), (2, 0, 0), B),
    ],
)
def test_an_in_sync_replicas_run_is_scored_by_tier(a, b, winner):
    hashes = [1, 2, 3, 4]
    state = fleet(imbalance_threshold=4, tier_hit_discount=0.5)
    for name, (d, c, k) in ((A, a), (B, b)):
        synced(state, name, hashes[:d], hashes[d : d + c], hashes[d + c : d + c + k])
        assert state.kv.match(hashes, [name])[name] == TierRun(d, c, k)
    policy = PrefixAffinity(imbalance_threshold=4, min_match_blocks=1, tier_hit_discount=0.5)
    assert policy.choose([A, B], RouteRequest("q", 0, hashes), state) == winner


def test_an_in_sync_replica_is_not_credited_with_what_its_events_say_it_evicted():
    """The approximate index still lists a prompt a replica has evicted (planted by routing, within
    the report grace); its KV events say it is gone, so the holder that kept it wins."""
    state = fleet(imbalance_threshold=4)
    state.index.insert(A, [1, 2, 3], now=0.0)  # routed there long ago
    synced(state, A, device=[], now=1.0)  # its events since: nothing held
    synced(state, B, device=[1, 2], now=1.0)
    policy = PrefixAffinity(imbalance_threshold=4, min_match_blocks=1)
    assert policy.choose([A, B], RouteRequest("q", 0, [1, 2, 3]), state) == B


def test_what_routing_planted_since_the_last_events_still_counts():
    """A burst of one prompt follows its first member before the replica's events show it."""
    state = fleet(imbalance_threshold=4)
    synced(state, A, now=1.0)
    synced(state, B, now=1.0)
    first = state.choose(RouteRequest("q1", 0, [7, 8]), [A, B], now=2.0)
    assert state.choose(RouteRequest("q2", 0, [7, 8]), [A, B], now=2.1) == first
