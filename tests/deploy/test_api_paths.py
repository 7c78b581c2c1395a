"""Errors the routes never see, in OpenAI's shape: an unknown path (404), a method a path does not
take (405), and a prompt too long by itself, named as the prompt rather than max_tokens."""

from __future__ import annotations

import httpx
import pytest

from tests.deploy.conftest import SMOL


@pytest.fixture(scope="module")
def smol(smol_url):
    with httpx.Client(base_url=smol_url, timeout=120) as c:
        yield c


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    return body["error"]


def test_an_unknown_path_is_openai_error_json(smol, smol_url):
    err = _error(smol.get("/nothing-here"), 404)
    assert err == {
        "message": "Invalid URL (GET /v1/nothing-here)",
        "type": "invalid_request_error",
        "param": None,
        "code": "unknown_url",
    }
    err = _error(httpx.post(smol_url.removesuffix("/v1") + "/v2/chat", json={}), 404)
    assert err["message"] == "Invalid URL (POST /v2/chat)"


def test_a_method_the_path_does_not_take_is_405_with_allow(smol):
    response = smol.delete("/models")
    err = _error(response, 405)
    assert err["message"] == "Method not allowed (DELETE /v1/models)"
    assert err["code"] == "method_not_allowed"
    assert response.headers["allow"] == "GET"


def test_a_prompt_too_long_by_itself_is_named_as_the_prompt(smol):
    err = _error(smol.post("/completions", json={"model": SMOL, "prompt": [42] * 3000}), 400)
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    assert err["message"] == (
        "This model's maximum context length is 2048 tokens. However, your prompt resulted in "
        "3000 tokens. Please reduce the length of the prompt."
    )
    messages = [{"role": "user", "content": "word " * 3000}]
    err = _error(smol.post("/chat/completions", json={"model": SMOL, "messages": messages}), 400)
    assert err["param"] == "messages" and err["code"] == "context_length_exceeded"
    assert "However, your messages resulted in" in err["message"]
    # A prompt that fits, with max_tokens past the context, is still max_tokens' fault.
    body = {"model": SMOL, "prompt": [42] * 2000, "max_tokens": 100}
    assert _error(smol.post("/completions", json=body), 400)["param"] == "max_tokens"
