"""The output-length predictor: conditioning on tokens generated, backoff, bounds, determinism and
the fallbacks that keep a broken predictor from failing a request."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import EngineRequest, Request, RequestStatus, SamplingParams
from scheduler.length_prediction import (
    LengthEstimate,
    LengthFeatures,
    LengthPredictor,
    PredictorConfig,
    safe_observe,
    safe_predict,
)

CHAT = LengthFeatures(prompt_len=100, max_tokens=1000, tenant="a")


def test_a_cold_predictor_has_no_estimate():
    assert LengthPredictor().predict(CHAT) is None


def test_the_remaining_length_is_conditioned_on_what_was_generated():
    p = LengthPredictor(PredictorConfig(min_samples=4))
    for n in [10] * 10 + [100] * 10:
        p.observe(CHAT, n)
    assert p.predict(CHAT) == LengthEstimate(10, 100)
    # Past 50 tokens only the long answers remain: 50 more.
    assert p.predict(CHAT, generated=50) == LengthEstimate(50, 50)
    # Past every length seen: as many again as generated, capped by what max_tokens leaves.
    assert p.predict(CHAT, generated=200) == LengthEstimate(200, 400)
    assert p.predict(CHAT, generated=900) == LengthEstimate(100, 100)


def test_a_group_with_too_few_lengths_backs_off_to_a_coarser_one():
    p = LengthPredictor(PredictorConfig(min_samples=3))
    other = LengthFeatures(prompt_len=100, max_tokens=1000, tenant="b")
    for _ in range(5):
        p.observe(CHAT, 10)
    p.observe(other, 500)
    assert p.predict(other).median == 10  # b's one length is too few: everyone's median
    for _ in range(2):
        p.observe(other, 500)
    assert p.predict(other).median == 500  # now b's own


def test_bad_settings_are_refused_naming_the_field():
    for field, value in [
        ("quantile", math.nan),
        ("quantile", 1.0),
        ("window", 0),
        ("window", 2**64),
        ("max_groups", -1),
        ("min_samples", 100_000),
    ]:
        with pytest.raises(ValueError, match=field):
            PredictorConfig(**{field: value})


features = st.builds(
    LengthFeatures,
    prompt_len=st.integers(1, 5000),
    max_tokens=st.integers(1, 5000),
    tenant=st.sampled_from(["a", "b", "c", "d"]),
    structured=st.sampled_from(["", "json_schema", "choice"]),
    chat=st.booleans(),
)
observations = st.lists(st.tuples(features, st.integers(-1, 5000)), max_size=60)


@settings(max_examples=100, deadline=None)
@given(obs=observations, query=features, generated=st.integers(0, 6000))
def test_memory_and_estimates_stay_within_bounds(obs, query, generated):
    cfg = PredictorConfig(window=4, max_groups=6, min_samples=2)
    p = LengthPredictor(cfg)
    for f, n in obs:
        p.observe(f, n)
        assert p.num_lengths() <= cfg.max_groups * cfg.window
    estimate = p.predict(query, generated)
    if estimate is not None:
        left = max(1, query.max_tokens - generated)
        assert 0 < estimate.median <= estimate.upper <= left


@settings(max_examples=50, deadline=None)
@given(obs=observations, query=features, generated=st.integers(0, 6000))
def test_the_same_observations_give_the_same_estimates(obs, query, generated):
    a, b = LengthPredictor(), LengthPredictor()
    for f, n in obs:
        a.observe(f, n)
        b.observe(f, n)
    assert a.predict(query, generated) == b.predict(query, generated)


def request(rid: str = "r", max_tokens: int = 50) -> Request:
    return Request(EngineRequest(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens)))


class Broken:
    def predict_request(self, request: Request) -> LengthEstimate | None:
        raise RuntimeError("broken")

    def observe_request(self, request: Request) -> None:
        raise RuntimeError("broken")


class NotANumber:
    def predict_request(self, request: Request) -> LengthEstimate | None:
        return LengthEstimate(math.nan, math.nan)

    def observe_request(self, request: Request) -> None:
        pass


def test_a_broken_predictor_gives_no_estimate_and_raises_nothing():
    assert safe_predict(Broken(), request()) is None
    assert safe_predict(NotANumber(), request()) is None
    assert safe_predict(None, request()) is None
    safe_observe(Broken(), request())


def test_only_requests_that_ran_to_their_end_are_learnt():
    p = LengthPredictor()
    done, aborted = request("a"), request("b")
    done.output_token_ids.extend([5] * 7)
    aborted.output_token_ids.extend([5] * 3)
    done.status = RequestStatus.FINISHED_STOPPED
    aborted.status = RequestStatus.FINISHED_ABORTED
    p.observe_request(aborted)
    assert p.num_observed == 0
    p.observe_request(done)
    assert p.predict_request(request("c")) == LengthEstimate(7, 7)
