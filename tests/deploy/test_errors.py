"""The one exception-to-status mapping of the HTTP layer, exception by exception."""

import json

import pytest
from pydantic import ValidationError
from ray.serve.exceptions import BackPressureError

from deploy.errors import ContextLengthError, ModelNotFoundError, error_event, error_response
from deploy.schemas import CompletionRequest
from scheduler.sampling_params import SamplingParams


def _mapped(exc: BaseException) -> tuple[int, dict, dict]:
    response = error_response(exc)
    return response.status_code, json.loads(response.body)["error"], dict(response.headers)


def test_validation_error_names_the_nested_field():
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(
            {"model": "m", "prompt": "x", "stream_options": {"include_usage": "maybe"}}
        )
    status, err, _ = _mapped(info.value)
    assert status == 400 and err["param"] == "stream_options.include_usage"


@pytest.mark.parametrize("bad", [2**64, -1, float("nan"), "x" * 10_000_000, [True] * 100_000])
def test_bad_continuous_usage_stats_is_a_400_naming_it(bad):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(
            {"model": "m", "prompt": "x", "stream_options": {"continuous_usage_stats": bad}}
        )
    status, err, _ = _mapped(info.value)
    assert status == 400 and err["param"] == "stream_options.continuous_usage_stats"


def test_value_error_of_our_dataclasses_keeps_its_field():
    with pytest.raises(ValueError) as info:
        SamplingParams(top_k=-5)
    status, err, _ = _mapped(info.value)
    assert (status, err["param"], err["type"]) == (400, "top_k", "invalid_request_error")


def test_context_length_and_model_errors():
    status, err, _ = _mapped(ContextLengthError(100, 90, 20))
    assert status == 400 and err["code"] == "context_length_exceeded" and "110" in err["message"]
    status, err, _ = _mapped(ModelNotFoundError("no such model", param="model"))
    assert status == 404 and err["param"] == "model"


@pytest.mark.parametrize("status, retry_after", [(503, None), (429, 2.5)])
def test_backpressure_keeps_the_configured_status_and_retry_after(status, retry_after):
    code, err, headers = _mapped(
        BackPressureError(
            num_queued_requests=8,
            max_queued_requests=8,
            status_code=status,
            retry_after_s=retry_after,
        )
    )
    assert code == status and err["code"] == "overloaded"
    assert headers.get("retry-after") == ("3" if retry_after else None)


def test_unexpected_errors_are_500_without_internals():
    status, err, _ = _mapped(KeyError("secret internals"))
    assert status == 500 and "secret" not in err["message"]
    assert error_event(KeyError("x"))["error"]["type"] == "internal_error"
