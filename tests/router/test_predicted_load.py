"""The router's predicted-tokens load signal (load_signal predicted_tokens): a replica's load is the
output its length predictor says its requests have left, not how many requests it holds; with no
estimate it is exactly the request count of today."""

from __future__ import annotations

import math

import pytest

from router.config import RoutingConfig
from router.fleet import FleetState
from router.loads import LoadTracker
from router.policies import RouteRequest
from router.stats import RoutingStats
from scheduler.predicted_load import PredictedLoad
from tests.router.scaffold import report

A, B = "a", "b"
PER_REQUEST = 100  # predicted_tokens_per_request of these tests


def predicted(num_running: int, tokens: int | None, sized: int | None = None) -> RoutingStats:
    """A report of num_running requests, `sized` of them (all by default) predicted to have
    `tokens` output tokens left in all; tokens None: the report carries no prediction."""
    stats = report(num_running=num_running)
    if tokens is None:
        return stats
    sized = num_running if sized is None else sized
    return RoutingStats(stats.scheduler, stats.state, predicted=PredictedLoad(tokens, sized))


def tracker(signal: str) -> LoadTracker:
    return LoadTracker(10**9, 0.0, 30, signal, PER_REQUEST)


@pytest.mark.parametrize(
    "field,value",
    [
        ("load_signal", "tokens"),
        ("load_signal", ""),
        ("predicted_tokens_per_request", 0),
        ("predicted_tokens_per_request", -1),
        ("predicted_tokens_per_request", 2**64),
        ("predicted_tokens_per_request", math.nan),
    ],
)
def test_the_settings_refuse_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        RoutingConfig(**{field: value})
    with pytest.raises(ValueError, match=f"router_kwargs.{field}"):
        RoutingConfig.from_router_kwargs({field: value})


def test_the_signal_is_off_by_default():
    assert RoutingConfig().load_signal == "requests"


def test_fewer_but_longer_requests_weigh_more_under_predicted_tokens():
    # A: 2 requests with 900 tokens left; B: 6 requests with 60 left.
    by_requests, by_tokens = tracker("requests"), tracker("predicted_tokens")
    for loads in (by_requests, by_tokens):
        loads.report(A, predicted(2, 900))
        loads.report(B, predicted(6, 60))
    assert by_requests.load(A) < by_requests.load(B)
    assert by_tokens.load(A) > by_tokens.load(B)
    assert by_tokens.load(A) == pytest.approx(900 / PER_REQUEST)


@pytest.mark.parametrize("no_estimate", [predicted(5, None), predicted(5, 0, sized=0)])
def test_without_an_estimate_the_load_is_the_request_count_of_today(no_estimate):
    by_requests, by_tokens = tracker("requests"), tracker("predicted_tokens")
    for loads in (by_requests, by_tokens):
        loads.report(A, no_estimate)
        loads.start("r1", A, 0, now=0, confirmed=True)
    assert by_tokens.load(A) == by_requests.load(A) == 5


def test_requests_without_an_estimate_count_one_per_request_estimate_each():
    loads = tracker("predicted_tokens")
    loads.report(A, predicted(4, 300, sized=1))  # 3 requests the predictor could not size
    assert loads.load(A) == pytest.approx(300 / PER_REQUEST + 3)


def test_requests_sent_since_the_last_report_count_until_the_next_one():
    loads = tracker("predicted_tokens")
    loads.report(A, predicted(1, 50))
    loads.start("r1", A, 0, now=0, confirmed=False)
    loads.start("r2", A, 0, now=0, confirmed=True)
    assert loads.load(A) == pytest.approx(0.5 + 2)
    loads.finish("r1")
    assert loads.load(A) == pytest.approx(0.5 + 1)
    loads.report(A, predicted(2, 250))  # r2 is in it now
    assert loads.load(A) == pytest.approx(2.5)
    loads.finish("r2")  # started before the report: the next report shows it gone
    assert loads.load(A) == pytest.approx(2.5)


def test_the_prediction_crosses_serve_as_plain_fields_and_bad_ones_are_named():
    stats = predicted(3, 700)
    sent = stats.to_dict()
    assert (sent["predicted_remaining_tokens"], sent["predicted_requests"]) == (700, 3)
    assert RoutingStats.from_dict(sent) == stats
    assert "predicted_remaining_tokens" not in predicted(3, None).to_dict()
    for key, value in [("predicted_remaining_tokens", -1), ("predicted_requests", 1.5)]:
        with pytest.raises(ValueError, match=key):
            RoutingStats.from_dict({**sent, key: value})
    with pytest.raises(ValueError, match="predicted_requests"):
        RoutingStats.from_dict({k: v for k, v in sent.items() if k != "predicted_requests"})


def test_the_fleet_router_routes_by_the_signal_it_is_given():
    def choice(signal: str) -> str:
        fleet = FleetState(
            RoutingConfig(
                router_policy="least_loaded",
                load_signal=signal,
                predicted_tokens_per_request=PER_REQUEST,
                kv_usage_weight=0,
            )
        )
        fleet.on_stats(A, predicted(2, 900), now=0)
        fleet.on_stats(B, predicted(6, 60), now=0)
        return fleet.route(RouteRequest("q"), [A, B], now=0)[0]

    assert choice("requests") == A
    assert choice("predicted_tokens") == B
