"""Several models behind one ingress on a real Serve app: `model` picks the replicas, keys are per
model, an unknown model is a 404, and a model scaled to zero wakes for the requests that wait for
it (a bounded queue: the overflow gets 503 with Retry-After).

One app for the module: `tiny-a` (one replica, a key) and `tiny-z` (no key, autoscaled from zero
with a one-second downscale delay and a queue of two; it starts with one replica, which the
idle app scales away)."""

import asyncio
import time

import httpx
import pytest
from ray import serve

from tests.deploy.conftest import delete_app, run_app, wait_for

pytestmark = pytest.mark.slow

APP = "fleet"
KEY_A = "key-a"
ZERO = "LLMReplica-tiny-z"


@pytest.fixture(scope="module")
def fleet_url(ray_cluster, http_port, tiny_model_dir, long_tiny_model_dir):
    from deploy.app import build_app

    args = {
        "num_gpu_blocks": 64,
        "kv_cache_memory_gb": 0.1,
        "replica_num_cpus": 0.5,
        "ingress_num_cpus": 0.25,
        "request_timeout_s": 120,
        "models": [
            {"name": "tiny-a", "model": tiny_model_dir, "max_model_len": 256, "api_key": KEY_A},
            {
                "name": "tiny-z",
                "model": long_tiny_model_dir,
                "max_model_len": 512,
                "max_queued_requests": 2,
                "autoscaling": {
                    "min_replicas": 0,
                    "initial_replicas": 1,
                    "max_replicas": 1,
                    "upscale_delay_s": 0,
                    "downscale_delay_s": 1,
                },
            },
        ],
    }
    run_app(build_app(args), APP, f"/{APP}")
    yield f"http://127.0.0.1:{http_port}/{APP}/v1"
    delete_app(APP)


def _running(deployment: str) -> int:
    status = serve.status().applications[APP].deployments[deployment]
    return sum(n for state, n in status.replica_states.items() if str(state).endswith("RUNNING"))


def _complete(url: str, model: str, key: str | None = None, **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True, **body}
    return httpx.post(f"{url}/completions", json=body, headers=headers, timeout=150)


def test_models_lists_each_model_the_key_may_use_without_waking_one(fleet_url):
    keyed = httpx.get(f"{fleet_url}/models", headers={"Authorization": f"Bearer {KEY_A}"}).json()
    cards = {c["id"]: c["max_model_len"] for c in keyed["data"]}
    assert cards == {"tiny-a": 256, "tiny-z": 512}
    anonymous = httpx.get(f"{fleet_url}/models").json()
    assert [c["id"] for c in anonymous["data"]] == ["tiny-z"]
    # Listed from its settings, not woken for a listing (once its first replica has gone idle).
    assert wait_for(lambda: _running(ZERO) == 0, timeout=60, interval=0.5)
    assert [c["max_model_len"] for c in httpx.get(f"{fleet_url}/models").json()["data"]] == [512]
    assert _running(ZERO) == 0


def test_model_picks_the_model_and_keys_are_per_model(fleet_url):
    r = _complete(fleet_url, "tiny-a", KEY_A)
    assert r.status_code == 200 and r.json()["model"] == "tiny-a", r.text
    # 300 tokens fit tiny-z's 512 but not tiny-a's 256: the request reached tiny-a's settings.
    r = _complete(fleet_url, "tiny-a", KEY_A, max_tokens=300)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = _complete(fleet_url, "tiny-a")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = _complete(fleet_url, "gpt-4", KEY_A)
    error = r.json()["error"]
    assert r.status_code == 404 and error["code"] == "model_not_found" and error["param"] == "model"
    page = httpx.get(
        f"{fleet_url.removesuffix('/v1')}/metrics", headers={"Authorization": f"Bearer {KEY_A}"}
    )
    assert 'raylm_requests_total{model="tiny-a",finish_reason="length"} 1' in page.text
    assert 'raylm_requests_total{model="tiny-z",finish_reason="length"} 0' in page.text


def test_a_model_at_zero_replicas_wakes_for_its_queue_and_sheds_the_overflow(fleet_url):
    assert wait_for(lambda: _running(ZERO) == 0, timeout=60, interval=0.5)
    started = time.monotonic()

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=150) as client:
            body = {
                "model": "tiny-z",
                "prompt": "Hi",
                "max_tokens": 4,
                "ignore_eos": True,
                "request_timeout_s": 100,  # the wait for a replica counts in it
            }
            return await asyncio.gather(
                *(client.post(f"{fleet_url}/completions", json=body) for _ in range(6))
            )

    replies = asyncio.run(burst())
    codes = sorted(r.status_code for r in replies)
    assert set(codes) <= {200, 503} and 200 in codes and 503 in codes, codes
    shed = [r for r in replies if r.status_code == 503]
    assert all(r.headers.get("retry-after") for r in shed)
    assert all(r.json()["error"]["type"] for r in shed)
    print(f"first requests at zero replicas answered in {time.monotonic() - started:.1f} s")
