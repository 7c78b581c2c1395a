"""One embeddings request may take at most `max_embedding_tokens` tokens over all its inputs: past
it, a 400 naming `input` before any input reaches the replica; the setting is bounded at the edge.
The shared tiny app sets the bound to 1,024 (tests/deploy/conftest.py)."""

from __future__ import annotations

import httpx
import pytest

from deploy.config import AppConfig
from tests.deploy.conftest import TINY, TINY_KEY

pytestmark = pytest.mark.slow

BOUND = 1024
INPUT = [100 + i % 50 for i in range(250)]  # 250 tokens: inside the 256-token context


def _post(url: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {TINY_KEY}"}
    return httpx.post(f"{url}/embeddings", json=body, headers=headers, timeout=120)


def test_inputs_over_the_bound_together_are_a_400_naming_input(tiny_url):
    r = _post(tiny_url, {"model": TINY, "input": [INPUT] * 5})  # 1,250 tokens, each one fits
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input"
    assert "max_embedding_tokens" in error["message"] and str(BOUND) in error["message"]


def test_inputs_within_the_bound_are_embedded(tiny_url):
    r = _post(tiny_url, {"model": TINY, "input": [INPUT] * 2})  # 500 tokens
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["data"]) == 2 and body["usage"]["prompt_tokens"] == 500


@pytest.mark.parametrize("value", [2**64, -1, 0, float("nan"), 10**30, "many"])
def test_the_bound_is_validated_naming_the_setting(value):
    with pytest.raises(ValueError, match="max_embedding_tokens"):
        AppConfig.from_args({"max_embedding_tokens": value})


def test_the_default_is_openais_bound():
    assert AppConfig.from_args({}).max_embedding_tokens == 300_000
