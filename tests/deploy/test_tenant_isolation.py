"""Tenants do not learn each other's prompts from the prefix cache or the metrics page (issue 45,
findings 2 and 9).

`tiny` (conftest) has keys, so its prefix_cache_scope is `tenant`: a prompt one tenant cached is
cold for another (`cached_tokens` 0, as for a prompt never sent), and warm again for its sender.
`scoped` is served here: two models behind one ingress, the first with `prefix_cache_scope:
shared` and three keys, the second with a key of its own; its ingress allows one browser origin.
It shows that the shared scope restores sharing, that /metrics shows a key only its models'
series (an admin key sees all), and an allowed origin's CORS.
"""

import random

import httpx
import pytest

from tests.deploy.conftest import (
    TINY,
    TINY_KEY,
    TINY_TENANT_KEY,
    delete_app,
    run_app,
    wait_for,
)

pytestmark = pytest.mark.slow

BLOCK = 16  # the engine's default block size
PROMPT_TOKENS = 10 * BLOCK
HIT = (PROMPT_TOKENS - 1) // BLOCK * BLOCK  # a whole hit leaves the prompt's last token to compute
APP = "scoped"
SHARED, OTHER = "tiny-shared", "tiny-other"
ONE, TWO, THREE, ADMIN = "key-one", "key-two", "key-three", "key-admin"
ORIGIN = "https://app.example"


def _prompt(name: str) -> list[int]:
    """A prompt no other test sends (seeded by the test's name): token ids, so its length is
    exact."""
    rng = random.Random(name)
    return [rng.randrange(100, 20_000) for _ in range(PROMPT_TOKENS)]


def _cached(url: str, key: str, prompt: list[int], model: str = TINY, **fields) -> int:
    """The cached_tokens of one completion of prompt sent with key."""
    r = httpx.post(
        f"{url}/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 1, **fields},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text[:300]
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == PROMPT_TOKENS
    return usage["prompt_tokens_details"]["cached_tokens"]


# ---- the tenant scope (tiny) -------------------------------------------------------------------
def test_a_second_tenant_finds_nothing_the_first_cached(tiny_url):
    prompt = _prompt("tenants")
    assert _cached(tiny_url, TINY_KEY, prompt) == 0  # cold
    assert _cached(tiny_url, TINY_KEY, prompt) == HIT  # the sender's own cache
    assert _cached(tiny_url, TINY_TENANT_KEY, prompt) == 0  # as cold as a prompt never sent
    assert _cached(tiny_url, TINY_TENANT_KEY, prompt) == HIT  # its own copy, from now on


def test_cache_salt_partitions_a_tenants_cache(tiny_url):
    prompt = _prompt("salts")
    assert _cached(tiny_url, TINY_KEY, prompt) == 0
    assert _cached(tiny_url, TINY_KEY, prompt, cache_salt="s1") == 0
    assert _cached(tiny_url, TINY_KEY, prompt, cache_salt="s1") == HIT
    assert _cached(tiny_url, TINY_KEY, prompt, cache_salt="s2") == 0
    # Under the tenant scope a salt is the tenant's: another tenant naming it shares nothing.
    assert _cached(tiny_url, TINY_TENANT_KEY, prompt, cache_salt="s1") == 0


def test_prompt_cache_key_is_a_partition_of_the_tenants_own_cache(tiny_url):
    prompt = _prompt("prompt cache keys")
    assert _cached(tiny_url, TINY_KEY, prompt, prompt_cache_key="k") == 0
    assert _cached(tiny_url, TINY_KEY, prompt, prompt_cache_key="k") == HIT
    assert _cached(tiny_url, TINY_KEY, prompt) == 0
    assert _cached(tiny_url, TINY_TENANT_KEY, prompt, prompt_cache_key="k") == 0


@pytest.mark.parametrize("name", ["cache_salt", "prompt_cache_key"])
@pytest.mark.parametrize("bad", [2**64, -1, "NaN", "x" * 1025, "x" * 1_500_000])
def test_a_bad_cache_field_is_a_400_naming_it_when_served(tiny_url, name, bad):
    body = f'{{"model": "{TINY}", "prompt": "Hi", "max_tokens": 1, "{name}": {_json(bad)}}}'
    r = httpx.post(
        f"{tiny_url}/completions",
        content=body,
        headers={"Authorization": f"Bearer {TINY_KEY}", "content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == name


def _json(value: object) -> str:
    """value as JSON, NaN as attackers send it (a bare NaN)."""
    return value if value == "NaN" else (f'"{value}"' if isinstance(value, str) else str(value))


# ---- the shared scope, /metrics and CORS (scoped) -------------------------------------------
@pytest.fixture(scope="module")
def scoped_url(ray_cluster, http_port, tiny_model_dir):
    from deploy.app import build_app

    admin = {"tenant": "ops", "admin": True}
    args = {
        "max_model_len": 256,
        "num_gpu_blocks": 64,
        "kv_cache_memory_gb": 0.1,
        "replica_num_cpus": 0.5,
        "ingress_num_cpus": 0.25,
        "allowed_origins": [ORIGIN],
        "models": [
            {
                "name": SHARED,
                "model": tiny_model_dir,
                "prefix_cache_scope": "shared",
                "api_keys": {ONE: {"tenant": "one"}, TWO: {"tenant": "two"}, ADMIN: admin},
            },
            {
                "name": OTHER,
                "model": tiny_model_dir,
                "api_keys": {THREE: {"tenant": "three"}, ADMIN: admin},
            },
        ],
    }
    run_app(build_app(args), APP, f"/{APP}")
    yield f"http://127.0.0.1:{http_port}/{APP}/v1"
    delete_app(APP)


def test_the_shared_scope_lets_tenants_share_cached_prompts(scoped_url):
    prompt = _prompt("shared")
    assert _cached(scoped_url, ONE, prompt, SHARED) == 0
    assert _cached(scoped_url, TWO, prompt, SHARED) == HIT
    # A request's own salt still partitions it, and a prompt_cache_key is still its tenant's.
    assert _cached(scoped_url, TWO, prompt, SHARED, cache_salt="mine") == 0
    assert _cached(scoped_url, ONE, prompt, SHARED, prompt_cache_key="k") == 0
    assert _cached(scoped_url, TWO, prompt, SHARED, prompt_cache_key="k") == 0


def _metrics(url: str, key: str) -> str:
    r = httpx.get(
        f"{url.removesuffix('/v1')}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=60
    )
    assert r.status_code == 200, r.text[:300]
    return r.text


def _replica_lines(page: str) -> int:
    return sum(line.startswith("raylm_num_free_blocks{") for line in page.splitlines())


def test_metrics_show_a_key_only_the_models_it_may_use(scoped_url):
    _cached(scoped_url, ONE, _prompt("metrics one"), SHARED)
    _cached(scoped_url, THREE, _prompt("metrics three"), OTHER)
    # Each model's router reports its replica within a few seconds of its first request.
    assert wait_for(lambda: _replica_lines(_metrics(scoped_url, ADMIN)) == 2, timeout=60)
    everything = _metrics(scoped_url, ADMIN)
    assert f'model="{SHARED}"' in everything and f'model="{OTHER}"' in everything
    for key, mine, theirs in ((ONE, SHARED, OTHER), (THREE, OTHER, SHARED)):
        page = _metrics(scoped_url, key)
        assert f'raylm_requests_total{{model="{mine}"' in page, page[:2000]
        assert f'model="{theirs}"' not in page
        assert _replica_lines(page) == 1  # its model's replica, not the other model's
        assert "raylm_ingress_requests_in_flight 0" in page  # its tenant's: none now


def test_an_allowed_origin_gets_cors_and_its_preflight_answered(scoped_url):
    preflight = httpx.options(
        f"{scoped_url}/completions",
        headers={
            "origin": ORIGIN,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
        },
        timeout=60,
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
    r = httpx.post(
        f"{scoped_url}/completions",
        json={"model": SHARED, "prompt": "Hi", "max_tokens": 1},
        headers={"origin": ORIGIN, "Authorization": f"Bearer {ONE}"},
        timeout=120,
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.post(
        f"{scoped_url}/completions",
        json={"model": SHARED, "prompt": "Hi", "max_tokens": 1},
        headers={"origin": "https://other.example", "Authorization": f"Bearer {ONE}"},
        timeout=60,
    )
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers
