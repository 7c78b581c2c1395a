"""Hostile input against the Messages API of the shared `tiny` app (keyed by `x-api-key`, as
Anthropic's clients send it): every answer is 2xx or a 4xx in Anthropic's error shape without
internals, a field's refusal names its path, and the replica keeps serving, never restarted."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.deploy.conftest import TINY, TINY_KEY, replica_stats
from tests.deploy.test_hostile_input import INTERNALS, RAW_BODIES, VALUES

pytestmark = pytest.mark.slow

ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
}
PATHS = ["/messages", "/messages/count_tokens"]
seen = {"cases": 0, "5xx": 0}


@pytest.fixture(scope="module")
def tiny(tiny_url):
    with httpx.Client(base_url=tiny_url, timeout=120, headers={"x-api-key": TINY_KEY}) as c:
        yield c


@pytest.fixture(scope="module")
def replica_before(tiny_url):
    return replica_stats("tiny")["replica"]


def _post(client: httpx.Client, path: str, body: dict | bytes) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=raw, headers={"content-type": "application/json"})


def _check(r: httpx.Response) -> None:
    """2xx, or a 4xx in Anthropic's shape; a stream ends with message_stop and has no error."""
    seen["cases"] += 1
    seen["5xx"] += r.status_code >= 500
    assert r.status_code in (200, *ERROR_TYPES), (r.status_code, r.text[:500])
    assert not INTERNALS.search(r.text), r.text[:500]
    if r.status_code >= 400:
        body = r.json()
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        assert body["error"]["type"] == ERROR_TYPES[r.status_code], body
        assert set(body["error"]) == {"type", "message"} and body["error"]["message"]
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        assert "event: error" not in r.text, r.text[-500:]
        assert r.text.rstrip().endswith('data: {"type":"message_stop"}'), r.text[-500:]


def _still_serving(client: httpx.Client) -> None:
    body = {"model": TINY, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    r = _post(client, "/messages", body)
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] >= 1


def _body(**fields) -> dict:
    return {
        "model": TINY,
        "max_tokens": 3,
        "messages": [{"role": "user", "content": "Hi"}],
        **fields,
    }


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "raw",
    [*RAW_BODIES, json.dumps(_body(system="a" * (10 << 20))).encode(), b'{"model": '],
    ids=["bad-utf8", "deep-list", "deep-object", "array", "string", "deep", "17MiB", "10MB", "cut"],
)
def test_raw_hostile_bodies_get_4xx_in_anthropics_shape(tiny, replica_before, path, raw):
    r = _post(tiny, path, raw)
    _check(r)
    assert r.status_code in (400, 413)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "fields, param",
    [
        ({"frobnicate": 1}, "frobnicate"),
        ({"messages": [{"role": "user", "content": "x", "name": "n"}]}, "messages.0.name"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages.0.content.0"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0"),
        ({"tools": [{"name": "f", "input_schema": {"type": "object"}, "x": 1}]}, "tools.0.x"),
        ({"tools": [{"name": "f", "input_schema": {"type": "object"}}] * 129}, "tools"),
        ({"messages": [{"role": "user", "content": "x"}] * 2049}, "messages"),
        ({"system": [{"type": "text", "text": "x"}] * 4097}, "system"),
        (
            {
                "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                "tool_choice": {"type": "tool", "name": "nope"},
            },
            "tool_choice.name",
        ),
        ({"thinking": {"type": "enabled", "budget_tokens": 2**64}}, "thinking.budget_tokens"),
    ],
)
def test_bad_fields_are_a_400_naming_their_path(tiny, replica_before, path, fields, param):
    body = _body(**fields)
    if path.endswith("count_tokens"):
        del body["max_tokens"]
    r = _post(tiny, path, body)
    _check(r)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(param), r.text


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "fields",
    [
        {"tools": [{"name": "f", "input_schema": {"type": "object"}}] * 100_000},
        {"messages": [{"role": "user", "content": "x"}] * 100_000},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 100_000}]},
        {"system": [{"type": "text", "text": "x"}] * 100_000},
        {"stop_sequences": ["x"] * 100_000},
    ],
)
def test_100000_items_are_refused_by_the_body_cap_or_named(tiny, replica_before, path, fields):
    body = _body(**fields)
    if path.endswith("count_tokens"):
        del body["max_tokens"]
    r = _post(tiny, path, body)
    _check(r)
    assert r.status_code in (400, 413)
    if r.status_code == 400:  # under a larger body cap: the count is refused naming the field
        assert r.json()["error"]["message"].startswith(next(iter(fields))), r.text


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": 2**64}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 100_000}, "max_tokens"),  # past the context
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": 2**64}, "top_k"),
        ({"top_p": -1}, "top_p"),
        ({"stop_sequences": ["x"] * 5}, "stop_sequences"),
        ({"stop_sequences": ["x" * 100_000]}, "stop_sequences"),
        ({"metadata": {"user_id": "u" * 100_000}}, "metadata.user_id"),
        ({"messages": [{"role": "user", "content": "a " * 200_000}]}, "messages"),
    ],
)
def test_huge_values_are_a_400_naming_the_field(tiny, replica_before, fields, param):
    r = _post(tiny, "/messages", _body(**fields))
    _check(r)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(param), r.text


MESSAGES_FIELDS = [
    "model",
    "max_tokens",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "metadata",
    "stream",
    "thinking",
    "service_tier",
    "priority",
    "no_such_field",
]
BLOCKS = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image", "x"])},
        optional={
            "text": VALUES,
            "id": VALUES,
            "name": VALUES,
            "input": VALUES,
            "tool_use_id": VALUES,
            "content": VALUES,
            "thinking": VALUES,
        },
    ),
    max_size=3,
)
MESSAGES_VALUES = st.one_of(
    VALUES,
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "system"]), "content": BLOCKS}
        ),
        max_size=3,
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none"])}),
    st.lists(
        st.fixed_dictionaries({"name": st.sampled_from(["f", "bad name"]), "input_schema": VALUES}),
        max_size=2,
    ),
)


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    path=st.sampled_from(PATHS),
    fields=st.dictionaries(st.sampled_from(MESSAGES_FIELDS), MESSAGES_VALUES, max_size=4),
)
def test_fuzzed_messages_get_2xx_or_4xx(tiny, replica_before, path, fields):
    body = _body(**fields)
    if path.endswith("count_tokens") and "max_tokens" not in fields:
        del body["max_tokens"]
    _check(_post(tiny, path, body))


def test_the_replica_was_never_restarted(tiny, replica_before):
    # Runs after the cases above (file order): the same replica actor served them all.
    _still_serving(tiny)
    assert replica_stats("tiny")["replica"] == replica_before
    assert seen["5xx"] == 0
    print(f"anthropic hostile cases: {seen['cases']}, 5xx: {seen['5xx']}")
