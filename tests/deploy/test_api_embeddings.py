"""POST /v1/embeddings through the official openai client (which asks for base64) and raw HTTP:
deterministic, normalised, batched equal to one at a time, bad inputs a 400 naming the field."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
from openai import OpenAI

from tests.deploy.conftest import TINY, TINY_KEY

pytestmark = pytest.mark.slow

# Two inputs: the tiny app admits two requests to its replica at once (max_ongoing_requests), and
# each input is one engine request.
TEXTS = ["the quick brown fox", "a somewhat longer sentence to embed " * 6]


@pytest.fixture(scope="module")
def client(tiny_url):
    return OpenAI(base_url=tiny_url, api_key=TINY_KEY, max_retries=0, timeout=120)


def _post(url: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {TINY_KEY}"}
    return httpx.post(f"{url}/embeddings", json=body, headers=headers, timeout=60)


def test_embeddings_are_normalised_deterministic_and_batch_independent(client):
    batched = client.embeddings.create(model=TINY, input=TEXTS)
    assert [d.index for d in batched.data] == [0, 1]
    vectors = np.array([d.embedding for d in batched.data])
    assert vectors.shape == (2, 64)  # the tiny model's hidden size
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    alone = np.array(
        [client.embeddings.create(model=TINY, input=t).data[0].embedding for t in TEXTS]
    )
    np.testing.assert_allclose(vectors, alone, atol=1e-5)
    again = client.embeddings.create(model=TINY, input=TEXTS)
    assert [d.embedding for d in again.data] == [d.embedding for d in batched.data]
    assert batched.usage.prompt_tokens == batched.usage.total_tokens > 2


def test_float_and_base64_and_token_ids_agree(tiny_url, client):
    as_float = _post(tiny_url, {"model": TINY, "input": TEXTS[0], "encoding_format": "float"})
    assert as_float.status_code == 200, as_float.text
    floats = as_float.json()["data"][0]["embedding"]
    # Left to itself the client asks for base64 and decodes it: float32 on the wire.
    decoded = client.embeddings.create(model=TINY, input=TEXTS[0]).data[0].embedding
    np.testing.assert_allclose(decoded, floats, atol=1e-7)
    raw = client.embeddings.create(model=TINY, input=TEXTS[0], encoding_format="base64")
    as_base64 = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4")
    np.testing.assert_allclose(as_base64, floats, atol=1e-7)
    ids = client.embeddings.create(model=TINY, input=[1, 2, 3])
    assert len(ids.data) == 1 and ids.usage.prompt_tokens == 3


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"dimensions": 8}, "dimensions"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [2**64]}, "input"),
        ({"input": [-1]}, "input"),
        ({"input": ["x"] * 100_000}, "input"),
        ({"input": "word " * 2_000_000}, None),  # 10 MB: the body cap
        ({"encoding_format": "int8"}, "encoding_format"),
        ({"frobnicate": True}, "frobnicate"),
        ({"input": [1] * 300}, "input"),  # past the 256-token context
    ],
)
def test_bad_embedding_requests_are_refused_naming_the_field(tiny_url, fields, param):
    r = _post(tiny_url, {"model": TINY, "input": "hi", **fields})
    assert 400 <= r.status_code < 500, r.text
    if param is not None:
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text
