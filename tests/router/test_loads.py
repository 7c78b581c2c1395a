"""The router's load accounting: its own exact in-flight counts combined with the replicas' late
reports."""

import pytest

from router.loads import LoadTracker
from tests.router.scaffold import report

A, B = "a", "b"


def test_load_counts_own_inflight_requests_and_tokens():
    loads = LoadTracker(tokens_per_request=1000, kv_usage_weight=1.0, unconfirmed_ttl_s=30)
    loads.start("r1", A, num_tokens=500, now=0, confirmed=True)
    loads.start("r2", A, num_tokens=1500, now=0, confirmed=True)
    assert loads.get(A).inflight_requests == 2
    assert loads.load(A) == pytest.approx(2 + 2.0)
    loads.finish("r1")
    assert loads.load(A) == pytest.approx(1 + 1.5)
    loads.finish("r1")  # completing twice (rejected, then completed) is harmless
    assert loads.get(A).inflight_requests == 1


def test_load_takes_the_larger_of_own_counts_and_the_late_report():
    loads = LoadTracker(tokens_per_request=10**9, kv_usage_weight=0.0, unconfirmed_ttl_s=30)
    loads.start("r1", A, 0, now=0, confirmed=True)
    loads.report(A, report(num_waiting=3, num_running=4, kv_cache_usage=0.5))
    assert loads.load(A) == 7  # other routers' traffic shows up only in the report
    for i in range(9):
        loads.start(f"x{i}", A, 0, now=0, confirmed=True)
    assert loads.load(A) == 10  # the report is stale: own in-flight count is larger


def test_load_adds_kv_cache_usage_within_zero_and_one():
    loads = LoadTracker(tokens_per_request=1000, kv_usage_weight=2.0, unconfirmed_ttl_s=30)
    loads.report(A, report(num_running=1, kv_cache_usage=0.25))
    assert loads.load(A) == pytest.approx(1.5)
    loads.report(A, report(num_running=1, kv_cache_usage=3.0))
    assert loads.load(A) == pytest.approx(3.0)


def test_a_report_that_is_not_ok_marks_the_replica_unhealthy_until_an_ok_one():
    loads = LoadTracker(1000, 0.0, 30)
    for state in ("failed", "stalled", "draining"):
        loads.report(A, report(state=state))
        assert not loads.is_healthy(A) and loads.unhealthy == {A}
        loads.report(A, report())
        assert loads.is_healthy(A) and not loads.unhealthy


def test_moving_a_request_recharges_the_new_replica():
    loads = LoadTracker(1000, 0.0, 30)
    loads.start("r1", A, 100, now=0, confirmed=False)
    loads.start("r1", B, 100, now=0, confirmed=True)
    assert (loads.get(A).inflight_requests, loads.get(B).inflight_requests) == (0, 1)
    assert loads.get(A).inflight_tokens == 0


def test_unconfirmed_decisions_expire_confirmed_ones_do_not():
    loads = LoadTracker(1000, 0.0, unconfirmed_ttl_s=10)
    loads.start("cancelled", A, 0, now=0, confirmed=False)
    loads.start("running", A, 0, now=0, confirmed=True)
    loads.expire(now=5)
    assert loads.get(A).inflight_requests == 2
    loads.expire(now=11)
    assert loads.get(A).inflight_requests == 1
    assert loads.num_inflight() == 1


def test_a_removed_replica_leaves_no_load_and_no_requests():
    loads = LoadTracker(1000, 1.0, 30)
    loads.start("r1", A, 100, now=0, confirmed=True)
    loads.report(A, report(num_running=2, kv_cache_usage=0.5, state="draining"))
    loads.remove_replica(A)
    assert loads.load(A) == 0.0 and loads.is_healthy(A)
    assert loads.replicas() == set() and loads.num_inflight() == 0
    assert loads.loads([A, B]) == [0.0, 0.0]
