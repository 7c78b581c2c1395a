"""One declaration of the sampling bounds: the HTTP schema only parses, SamplingParams decides, and
both paths refuse the same values with a 400 naming the field as the client sent it."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from deploy.errors import error_response
from deploy.schemas import ChatCompletionRequest, CompletionRequest
from scheduler.sampling_params import SamplingParams

FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
)
HOSTILE = [2**64, -(2**64), -1, math.nan, math.inf, -math.inf, 10**400, 1e308, "x" * 10_000_000]
IN_RANGE_MINUS_ONE = ("top_k", "presence_penalty", "frequency_penalty")


def _http_error(body: dict, chat: bool = False) -> dict | None:
    """The OpenAI error a body gets from the schema, or None when it parses."""
    schema = ChatCompletionRequest if chat else CompletionRequest
    base = (
        {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        if chat
        else {
            "model": "m",
            "prompt": "x",
        }
    )
    try:
        schema.model_validate({**base, **body})
    except ValidationError as exc:
        response = error_response(exc)
        assert response.status_code == 400
        return json.loads(response.body)["error"]
    return None


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("value", HOSTILE, ids=lambda v: repr(v)[:12])
def test_both_paths_refuse_a_hostile_value_naming_the_field(field, value):
    if value == -1 and field in IN_RANGE_MINUS_ONE:
        return
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**{field: value})
    error = _http_error({field: value})
    assert error is not None and error["param"] == field
    assert len(error["message"]) < 300


@pytest.mark.parametrize(
    "body, param",
    [
        ({"temperature": 2.5}, "temperature"),
        ({"repetition_penalty": 150}, "repetition_penalty"),
        ({"repetition_penalty": 1e-46}, "repetition_penalty"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"seed": 2**63 - 1, "n": 2}, "seed"),  # the second choice's seed is past the range
    ],
)
def test_the_schema_refuses_what_sampling_params_refuses(body, param):
    error = _http_error(body)
    assert error is not None and error["param"] == param


@pytest.mark.parametrize(
    "body, param",
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 2**64}, "max_tokens"),
        ({"temperature": math.nan}, "temperature"),
    ],
)
def test_chat_names_the_field_as_the_client_sent_it(body, param):
    error = _http_error(body, chat=True)
    assert error is not None and error["param"] == param


@given(
    st.sampled_from(FIELDS),
    st.one_of(st.integers(), st.floats(), st.booleans(), st.text(max_size=4)),
)
def test_a_value_parsed_over_http_is_taken_exactly_when_sampling_params_takes_it(field, value):
    error = _http_error({field: value})
    try:  # what the schema hands over once the JSON value has the field's type
        parsed = TypeAdapter(
            CompletionRequest.model_fields[field].annotation, config={"allow_inf_nan": False}
        ).validate_python(value)
    except ValidationError:
        assert error is not None and error["param"] == field
        return
    try:
        SamplingParams(**{field: parsed})
    except ValueError:
        assert error is not None and error["param"] == field
        return
    assert error is None


def test_a_tiny_temperature_parses_and_is_greedy():
    body = CompletionRequest.model_validate({"model": "m", "prompt": "x", "temperature": 1e-46})
    assert body.sampling_params(max_tokens=4, logprobs=None).greedy
