"""SamplingParams owns every bound of a request's sampling fields: no value that passes it can fail
a batch, and one that does not is refused naming its field (the HTTP schema hands values here)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler.sampling_params import (
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    SamplingParams,
)

HUGE_STRING = "x" * 10_000_000
HOSTILE = [2**64, 2**63, -1, -(2**64), math.nan, math.inf, -math.inf, 10**400, 1e308, HUGE_STRING]
NUMBERS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "n",
)
# The documented range of each numeric field (inclusive ends).
RANGES = {
    "max_tokens": (1, 2**31 - 1),
    "temperature": (0.0, MAX_TEMPERATURE),
    "top_p": (math.ulp(0.0), 1.0),
    "top_k": (-1, 2**31 - 1),  # -1 and 0: off
    "min_p": (0.0, 1.0),
    "seed": (0, 2**63 - 1),
    "repetition_penalty": (MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "logprobs": (0, 20),
    "n": (1, 128),
}


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", 2**63),
        ("top_k", -2),
        ("seed", 2**63),
        ("seed", -1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", 2.000001),
        ("temperature", -1e-46),
        ("top_p", float("nan")),
        ("repetition_penalty", float("inf")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 1e-46),  # 0 in float32: logits divided by it overflow
        ("repetition_penalty", 100.5),
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("max_tokens", True),
        ("max_tokens", 2**64),
        ("logprobs", 21),
        ("n", 129),
        ("stop", ["a", "b", "c", "d", "e"]),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("logit_bias", {1: 101.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {1: float("nan")}),
        ("logit_bias", {1: 10**400}),
    ],
)
def test_sampling_params_reject_out_of_range_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field", NUMBERS)
@pytest.mark.parametrize("value", HOSTILE, ids=lambda v: repr(v)[:12])
def test_hostile_numbers_are_refused_naming_the_field(field, value):
    if value == -1 and RANGES[field][0] <= -1:
        return  # -1 is in range (a penalty) or means "off" (top_k)
    with pytest.raises(ValueError, match=f"^{field}: ") as raised:
        SamplingParams(**{field: value})
    assert len(str(raised.value)) < 200  # a 10 MB value is not echoed back


@given(
    st.sampled_from(NUMBERS),
    st.one_of(
        st.sampled_from(HOSTILE),
        st.integers(),
        st.floats(),
        st.booleans(),
        st.text(max_size=8),
        st.none(),
    ),
)
def test_a_value_is_taken_only_within_its_documented_range(field, value):
    try:
        params = SamplingParams(**{field: value})
    except ValueError as exc:
        assert str(exc).startswith(f"{field}: ")
        return
    kept = getattr(params, field)
    if kept is None:
        assert field in ("seed", "logprobs")
        return
    low, high = RANGES[field]
    assert not isinstance(kept, bool) and low <= kept <= high


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 0.0),
        ("temperature", MAX_TEMPERATURE),
        ("repetition_penalty", MIN_REPETITION_PENALTY),
        ("repetition_penalty", MAX_REPETITION_PENALTY),
        ("presence_penalty", -2.0),
        ("presence_penalty", 2.0),
        ("frequency_penalty", -2.0),
        ("frequency_penalty", 2.0),
        ("top_p", 1.0),
        ("min_p", 1.0),
        ("top_k", -1),
    ],
)
def test_the_openai_ranges_are_accepted_at_their_ends(field, value):
    kept = 0 if (field, value) == ("top_k", -1) else value  # -1 is OpenAI's spelling of "off"
    assert getattr(SamplingParams(**{field: value}), field) == kept


@pytest.mark.parametrize("temperature", [0.0, 1e-46, 5e-324, MIN_TEMPERATURE / 2])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature):
    assert SamplingParams(temperature=temperature).greedy


@pytest.mark.parametrize("temperature", [MIN_TEMPERATURE, 0.5, MAX_TEMPERATURE])
def test_a_usable_temperature_samples(temperature):
    assert not SamplingParams(temperature=temperature).greedy


def test_vocabulary_bounds_are_checked_against_the_model():
    params = SamplingParams(top_k=50_000, stop_token_ids=[3])
    with pytest.raises(ValueError, match="^top_k"):
        params.check_vocab(49_152)
    with pytest.raises(ValueError, match="^logit_bias"):
        SamplingParams(logit_bias={49_152: 1.0}).check_vocab(49_152)
    SamplingParams(top_k=49_152, logit_bias={49_151: -100.0}).check_vocab(49_152)
