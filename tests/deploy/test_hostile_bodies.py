"""Hostile bodies against a served model: floods of chat messages, logprobs past their budget,
bodies that arrive a byte a second, and one tenant's requests past its cap. Each is refused early
with its 4xx, the ingress goes on serving everyone else, and nothing is restarted.

`tiny` is the shared test app (conftest); `gated` is a second copy of the tiny model served here
with tenant keys, a one-request cap per tenant, a short body deadline, a small logprob budget and
the 16 MiB body cap that was the default before the cap followed the context. It runs
`unknown_fields: ignore`: fields it does not implement are dropped and named in a header.
"""

import asyncio
import json
import math
import re
import socket
import threading
import time

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy.config import AppConfig
from tests.deploy.conftest import TINY, TINY_KEY, delete_app, replica_stats, run_app, wait_for

pytestmark = pytest.mark.slow

# What stands for "did not hang": far beyond any answer here, within the app's request timeout.
HANG_S = 120.0
BODY_TIMEOUT_S = 2.0
LOGPROB_BUDGET = 100
SLOW_CLIENTS = 8
GATED_KEYS = {f"key-{name}": name for name in ["a", "b"] + [f"slow{i}" for i in range(8)]}
JSON = {"content-type": "application/json"}
figures: dict[str, float] = {"cases": 0, "5xx": 0, "overloaded": 0, "slowest_s": 0.0}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def tiny(tiny_url):
    with httpx.Client(base_url=tiny_url, timeout=HANG_S, headers=_auth(TINY_KEY)) as c:
        yield c


@pytest.fixture(scope="module")
def gated_url(ray_cluster, http_port, tiny_model_dir):
    from deploy.app import build_app

    args = {
        "model": tiny_model_dir,
        "served_model_name": TINY,
        "max_model_len": 256,
        "num_gpu_blocks": 64,
        "kv_cache_memory_gb": 0.1,
        "api_keys": {key: {"tenant": tenant} for key, tenant in GATED_KEYS.items()},
        "max_requests_per_tenant": 1,
        "request_body_timeout_s": BODY_TIMEOUT_S,
        "max_logprob_entries": LOGPROB_BUDGET,
        "max_request_body_bytes": 16 << 20,
        "unknown_fields": "ignore",
        "replica_num_cpus": 0.5,
        "ingress_num_cpus": 0.25,
    }
    run_app(build_app(args), "gated", "/gated")
    yield f"http://127.0.0.1:{http_port}/gated/v1"
    delete_app("gated")


@pytest.fixture(scope="module")
def gated(gated_url):
    with httpx.Client(base_url=gated_url, timeout=HANG_S, headers=_auth("key-a")) as c:
        yield c


def _ingress(app: str) -> psutil.Process:
    """The (single) ingress replica's process."""
    return _replica_process(app, "OpenAIIngress")


def _replica(app: str) -> psutil.Process:
    """The (single) model replica's process."""
    return _replica_process(app, "LLMReplica")


def _replica_process(app: str, deployment: str) -> psutil.Process:
    """A deployment's single replica process, found by the title Ray gives its workers."""
    title = f"ray::ServeReplica:{app}:{deployment}"
    [process] = [
        p
        for p in psutil.process_iter(["cmdline"])
        if (p.info["cmdline"] or [""])[0].startswith(title)
    ]
    return process


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _still_serving(client: httpx.Client) -> None:
    r = client.post("/completions", json={"model": TINY, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text[:500]


def _chat(messages: list, **fields) -> bytes:
    return json.dumps(
        {"model": TINY, "messages": messages, **fields}, separators=(",", ":")
    ).encode()


async def _beside_a_small_request(
    url: str, body: bytes, key: str = TINY_KEY, neighbour_key: str = TINY_KEY
) -> tuple[httpx.Response, float]:
    """Posts `body` to chat while a small completion runs beside it; the small one must
    complete."""
    async with httpx.AsyncClient(base_url=url, timeout=HANG_S) as c:

        async def hostile() -> tuple[httpx.Response, float]:
            start = time.perf_counter()
            r = await c.post("/chat/completions", content=body, headers={**JSON, **_auth(key)})
            return r, time.perf_counter() - start

        small = c.post(
            "/completions",
            json={"model": TINY, "prompt": "Hi", "max_tokens": 2},
            headers=_auth(neighbour_key),
        )
        (r, took), neighbour = await asyncio.gather(hostile(), small)
    assert neighbour.status_code == 200, neighbour.text[:500]
    return r, took


# ---- unknown fields under `ignore` -------------------------------------------------------------
IGNORED = "x-raylm-ignored-fields"


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_fields_under_ignore_are_dropped_and_named_in_a_header(gated, stream):
    body = {"model": TINY, "max_tokens": 2, "stream": stream, "frobnicate": 1, "best_of": 3}
    body["messages"] = [{"role": "user", "content": "Hi", "mood": "odd"}]
    r = gated.post("/chat/completions", json=body)
    assert r.status_code == 200, r.text[:500]
    assert r.headers[IGNORED] == "frobnicate, best_of, messages.0.mood"
    r = gated.post("/completions", json={"model": TINY, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and IGNORED not in r.headers


def test_a_flood_of_unknown_fields_gets_a_bounded_header(gated):
    body = {"model": TINY, "prompt": "Hi", "max_tokens": 2, **{f"k{i}": i for i in range(100_000)}}
    r = gated.post("/completions", json=body)
    assert r.status_code == 200, r.text[:500]
    assert len(r.headers[IGNORED]) < 2000 and r.headers[IGNORED].endswith("more")


# ---- message floods ----------------------------------------------------------------------------
def test_a_million_empty_messages_are_refused_by_the_body_cap(tiny_url, tiny):
    ingress = _ingress("tiny")
    rss = ingress.memory_info().rss
    flood = _chat([{"role": "user"}] * 1_000_000)  # 16 MB
    r, took = asyncio.run(_beside_a_small_request(tiny_url, flood))
    error = _error(r, 413)
    assert "bytes" in error["message"]
    grown = (ingress.memory_info().rss - rss) / 2**20
    print(
        f"1,000,000 empty messages ({len(flood) >> 20} MiB): 413 in {took:.2f} s, ingress RSS "
        f"{grown:+.0f} MiB"
    )
    assert _ingress("tiny").pid == ingress.pid
    _still_serving(tiny)


def test_a_million_empty_messages_under_the_body_cap_are_a_400_naming_messages(gated_url, gated):
    ingress = _ingress("gated")
    rss = ingress.memory_info().rss
    flood = _chat([{"role": "user"}] * 1_000_000)  # 16.0 MB, under gated's 16 MiB cap
    r, took = asyncio.run(_beside_a_small_request(gated_url, flood, "key-a", "key-b"))
    error = _error(r, 400)
    assert error["param"] == "messages" and "at most 2048 messages" in error["message"]
    grown = (ingress.memory_info().rss - rss) / 2**20
    print(f"1,000,000 empty messages under a 16 MiB cap: 400 in {took:.2f} s, RSS {grown:+.0f} MiB")
    assert _ingress("gated").pid == ingress.pid
    _still_serving(gated)


def test_a_message_flood_under_the_body_cap_is_a_400_naming_messages(tiny_url, tiny):
    ingress = _ingress("tiny")
    rss = ingress.memory_info().rss
    flood = _chat([{"role": "user"}] * 100_000)  # 1.6 MB: under the cap, past max_messages
    r, took = asyncio.run(_beside_a_small_request(tiny_url, flood))
    error = _error(r, 400)
    assert error["param"] == "messages" and "2048" in error["message"]
    grown = (ingress.memory_info().rss - rss) / 2**20
    print(f"100,000 empty messages: 400 in {took:.2f} s, ingress RSS {grown:+.0f} MiB")
    assert _ingress("tiny").pid == ingress.pid


def test_more_messages_than_the_context_has_tokens_are_refused_before_the_template(tiny):
    # 2,000 messages pass max_messages, but each renders at least one token: 256 cannot hold them.
    r = tiny.post("/chat/completions", content=_chat([{"role": "user"}] * 2000), headers=JSON)
    error = _error(r, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"


def test_content_parts_are_bounded_over_the_whole_conversation(tiny):
    parts = [{"type": "text", "text": ""}] * 5000
    r = tiny.post(
        "/chat/completions", content=_chat([{"role": "user", "content": parts}]), headers=JSON
    )
    error = _error(r, 400)
    assert error["param"] == "messages" and "content parts" in error["message"]


# ---- logprobs ----------------------------------------------------------------------------------
def test_logprobs_at_the_budget_are_served(gated):
    # n x max_tokens x (logprobs + 1) = 1 x 5 x 20 = the budget.
    body = {"model": TINY, "prompt": "Hi", "max_tokens": 5, "logprobs": 19, "ignore_eos": True}
    r = gated.post("/completions", json=body)
    assert r.status_code == 200, r.text[:500]
    logprobs = r.json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 5
    assert all(1 <= len(top) <= 20 for top in logprobs["top_logprobs"])
    chat = {
        "model": TINY,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 20,
        "ignore_eos": True,
    }  # 2 x 2 x 21 = 84
    r = gated.post("/chat/completions", json=chat)
    assert r.status_code == 200, r.text[:500]
    for choice in r.json()["choices"]:
        content = choice["logprobs"]["content"]
        assert len(content) == 2 and all(len(c["top_logprobs"]) == 20 for c in content)
        assert all(bytes(c["bytes"]).decode(errors="replace") for c in content)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/completions", {"prompt": "Hi", "max_tokens": 5, "logprobs": 20}, "logprobs"),
        ("/completions", {"prompt": "Hi", "max_tokens": 2, "n": 3, "logprobs": 20}, "logprobs"),
        ("/completions", {"prompt": ["Hi", "Ho"], "max_tokens": 5, "logprobs": 10}, "logprobs"),
        # max_tokens unset: the context left after the prompt (about 250 tokens).
        ("/completions", {"prompt": "Hi", "logprobs": 0}, "logprobs"),
        (
            "/chat/completions",
            {"max_tokens": 3, "n": 2, "logprobs": True, "top_logprobs": 20},
            "top_logprobs",
        ),
        ("/chat/completions", {"logprobs": True}, "top_logprobs"),
    ],
)
def test_logprobs_past_the_budget_are_a_400_naming_the_fields(gated, path, body, param):
    if path == "/chat/completions":
        body = {"messages": [{"role": "user", "content": "Hi"}], **body}
    error = _error(gated.post(path, json={"model": TINY, **body}), 400)
    assert error["param"] == param
    for name in ("n", "max_tokens", param, str(LOGPROB_BUDGET)):
        assert name in error["message"], error["message"]


def test_logprobs_are_not_budgeted_when_not_asked_for(gated):
    body = {"model": TINY, "prompt": "Hi", "max_tokens": 40, "n": 4}
    assert gated.post("/completions", json=body).status_code == 200


def test_token_texts_are_the_tokenizer_decoding_each_id(tiny_model_dir):
    from transformers import AutoTokenizer

    from deploy.logprobs import TokenTexts

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = TokenTexts.of(tokenizer)
    for token_id in list(range(0, len(tokenizer), 97)) + [len(tokenizer) - 1]:
        assert texts.text(token_id) == tokenizer.decode([token_id])
    assert texts.text(len(tokenizer) + 5) == tokenizer.decode([len(tokenizer) + 5])


def test_a_response_encoded_piece_by_piece_is_the_json_of_the_whole(tiny_model_dir):
    from transformers import AutoTokenizer

    from deploy.logprobs import (
        POSITIONS_PER_PIECE,
        TokenTexts,
        chat_logprobs,
        completion_logprobs,
        response_json,
    )

    texts = TokenTexts.of(AutoTokenizer.from_pretrained(tiny_model_dir))
    positions = [[(i, -0.5), (i + 1, -1.5), (7, -2.0)] for i in range(2 * POSITIONS_PER_PIECE + 3)]
    for build in (chat_logprobs, completion_logprobs):
        logprobs = [build(positions, texts), None, build(positions[:1], texts)]
        choices = [{"index": i, "text": "é\u2028\x00", "finish_reason": "length"} for i in range(3)]
        head = {"id": "cmpl-1", "usage": {"prompt_tokens": 1}}
        whole = {**head, "choices": [{**c, "logprobs": lp} for c, lp in zip(choices, logprobs)]}
        assert json.loads(response_json(head, choices, logprobs)) == whole
    with pytest.raises(ValueError):  # as JSONResponse: no NaN or infinity on the wire
        response_json(head, choices[:1], [{"token_logprobs": [-math.inf]}])


# ---- slow bodies and tenants -------------------------------------------------------------------
def _slow_post(port: int, key: str, results: list, started: threading.Event | None = None) -> None:
    """POSTs a completion whose body arrives a byte a second; appends (the response, the body
    bytes sent, the body's length)."""
    body = json.dumps({"model": TINY, "prompt": "x" * 200}).encode()
    head = (
        f"POST /gated/v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}"
        f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sent, answer = 0, b""
    deadline = time.monotonic() + HANG_S
    with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
        s.sendall(head)
        if started is not None:
            started.set()
        while not answer and sent < len(body) and time.monotonic() < deadline:
            try:
                answer = s.recv(65536)
                break
            except TimeoutError:
                pass
            try:
                s.sendall(body[sent : sent + 1])
                sent += 1
            except OSError:  # the server answered and closed: read what it said
                break
        results.append((_whole_answer(s, answer), sent, len(body)))


def _whole_answer(s: socket.socket, answer: bytes) -> bytes:
    """`answer` read on to the end of its body (the head and the body may come apart)."""
    s.settimeout(5.0)
    while True:
        head, blank, content = answer.partition(b"\r\n\r\n")
        length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
        if blank and length is not None and len(content) >= int(length.group(1)):
            return answer
        try:
            more = s.recv(65536)
        except OSError:
            return answer
        if not more:
            return answer
        answer += more


def test_bodies_sent_a_byte_a_second_get_408_and_hold_nobody_else(gated_url, gated, http_port):
    ingress = _ingress("gated").pid
    results: list = []
    clients = [
        threading.Thread(target=_slow_post, args=(http_port, f"key-slow{i}", results))
        for i in range(SLOW_CLIENTS)
    ]
    start = time.perf_counter()
    for c in clients:
        c.start()
    _still_serving(gated)  # beside the slow bodies
    for c in clients:
        c.join(HANG_S)
    took = time.perf_counter() - start
    assert len(results) == SLOW_CLIENTS
    for answer, sent, size in results:
        assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
        assert sent < size  # refused before the body was complete
        assert b'"code":"request_body_timeout"' in answer
    print(
        f"{SLOW_CLIENTS} bodies a byte a second: 408 after {took:.1f} s "
        f"(request_body_timeout_s {BODY_TIMEOUT_S}), bytes sent {[r[1] for r in results]}"
    )
    assert _ingress("gated").pid == ingress
    _still_serving(gated)


def _held_by_a_slow_body(
    client: httpx.Client, port: int, body: dict
) -> tuple[threading.Thread, list, httpx.Response]:
    """Starts a slow body for the client's tenant; returns once the tenant's next request is
    refused (the slow one, if it lost the race to be admitted, is started again)."""
    key = client.headers["authorization"].removeprefix("Bearer ")
    for _ in range(5):
        held: list = []
        started = threading.Event()
        slow = threading.Thread(target=_slow_post, args=(port, key, held, started))
        slow.start()
        started.wait(HANG_S)
        refused = wait_for(
            lambda held=held: (
                held or ((r := client.post("/completions", json=body)).status_code == 429 and r)
            ),
            30,
        )
        if isinstance(refused, httpx.Response):
            return slow, held, refused
        slow.join(HANG_S)  # answered already: a request of ours was admitted first
    pytest.fail("a slow body never held its tenant's place")


def test_the_tenant_cap_refuses_only_that_tenant(gated_url, gated, http_port):
    other = {"headers": _auth("key-b")}
    body = {"model": TINY, "prompt": "Hi", "max_tokens": 2}
    slow, held, refused = _held_by_a_slow_body(gated, http_port, body)
    error = _error(refused, 429)
    assert error["code"] == "rate_limit_exceeded" and refused.headers["retry-after"] == "1"
    assert gated.post("/completions", json=body, **other).status_code == 200  # another tenant
    assert gated.post("/completions", json=body).status_code == 429  # a is still held
    slow.join(HANG_S)
    assert held and held[0][0].startswith(b"HTTP/1.1 408")
    assert gated.post("/completions", json=body).status_code == 200  # a's request ended


def test_a_tenant_stream_releases_its_place_when_done_or_dropped(gated):
    stream = {"model": TINY, "prompt": "Hi", "max_tokens": 8, "stream": True}
    with gated.stream("POST", "/completions", json=stream) as r:
        assert r.status_code == 200
        assert r.read().rstrip().endswith(b"data: [DONE]")
    _still_serving(gated)
    long = {**stream, "max_tokens": 200, "ignore_eos": True}
    with gated.stream("POST", "/completions", json=long) as r:
        assert r.status_code == 200
        next(r.iter_bytes())  # the client leaves after the first event
    assert wait_for(
        lambda: gated.post("/completions", json={**stream, "stream": False}).status_code == 200,
        30,
    )


# ---- the new settings, fuzzed as every setting is (tests/deploy/test_config.py) --------------
NEW_SETTINGS = [
    "max_request_body_bytes",
    "request_body_timeout_s",
    "max_messages",
    "max_logprob_entries",
    "max_requests_per_tenant",
    "grammar_timeout_s",
    "grammar_mask_deadline_s",
    "placement_timeout_s",
    "async_scheduling",
    "quantization",
]


@pytest.mark.parametrize("name", NEW_SETTINGS)
@pytest.mark.parametrize(
    "value", [2**64, -1, math.nan, "x" * 10_000_000], ids=["2^64", "-1", "nan", "10MB"]
)
def test_hostile_values_of_the_new_settings_are_refused_naming_them(name, value):
    with pytest.raises(ValueError, match=f"^invalid raylm app args: (engine\\.)?{name}:") as raised:
        AppConfig.from_args({name: value})
    assert len(str(raised.value)) < 500


def test_the_default_body_cap_follows_the_context():
    from deploy.body import MIN_BODY_BYTES, body_limit

    config = AppConfig.from_args({})
    assert body_limit(config, 256) == MIN_BODY_BYTES  # room for tools and schemas besides
    assert body_limit(config, 1 << 20) > body_limit(config, 1 << 17) > MIN_BODY_BYTES
    assert body_limit(AppConfig.from_args({"max_request_body_bytes": 4096}), 1 << 20) == 4096


# ---- the fuzz: message lists and logprob combinations ----------------------------------------
ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "root", "", 7, None])
TEXT = st.text(max_size=20)
PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "text", ""])}),
    st.fixed_dictionaries({"type": st.just("text"), "text": st.lists(TEXT, max_size=3)}),
    TEXT,
)
CONTENT = st.one_of(
    TEXT,
    st.none(),
    st.integers(),
    st.lists(PART, max_size=4),
    st.lists(st.lists(PART, max_size=2), max_size=2),  # parts nested in parts
)
MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": ROLES,
        "content": CONTENT,
        "name": TEXT,
        "tool_call_id": TEXT,
        "tool_calls": st.lists(
            st.fixed_dictionaries({"function": st.fixed_dictionaries({"name": TEXT})}), max_size=2
        ),
    },
)
MESSAGES = st.one_of(
    st.lists(MESSAGE, max_size=6),
    # many copies of one message: within max_messages, at it, and past it
    st.builds(lambda m, k: [m] * k, MESSAGE, st.sampled_from([255, 256, 257, 2047, 2048, 2049])),
    st.sampled_from([None, "Hi", {"role": "user"}, [[]], 3]),
)
BOUNDS = [None, -1, 0, 1, 2, 5, 19, 20, 21, 255, 256, 257, 2**31, 2**64, 1.5, "5", True]
LOGPROB_FIELDS = {
    "n": st.sampled_from([None, -1, 0, 1, 2, 4, 128, 129, 2**64, 1.5]),
    "max_tokens": st.sampled_from(BOUNDS),
    "max_completion_tokens": st.sampled_from(BOUNDS),
    "logprobs": st.sampled_from(BOUNDS + [False]),
    "top_logprobs": st.sampled_from(BOUNDS),
    "stream": st.booleans(),
}


def _case(client: httpx.Client, path: str, body: dict) -> None:
    start = time.perf_counter()
    r = client.post(path, content=json.dumps(body), headers=JSON)
    took = time.perf_counter() - start
    # tiny admits 4 sequences at a time (conftest): more in one request (n, a batch of prompts)
    # is refused at admission with 503 "overloaded" and Retry-After, which is no failure.
    overloaded = r.status_code == 503 and r.headers.get("retry-after") is not None
    overloaded = overloaded and r.json()["error"]["code"] == "overloaded"
    figures["cases"] += 1
    figures["overloaded"] += overloaded
    figures["5xx"] += r.status_code >= 500 and not overloaded
    figures["slowest_s"] = max(figures["slowest_s"], took)
    assert r.status_code in (200, 400, 404, 413, 422) or overloaded, (r.status_code, r.text[:500])
    assert took < HANG_S
    if r.status_code >= 400:
        _error(r, r.status_code)
    elif body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text[-500:]


@pytest.fixture(scope="module")
def before_fuzz(tiny):
    return replica_stats("tiny")["replica"], _ingress("tiny").pid


FUZZ = settings(
    max_examples=32,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(messages=MESSAGES, fields=st.fixed_dictionaries({}, optional=LOGPROB_FIELDS))
def test_fuzzed_message_lists_get_2xx_or_4xx(tiny, before_fuzz, messages, fields):
    _case(tiny, "/chat/completions", {"model": TINY, "messages": messages, **fields})
    _still_serving(tiny)


@FUZZ
@given(
    prompt=st.sampled_from(["Hi", ["Hi", "Ho"], [1, 2, 3], [[1], [2]] * 3]),
    fields=st.fixed_dictionaries({}, optional=LOGPROB_FIELDS),
)
def test_fuzzed_logprob_combinations_get_2xx_or_4xx(tiny, before_fuzz, prompt, fields):
    fields.pop("top_logprobs", None)
    fields.pop("max_completion_tokens", None)
    _case(tiny, "/completions", {"model": TINY, "prompt": prompt, **fields})
    _still_serving(tiny)


# ---- untrusted grammars ------------------------------------------------------------------------
def _rule_chain(links: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(links)) + f'r{links}: "x"\n'


def _ref_chain(links: int) -> dict:
    defs: dict = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(links)}
    defs[f"d{links}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"structured_outputs": {"grammar": _rule_chain(3_000)}}, "structured_outputs.grammar"),
        ({"guided_grammar": _rule_chain(15_000)}, "guided_grammar"),
        ({"structured_outputs": {"json": _ref_chain(3_000)}}, "structured_outputs.json"),
        ({"guided_json": _ref_chain(200)}, "guided_json"),
        ({"structured_outputs": {"regex": "a{1000}{1000}"}}, "structured_outputs.regex"),
        ({"guided_json": {"type": "string", "pattern": "(ab){500}{500}"}}, "guided_json"),
        ({"guided_grammar": "start: /[a-z]{999}{999}/"}, "guided_grammar"),
    ],
    ids=[
        "rule-chain",
        "long-rule-chain",
        "ref-chain",
        "deep-refs",
        "regex-bomb",
        "pattern-bomb",
        "terminal-bomb",
    ],
)
def test_grammars_that_crashed_or_stalled_a_process_are_a_400_naming_the_field(
    tiny_url, tiny, fields, param
):
    ingress = _ingress("tiny").pid
    body = _chat([{"role": "user", "content": "Hi"}], max_tokens=4, **fields)
    r, took = asyncio.run(_beside_a_small_request(tiny_url, body))
    assert _error(r, 400)["message"].startswith(param), r.text[:500]
    assert took < HANG_S
    assert _ingress("tiny").pid == ingress
    _still_serving(tiny)


def test_the_widest_accepted_regexes_leave_a_neighbouring_stream_and_the_replica_bounded(tiny):
    """Three requests at the regex bound beside a plain stream: they are served, the stream's
    pace is recorded (not asserted: no timings in tests), and the replica's memory stays
    bounded."""
    replica = _replica("tiny")
    rss_before = replica.memory_info().rss
    widest = [f"[a-z]{{{20_000 - i}}}" for i in range(3)]  # three distinct templates

    async def run() -> tuple[list[float], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=str(tiny.base_url), timeout=HANG_S) as c:
            stream_gaps: list[float] = []

            async def plain_stream() -> None:
                body = {"model": TINY, "prompt": "Hi", "max_tokens": 24, "stream": True}
                async with c.stream(
                    "POST", "/completions", json=body, headers=_auth(TINY_KEY)
                ) as r:
                    last = time.perf_counter()
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            now = time.perf_counter()
                            stream_gaps.append(now - last)
                            last = now

            bombs = [
                c.post(
                    "/completions",
                    json={
                        "model": TINY,
                        "prompt": "Hi",
                        "max_tokens": 8,
                        "structured_outputs": {"regex": regex},
                    },
                    headers=_auth(TINY_KEY),
                )
                for regex in widest
            ]
            *answers, _ = await asyncio.gather(*bombs, plain_stream())
            return stream_gaps, answers

    gaps, answers = asyncio.run(run())
    assert all(a.status_code == 200 for a in answers), [a.text[:300] for a in answers]
    grown_mib = (replica.memory_info().rss - rss_before) / (1 << 20)
    print(
        f"widest regexes: neighbour ITL median {sorted(gaps)[len(gaps) // 2] * 1000:.0f} ms, "
        f"max {max(gaps) * 1000:.0f} ms over {len(gaps)} chunks; replica RSS +{grown_mib:.0f} MiB"
    )
    assert grown_mib < 256


REGEX_PIECES = st.sampled_from(["a", "[a-z]", "\\d", "(ab|c)", ".", "\\", "(", ")", "[", "|"])
REGEXES = st.builds(
    lambda pieces, counts: "".join(
        p + (f"{{{c}}}" if c is not None else "") for p, c in zip(pieces, counts)
    ),
    st.lists(REGEX_PIECES, min_size=1, max_size=6),
    st.lists(st.sampled_from([None, 0, 1, 30, 999, 1000, 100_000, 2**64]), min_size=6, max_size=6),
)
SCHEMAS = st.recursive(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["string", "integer", "object", "array", "nonsense"])},
        optional={
            "pattern": REGEXES,
            "maxLength": st.sampled_from([-1, 0, 8, 2**64, 1.5]),
            "$ref": st.sampled_from(["#/$defs/a", "#/nowhere", "#", 7]),
        },
    ),
    lambda inner: st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("object"), "properties": st.dictionaries(TEXT, inner, max_size=3)}
        ),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner}),
        st.fixed_dictionaries(
            {"$defs": st.fixed_dictionaries({"a": inner}), "$ref": st.just("#/$defs/a")}
        ),
    ),
    max_leaves=8,
)
GRAMMARS = st.one_of(
    st.builds(_rule_chain, st.sampled_from([1, 10, 999, 1000, 1001, 5000])),
    st.builds(lambda r: f"start: /{r}/", REGEXES),
    st.builds(lambda n: f'start: "a"~{n}', st.sampled_from([0, 5, 100_000, 100_001, 2**64])),
    st.text(max_size=40),
)
CONSTRAINTS = st.one_of(
    st.fixed_dictionaries({"structured_outputs": st.fixed_dictionaries({"regex": REGEXES})}),
    st.fixed_dictionaries({"structured_outputs": st.fixed_dictionaries({"json": SCHEMAS})}),
    st.fixed_dictionaries({"guided_grammar": GRAMMARS}),
    st.fixed_dictionaries({"guided_json": st.one_of(SCHEMAS, st.text(max_size=20), st.integers())}),
    st.fixed_dictionaries(
        {"structured_outputs": st.fixed_dictionaries({"choice": st.lists(TEXT, max_size=3)})}
    ),
)


@FUZZ
@given(constraint=CONSTRAINTS, fields=st.fixed_dictionaries({}, optional=LOGPROB_FIELDS))
def test_fuzzed_grammars_schemas_and_regexes_get_2xx_or_4xx(tiny, before_fuzz, constraint, fields):
    fields["max_tokens"] = 4
    fields.pop("max_completion_tokens", None)
    body = {"model": TINY, "messages": [{"role": "user", "content": "Hi"}], **constraint, **fields}
    _case(tiny, "/chat/completions", body)
    _still_serving(tiny)


TOOL_NAMES = st.sampled_from(["get_weather", "f", "", "a" * 65, "bad name", "f", 7])
TOOL = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "function", "web", None])},
    optional={
        "function": st.fixed_dictionaries(
            {"name": TOOL_NAMES},
            optional={
                "parameters": st.one_of(SCHEMAS, st.just({"type": "object"}), st.integers()),
                "strict": st.sampled_from([True, False, "yes"]),
                "description": TEXT,
            },
        )
    },
)
TOOL_FIELDS = st.fixed_dictionaries(
    {"tools": st.one_of(st.lists(TOOL, max_size=3), st.builds(lambda t: [t] * 129, TOOL))},
    optional={
        "tool_choice": st.one_of(
            st.sampled_from(["auto", "none", "required", "any", None, 3]),
            st.fixed_dictionaries(
                {
                    "type": st.just("function"),
                    "function": st.fixed_dictionaries({"name": TOOL_NAMES}),
                }
            ),
        ),
        "parallel_tool_calls": st.sampled_from([True, False, None, "no"]),
        "structured_outputs": st.fixed_dictionaries({"regex": REGEXES}),
    },
)


@FUZZ
@given(tools=TOOL_FIELDS, messages=st.lists(MESSAGE, max_size=3))
def test_fuzzed_tools_get_2xx_or_4xx(tiny, before_fuzz, tools, messages):
    messages = messages or [{"role": "user", "content": "Hi"}]
    _case(
        tiny, "/chat/completions", {"model": TINY, "messages": messages, "max_tokens": 8, **tools}
    )
    _still_serving(tiny)


def test_after_the_fuzz_nothing_was_restarted(tiny, before_fuzz):
    # Runs after the fuzz above (file order): the same replica and ingress served every case.
    assert (replica_stats("tiny")["replica"], _ingress("tiny").pid) == before_fuzz
    print(
        f"hostile-bodies fuzz: {figures['cases']} cases, {figures['5xx']} 5xx, "
        f"{figures['overloaded']} refused at admission, slowest {figures['slowest_s']:.2f} s"
    )
    assert figures["5xx"] == 0
