"""Every bad input gets its HTTP status and OpenAI error JSON, and the server keeps serving."""

import asyncio

import httpx
import pytest

from tests.deploy.conftest import SMOL, TINY, TINY_KEY

pytestmark = pytest.mark.slow


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.fixture(scope="module")
def smol(smol_url):
    with httpx.Client(base_url=smol_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tiny(tiny_url):
    with httpx.Client(
        base_url=tiny_url, timeout=120, headers={"Authorization": f"Bearer {TINY_KEY}"}
    ) as c:
        yield c


def _still_serving(client: httpx.Client, model: str) -> None:
    r = client.post("/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_malformed_json_is_400(smol):
    err = _error(
        smol.post(
            "/completions", content=b"{not json", headers={"content-type": "application/json"}
        ),
        400,
    )
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]
    _still_serving(smol, SMOL)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "logprobs": 50}, "logprobs"),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [5, 10_000_000]}, "prompt"),  # outside the vocabulary: must not reach the model
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": [2**70]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, "echo"),
    ],
)
def test_bad_completion_field_is_400_naming_it(smol, body, param):
    err = _error(smol.post("/completions", json={"model": SMOL, **body}), 400)
    assert err["param"] == param
    _still_serving(smol, SMOL)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 99, "logprobs": True},
            "top_logprobs",
        ),
    ],
)
def test_bad_chat_field_is_400_naming_it(smol, body, param):
    err = _error(smol.post("/chat/completions", json={"model": SMOL, **body}), 400)
    assert err["param"] == param
    _still_serving(smol, SMOL)


# NaN and infinities are not JSON, but Python's json (and so many clients) writes them anyway.
HOSTILE_SAMPLING = [2**64, -1, "NaN", "Infinity", "-Infinity", "1e400", str(10**400)]


@pytest.mark.parametrize(
    "field", ["temperature", "repetition_penalty", "top_p", "max_tokens", "seed"]
)
@pytest.mark.parametrize("value", HOSTILE_SAMPLING)
def test_hostile_sampling_values_are_400_naming_the_field(smol, field, value):
    raw = f'{{"model": "{SMOL}", "prompt": "x", "{field}": {value}}}'
    response = smol.post(
        "/completions", content=raw.encode(), headers={"content-type": "application/json"}
    )
    err = _error(response, 400)
    assert err["param"] == field and len(err["message"]) < 300


def test_the_offline_bounds_hold_over_http(smol):
    # SamplingParams decides for both paths: temperature is OpenAI's [0, 2], the repetition
    # penalty [0.01, 100] (the schema once allowed (0, 100], SamplingParams anything > 0).
    for field, value in (("temperature", 2.5), ("repetition_penalty", 1e-46)):
        err = _error(
            smol.post("/completions", json={"model": SMOL, "prompt": "x", field: value}), 400
        )
        assert err["param"] == field
    _still_serving(smol, SMOL)


def test_a_temperature_too_small_to_divide_by_is_greedy(smol):
    # 1e-46 is 0 in float32: sampled, every logit would be inf and every token id 0.
    def text(temperature: float) -> str:
        body = {"model": SMOL, "prompt": "The capital of France is", "max_tokens": 8}
        r = smol.post("/completions", json={**body, "temperature": temperature})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    assert text(1e-46) == text(0.0)


def test_unknown_model_is_404(smol):
    err = _error(smol.post("/completions", json={"model": "gpt-17", "prompt": "x"}), 404)
    assert err["code"] == "model_not_found" and "gpt-17" in err["message"]


def test_prompt_plus_max_tokens_over_the_context_is_400_with_the_numbers(smol):
    prompt = [42] * 2000
    err = _error(
        smol.post("/completions", json={"model": SMOL, "prompt": prompt, "max_tokens": 100}), 400
    )
    assert err["code"] == "context_length_exceeded"
    assert "2048" in err["message"] and "2100" in err["message"] and "2000" in err["message"]
    err = _error(smol.post("/completions", json={"model": SMOL, "prompt": [42] * 3000}), 400)
    assert "3000" in err["message"]
    # Streaming requests are refused the same way, before any event is sent.
    err = _error(
        smol.post(
            "/completions",
            json={"model": SMOL, "prompt": prompt, "max_tokens": 100, "stream": True},
        ),
        400,
    )
    _still_serving(smol, SMOL)


def test_missing_or_wrong_api_key_is_401(tiny_url, tiny):
    body = {"model": TINY, "prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TINY_KEY}):
        err = _error(httpx.post(f"{tiny_url}/completions", json=body, headers=headers), 401)
        assert err["type"] == "authentication_error"
    _error(httpx.get(f"{tiny_url}/models"), 401)
    root = tiny_url.removesuffix("/v1")
    _error(httpx.get(f"{root}/openapi.json"), 401)  # the schema is behind the key too
    spec = httpx.get(f"{root}/openapi.json", headers={"Authorization": f"Bearer {TINY_KEY}"})
    assert spec.status_code == 200 and "/v1/chat/completions" in spec.json()["paths"]
    _still_serving(tiny, TINY)


def test_overload_is_503_and_the_replica_recovers(tiny_url, tiny):
    # tiny: 2 requests in flight per replica and 2 queued at the ingress; the rest are refused.
    body = {"model": TINY, "prompt": "x", "max_tokens": 200, "ignore_eos": True}

    async def go():
        async with httpx.AsyncClient(
            base_url=tiny_url, timeout=120, headers={"Authorization": f"Bearer {TINY_KEY}"}
        ) as c:
            return await asyncio.gather(*(c.post("/completions", json=body) for _ in range(12)))

    responses = asyncio.run(go())
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and 503 in codes and set(codes) <= {200, 503}
    err = _error(next(r for r in responses if r.status_code == 503), 503)
    assert err["code"] == "overloaded"
    _still_serving(tiny, TINY)


def test_health_and_unknown_route(smol_url):
    assert httpx.get(smol_url.removesuffix("/v1") + "/health").json() == {"status": "ok"}
    assert httpx.get(f"{smol_url}/nothing-here").status_code == 404
