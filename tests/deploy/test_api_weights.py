"""Weight updates and sleep over HTTP on the shared `tiny` app (allow_weight_updates): under the
admin key only, a bad checkpoint is a 400 naming the tensor while the old weights keep serving,
new weights serve at once, and a sleeping model answers 503 with Retry-After and says so in /health
until it wakes to the same tokens. The app is left awake on its own weights whatever happens."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from tests.deploy.conftest import TINY, TINY_KEY, TINY_TENANT_KEY
from tests.random_checkpoint import TINY_SERVED_LLAMA, write_random_checkpoint

pytestmark = pytest.mark.slow

COMPLETION = {"model": TINY, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def admin(tiny_url, tiny_model_dir):
    with httpx.Client(
        base_url=tiny_url, timeout=120, headers={"Authorization": f"Bearer {TINY_KEY}"}
    ) as client:
        yield client
        # Whatever a test left: awake, on the app's own weights.
        if health(tiny_url)["status"] != "ok":
            client.post("/wake_up", json={})
        client.post("/update_weights", json={"path": tiny_model_dir})


def health(tiny_url: str) -> dict:
    return httpx.get(tiny_url.removesuffix("/v1") + "/health", timeout=30).json()


def complete(client: httpx.Client) -> str:
    r = client.post("/completions", json=COMPLETION)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("route", ["/update_weights", "/sleep", "/wake_up"])
def test_only_an_admin_key_may_change_weights_or_sleep(tiny_url, route, tiny_model_dir):
    r = httpx.post(
        f"{tiny_url}{route}",
        json={"path": tiny_model_dir} if route == "/update_weights" else {},
        headers={"Authorization": f"Bearer {TINY_TENANT_KEY}"},
        timeout=60,
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    assert httpx.post(f"{tiny_url}{route}", json={}, timeout=60).status_code == 401


@pytest.mark.parametrize(
    "route, body",
    [
        ("/sleep", {"level": 3}),
        ("/sleep", {"level": 2**64}),
        ("/sleep", {"level": -1}),
        ("/sleep", {"level": "1"}),
        ("/sleep", {"level": 1, "discard_weights": "yes"}),
        ("/update_weights", {"path": ""}),
        ("/update_weights", {"path": "x" * 5000}),
        ("/update_weights", {"path": "/x", "in_flight": "later"}),
        ("/update_weights", {"path": "/x", "extra": 1}),
        ("/wake_up", {"model": "m" * 2000}),
    ],
)
def test_bad_admin_bodies_are_400(admin, route, body):
    r = admin.post(route, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_sleep_levels_refuse_nan_and_huge(admin):
    for raw in (b'{"level": NaN}', b'{"level": 1e308}'):
        r = admin.post("/sleep", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text


def test_updates_refuse_a_bad_checkpoint_and_serve_new_weights(admin, tiny_model_dir, tmp_path):
    before = complete(admin)
    tensors = load_file(str(next(Path(tiny_model_dir).glob("*.safetensors"))))
    norm = "model.layers.1.input_layernorm.weight"
    tensors[norm][0] = math.nan
    (tmp_path / "nan").mkdir()
    save_file(tensors, str(tmp_path / "nan" / "model.safetensors"))
    r = admin.post("/update_weights", json={"path": str(tmp_path / "nan")})
    assert r.status_code == 400 and norm in r.json()["error"]["message"]
    assert complete(admin) == before  # the old weights kept serving

    vocab = tensors["model.embed_tokens.weight"].shape[0]  # SmolLM2's tokenizer's
    # Sharp logits (the app's own weights are transformers' flat initialisation): other tokens.
    spec = replace(TINY_SERVED_LLAMA.with_fields(vocab_size=vocab), matrix_std=0.15, head_std=0.6)
    other = write_random_checkpoint(spec, str(tmp_path / "other"), seed=7).path
    r = admin.post("/update_weights", json={"path": other, "in_flight": "recompute"})
    assert r.status_code == 200, r.text
    assert all(s["weight_updates"] >= 1 for s in r.json()["replicas"].values())
    assert complete(admin) != before
    assert admin.post("/update_weights", json={"path": tiny_model_dir}).status_code == 200
    assert complete(admin) == before


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleeping_model_answers_503_with_retry_after_and_wakes_to_the_same_tokens(
    admin, tiny_url, level
):
    before = complete(admin)
    r = admin.post("/sleep", json={"level": level})
    assert r.status_code == 200, r.text
    try:
        assert health(tiny_url) == {"status": "asleep", "asleep": {TINY: level}}
        r = admin.post("/completions", json=COMPLETION)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_asleep"
        assert int(r.headers["Retry-After"]) > 0
    finally:
        assert admin.post("/wake_up", json={}).status_code == 200
    assert health(tiny_url) == {"status": "ok"}
    assert complete(admin) == before
