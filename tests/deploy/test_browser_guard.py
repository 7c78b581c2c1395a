"""A web page cannot drive the server through its visitor's browser (issue 45, finding 5).

Served: `think` is a keyless app on loopback, `tiny` a keyed one (conftest). A rebound Host is
refused where no key protects the server, a cross-origin request everywhere, and so is a body
that is not JSON (what a page may send without a preflight); the OpenAI SDK is served as before.
An allowed origin's CORS is tested on the app of test_tenant_isolation.py, which sets one.
"""

import json

import httpx
import pytest
from openai import OpenAI

from deploy.browser_guard import check_hosts, check_origins, is_loopback
from tests.deploy.conftest import THINK, TINY, TINY_KEY

served = pytest.mark.slow  # starts Ray and Serve

COMPLETION = {"model": THINK, "prompt": "Hi", "max_tokens": 2}
NOT_JSON = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None]


def _refused(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert not any(k.lower().startswith("access-control-") for k in r.headers)


def _post(url: str, path: str, body: bytes, content_type: str | None, **headers: str):
    """POST to a route of the app at url (a `.../v1` URL; `/tokenize` is beside `/v1`)."""
    if content_type is not None:
        headers["content-type"] = content_type
    if path == "/tokenize":
        url = url.removesuffix("/v1")
    return httpx.post(f"{url}{path}", content=body, headers=headers, timeout=120)


# ---- keyless: Host ---------------------------------------------------------------------------
@served
@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:80", "127.0.0.1.nip.io"])
def test_a_keyless_server_refuses_a_host_that_is_not_loopback(think_url, host):
    for path in ("/completions", "/tokenize"):
        r = _post(think_url, path, json.dumps(COMPLETION).encode(), "application/json", host=host)
        _refused(r, 403, "host_not_allowed")
    _refused(
        httpx.get(f"{think_url}/models", headers={"host": host}, timeout=60),
        403,
        "host_not_allowed",
    )


@served
@pytest.mark.parametrize(
    "host", ["localhost", "LOCALHOST:8000", "127.0.0.1", "127.3.2.1:1", "[::1]:8"]
)
def test_a_keyless_server_answers_loopback_hosts(think_url, host):
    r = httpx.post(f"{think_url}/completions", json=COMPLETION, headers={"host": host}, timeout=120)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["usage"]["completion_tokens"] >= 1


# ---- Origin and content type, with and without keys --------------------------------------------
@served
def test_a_cross_origin_request_is_refused_with_or_without_keys(think_url, tiny_url):
    origins = ["https://attacker.example", "null", "http://127.0.0.1:8000"]
    for url, model, auth in ((think_url, THINK, {}), (tiny_url, TINY, _auth(TINY_KEY))):
        for origin in origins:
            body = {**COMPLETION, "model": model}
            r = httpx.post(
                f"{url}/completions", json=body, headers={"origin": origin, **auth}, timeout=60
            )
            _refused(r, 403, "origin_not_allowed")
        preflight = httpx.options(
            f"{url}/completions",
            headers={"origin": origins[0], "access-control-request-method": "POST"},
            timeout=60,
        )
        _refused(preflight, 403, "origin_not_allowed")


@served
@pytest.mark.parametrize("content_type", NOT_JSON)
def test_a_body_that_is_not_json_is_a_415(think_url, tiny_url, content_type):
    body = b'{"model": "%s", "prompt": "Hi", "max_tokens": 2}'
    for url, model, auth in ((think_url, THINK, {}), (tiny_url, TINY, _auth(TINY_KEY))):
        for path in ("/completions", "/tokenize", "/load_lora_adapter"):
            r = _post(url, path, body % model.encode(), content_type, **auth)
            _refused(r, 415, "unsupported_media_type")


@served
def test_the_sdk_and_json_with_a_charset_are_served(think_url):
    body = json.dumps(COMPLETION).encode()
    r = _post(think_url, "/completions", body, "application/json; charset=utf-8")
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    client = OpenAI(base_url=think_url, api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model=THINK, prompt="Hi", max_tokens=2)
    assert out.usage is not None and out.usage.completion_tokens >= 1


@served
def test_a_keyed_server_lets_the_key_decide_whatever_the_host(tiny_url):
    headers = {"host": "serving.example", **_auth(TINY_KEY)}
    body = {"model": TINY, "prompt": "Hi", "max_tokens": 2}
    r = httpx.post(f"{tiny_url}/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text[:300]
    anonymous = httpx.post(
        f"{tiny_url}/completions", json=body, headers={"host": "serving.example"}, timeout=60
    )
    assert anonymous.status_code == 401


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---- the settings ------------------------------------------------------------------------------
def test_loopback_names():
    for host in (
        "localhost",
        "localhost.",
        "127.0.0.1:80",
        "127.255.0.9",
        "[::1]",
        "[::1]:443",
    ):
        assert is_loopback(host), host
    # A Host header brackets an IPv6 address (RFC 9110): a bare one is no name of this machine.
    for host in (
        "attacker.example",
        "localhost.attacker.example",
        "10.0.0.1",
        "[::2]:80",
        "",
        "0.0.0.0",
        "::1",
    ):
        assert not is_loopback(host), host


@pytest.mark.parametrize(
    "value",
    [2**64, -1, float("nan"), "x" * 10_000_000, ["x" * 10_000_000], ["ok"] * 65, [1], "a.b"],
)
def test_bad_allowed_hosts_and_origins_are_value_errors_naming_them(value):
    with pytest.raises(ValueError, match="^allowed_hosts: "):
        check_hosts(value)
    with pytest.raises(ValueError, match="^allowed_origins: "):
        check_origins(value)


def test_hosts_and_origins_are_names_not_urls():
    assert check_hosts(["API.Example.", "10.0.0.2"]) == ["api.example", "10.0.0.2"]
    for bad in ("api.example:8000", "https://api.example", "[::1]"):
        with pytest.raises(ValueError, match="^allowed_hosts: a host name"):
            check_hosts([bad])
    assert check_origins(["https://App.example:8443"]) == ["https://app.example:8443"]
    for bad in ("app.example", "https://app.example/path", "ftp://app.example", "*"):
        with pytest.raises(ValueError, match="^allowed_origins: an origin"):
            check_origins([bad])
