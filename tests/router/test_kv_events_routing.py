"""Routing on KV events when they lag: the prompt of a request in flight is pinned on its replica
whatever events older than its prefill say (router/kv_events.py InFlightPrompts), and a finished
request's blocks stand until newer events come (router/fleet.py on_completed).

Served, the events a router applies were taken up to a report period earlier, often before the
replica computed a prompt routing sent it; these are the cases that split a shared prefix over
both replicas of the served routing tests."""

from __future__ import annotations

from router.kv_events import InFlightPrompts
from router.policies import RouteRequest, expected_runs
from router.stats import RoutingStats
from scheduler.kv_events import KVEventReport, KVSnapshot
from tests.router.scaffold import fleet, report

A, B = "a", "b"
PROMPT = [7, 8, 9]


def events(state, replica: str, seq: int, device=(), now: float = 0.0) -> None:
    """replica's KV events (a snapshot as of batch seq) reach the router at now."""
    stats = RoutingStats(
        report().scheduler, kv_events=KVEventReport([], KVSnapshot(seq, list(device)), seq)
    )
    state.on_stats(replica, RoutingStats.from_dict(stats.to_dict()), now)


def sent(state, request_id: str, hashes, now: float) -> str:
    """Route a request and confirm it as Serve does; the replica it went to."""
    request = RouteRequest(request_id, 0, list(hashes))
    choice = state.choose(request, [A, B], now)
    assert choice is not None
    state.on_routed(request, choice, now)
    return choice


def test_a_prompt_in_flight_stays_on_its_replica_though_older_events_arrive_after_it():
    state = fleet(imbalance_threshold=4)
    events(state, A, 1, now=0.0)
    events(state, B, 1, now=0.0)
    first = sent(state, "q1", PROMPT, now=1.0)
    # Its replica's events, taken before it computed q1, reach the router after q1 was routed.
    events(state, first, 2, device=[], now=1.5)
    assert state.kv.in_sync(first) and state.kv.match(PROMPT, [first])[first].blocks == 0
    assert expected_runs(state, PROMPT, [A, B])[first].blocks == 3
    assert sent(state, "q2", PROMPT, now=1.6) == first


def test_a_finished_requests_blocks_stand_until_events_newer_than_its_finish():
    state = fleet(imbalance_threshold=4)
    events(state, A, 1, now=0.0)
    events(state, B, 1, now=0.0)
    first = sent(state, "q1", PROMPT, now=1.0)
    events(state, first, 2, device=[], now=1.5)  # taken before its prefill
    state.on_completed("q1", now=2.0)
    assert len(state.in_flight) == 0
    assert expected_runs(state, PROMPT, [first])[first].blocks == 3
    # Events after its finish are the truth: here the replica evicted the prompt since.
    events(state, first, 3, device=[], now=2.5)
    assert expected_runs(state, PROMPT, [first])[first].blocks == 0


def test_in_flight_prompts_count_each_request_once_and_forget_a_replica():
    pins = InFlightPrompts()
    pins.start("q1", A, [1, 2, 3])
    pins.start("q2", A, [1, 2])
    pins.start("q3", B, [1])
    assert (pins.run([1, 2, 3, 4], A), pins.run([1, 2, 3], B), len(pins)) == (3, 1, 3)
    assert pins.finish("q1") == (A, (1, 2, 3))
    assert pins.run([1, 2, 3], A) == 2  # q2 still holds its two
    pins.start("q2", B, [1, 2])  # moved: Serve sent it elsewhere
    assert (pins.run([1, 2], A), pins.run([1, 2], B)) == (0, 2)
    assert pins.finish("q9") is None  # never pinned (an unconfirmed choice)
    pins.remove_replica(B)
    assert (len(pins), pins.run([1], B)) == (0, 0)
    pins.start("q4", A, [])  # no full block: nothing to pin
    assert len(pins) == 0
