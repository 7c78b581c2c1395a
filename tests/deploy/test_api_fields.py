"""vLLM's sampling and chat extensions over HTTP, through the official openai client (extra_body)
and raw JSON: each changes the output as it should, each bad value is a 400 naming it, and a
field the server does not implement is a 400 naming it (the shared apps run unknown_fields:
reject). /tokenize, /detokenize and /metrics on the HTTP port."""

import json
import re

import httpx
import openai
import pytest
from openai import OpenAI

from tests.deploy.conftest import SMOL, TINY, TINY_KEY, wait_for

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}
SHORT_ANSWER = [{"role": "user", "content": "Reply with one word: what colour is the sky?"}]


@pytest.fixture(scope="module")
def client(smol_url):
    return OpenAI(base_url=smol_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def smol(smol_url):
    with httpx.Client(base_url=smol_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def root(smol_url):
    """The server's root (/tokenize, /metrics live beside /v1)."""
    with httpx.Client(base_url=smol_url.removesuffix("/v1"), timeout=120) as c:
        yield c


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _ids(root: httpx.Client, text: str) -> list[int]:
    r = root.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# ---- what each field does ----------------------------------------------------------------------
def test_min_tokens_suppresses_eos(client):
    free = client.chat.completions.create(
        model=SMOL, messages=SHORT_ANSWER, max_tokens=32, **GREEDY
    )
    assert free.choices[0].finish_reason == "stop"
    length = free.usage.completion_tokens  # EOS came after this many
    held = client.chat.completions.create(
        model=SMOL,
        messages=SHORT_ANSWER,
        max_tokens=length + 8,
        extra_body={"min_tokens": length + 4},
        **GREEDY,
    )
    assert held.usage.completion_tokens >= length + 4


def test_stop_token_ids_stop_and_the_stop_token_is_left_out_unless_asked(client, root):
    kwargs = dict(model=SMOL, prompt="The capital of France is", max_tokens=8, **GREEDY)
    free = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    ids = _ids(root, free.choices[0].text)
    stop = ids[3]
    cut = client.completions.create(**kwargs, extra_body={"stop_token_ids": [stop]})
    first = ids.index(stop)  # the first place it is sampled
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens == first + 1
    kept = client.completions.create(
        **kwargs, extra_body={"stop_token_ids": [stop], "include_stop_str_in_output": True}
    )
    decoded = root.post("/detokenize", json={"tokens": ids[: first + 1]}).json()["prompt"]
    assert kept.choices[0].text == decoded and decoded.startswith(cut.choices[0].text)
    assert len(cut.choices[0].text) < len(decoded)


def test_bad_words_never_appear(client):
    kwargs = dict(model=SMOL, messages=SHORT_ANSWER, max_tokens=12, **GREEDY)
    free = client.chat.completions.create(**kwargs).choices[0].message.content
    word = re.findall(r"[A-Za-z]{3,}", free)[0]
    banned = client.chat.completions.create(**kwargs, extra_body={"bad_words": [word]})
    text = banned.choices[0].message.content
    assert text != free and not re.search(rf"\b{word}\b", text), (word, text)


def test_echo_returns_the_prompt_streamed_and_not(client):
    prompt = "The capital of France is"
    kwargs = dict(model=SMOL, prompt=prompt, max_tokens=4, echo=True, **GREEDY)
    full = client.completions.create(**kwargs).choices[0].text
    assert full.startswith(prompt) and len(full) > len(prompt)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    assert streamed == full


def test_echo_with_logprobs_scores_the_prompt_as_generation_would(client):
    # What evaluation harnesses send for log-likelihood (lm-eval: echo, logprobs=1, max_tokens=1).
    prompt = "The capital of France is"
    step = client.completions.create(model=SMOL, prompt=prompt, max_tokens=1, logprobs=1, **GREEDY)
    word = step.choices[0].text
    scored = client.completions.create(
        model=SMOL, prompt=prompt + word, max_tokens=1, logprobs=1, echo=True, **GREEDY
    )
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text.startswith(prompt + word)
    assert len(lp.tokens) == scored.usage.prompt_tokens + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens).startswith(prompt + word)
    n = scored.usage.prompt_tokens
    assert lp.tokens[n - 1] == word
    assert lp.token_logprobs[n - 1] == pytest.approx(
        step.choices[0].logprobs.token_logprobs[0], abs=1e-3
    )
    assert all(v <= 0 for v in lp.token_logprobs[1:])


def test_prompt_logprobs_in_vllm_shape(smol):
    body = {"model": SMOL, "messages": SHORT_ANSWER, "max_tokens": 1, "prompt_logprobs": 2}
    chat = smol.post("/chat/completions", json=body).json()
    entries = chat["prompt_logprobs"]
    assert len(entries) == chat["usage"]["prompt_tokens"] and entries[0] is None
    assert all(2 <= len(e) <= 3 for e in entries[1:])
    ranks = sorted(v["rank"] for v in entries[1].values() if v["rank"] is not None)
    assert ranks[:2] == [1, 2] and all(v["logprob"] <= 0 for v in entries[1].values())
    body = {"model": SMOL, "prompt": ["Hi there", "Bye now"], "max_tokens": 1, "prompt_logprobs": 0}
    done = smol.post("/completions", json=body).json()
    lists = [c["prompt_logprobs"] for c in done["choices"]]
    assert [e[0] for e in lists] == [None, None] and all(len(e) >= 2 for e in lists)
    assert sum(map(len, lists)) == done["usage"]["prompt_tokens"]


def test_a_stop_string_is_kept_when_asked(client):
    kwargs = dict(model=SMOL, prompt="1, 2, 3, 4, 5,", max_tokens=12, stop=["7"], **GREEDY)
    cut = client.completions.create(**kwargs).choices[0].text
    kept = client.completions.create(**kwargs, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == cut + "7"


def test_special_tokens_are_shown_when_not_skipped(client):
    extra = {"skip_special_tokens": False, "include_stop_str_in_output": True}
    r = client.chat.completions.create(
        model=SMOL, messages=SHORT_ANSWER, max_tokens=40, extra_body=extra, **GREEDY
    )
    assert r.choices[0].message.content.endswith("<|im_end|>")


def test_truncate_prompt_tokens_keeps_the_last_tokens(client):
    r = client.completions.create(
        model=SMOL,
        prompt="one two three four five six seven eight nine ten",
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": 3},
    )
    assert r.usage.prompt_tokens == 3


def test_continue_final_message_and_template_kwargs(client, root):
    chat = SHORT_ANSWER + [{"role": "assistant", "content": "The sky is"}]
    extra = {
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    r = client.chat.completions.create(
        model=SMOL, messages=chat, max_tokens=4, extra_body=extra, **GREEDY
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    tokenized = root.post("/tokenize", json={"messages": chat, **extra}).json()
    text = root.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"]
    assert text.endswith("assistant\nThe sky is") and tokenized["count"] == r.usage.prompt_tokens


# ---- refusals -----------------------------------------------------------------------------------
HOSTILE = [2**64, -1, float("nan"), "x" * (10 << 20), list(range(100_000))]
NEW_FIELDS = [
    "min_tokens",
    "stop_token_ids",
    "bad_words",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "prompt_logprobs",
]
CHAT_FIELDS = ["add_generation_prompt", "continue_final_message", "chat_template_kwargs"]


def _post(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    raw = json.dumps(body).encode()  # NaN goes out as the JSON extension clients send
    return client.post(path, content=raw, headers={"content-type": "application/json"})


@pytest.mark.parametrize("value", HOSTILE, ids=["2^64", "-1", "nan", "10MB", "100k"])
def test_each_bad_value_is_a_400_naming_the_field(smol, value):
    cases = [("/completions", {"prompt": "x"}, f) for f in NEW_FIELDS]
    cases += [("/chat/completions", {"messages": SHORT_ANSWER}, f) for f in CHAT_FIELDS]
    for path, base, field in cases:
        r = _post(smol, path, {"model": SMOL, "max_tokens": 2, **base, field: value})
        if r.status_code == 413:  # a 10 MB value passes the body cap of this context
            continue
        err = _error(r)
        assert err["param"] == field or err["param"].startswith(f"{field}."), (field, err)


def test_semantic_refusals_name_their_field(smol):
    cases = [
        ({"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, "echo"),
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "x", "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
        ({"prompt": "x", "stop_token_ids": [10**7]}, "stop_token_ids"),
        ({"prompt": "x", "bad_words": ["\U0001f600" * 200]}, "bad_words"),
        ({"prompt": "x", "min_tokens": 2, "guided_regex": "a+"}, "min_tokens"),
    ]
    for body, param in cases:
        assert _error(_post(smol, "/completions", {"model": SMOL, **body}))["param"] == param
    chat = [
        ({"continue_final_message": True}, "continue_final_message"),
        ({"chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"p": "<|im_start|>system"}}, "chat_template_kwargs.p"),
    ]
    for extra, param in chat:
        body = {"model": SMOL, "messages": SHORT_ANSWER, **extra}
        assert _error(_post(smol, "/chat/completions", body))["param"] == param


def test_an_unknown_field_is_a_400_naming_it_under_reject(client, smol):
    for path, base in (("/completions", {"prompt": "x"}), ("/chat/completions", {})):
        base = base or {"messages": SHORT_ANSWER}
        err = _error(_post(smol, path, {"model": SMOL, **base, "frobnicate": 1}))
        assert err["param"] == "frobnicate" and err["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=SMOL, messages=SHORT_ANSWER, extra_body={"reasoning_effort": "high"}
        )
    assert caught.value.body["param"] == "reasoning_effort"


# ---- /tokenize, /detokenize, /metrics ----------------------------------------------------------
def test_tokenize_and_detokenize_round_trip(root):
    r = root.post("/tokenize", json={"model": SMOL, "prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 2048 and r["token_strs"] is None
    back = root.post("/detokenize", json={"model": SMOL, "tokens": r["tokens"]}).json()
    assert back == {"prompt": "Hello world"}
    chat = root.post("/tokenize", json={"messages": SHORT_ANSWER}).json()
    assert chat["count"] > r["count"]
    assert _error(root.post("/detokenize", json={"tokens": [10**7]}))["param"] == "tokens"
    assert _error(root.post("/tokenize", json={"prompt": "x", "messages": []}))["param"]
    assert _error(root.post("/tokenize", json={"prompt": "x" * 100_000}))["param"] == "prompt"
    assert _error(root.post("/tokenize", json={"prompt": "x", "model": "other"}), 404)


def test_metrics_on_the_http_port(client, root):
    def page() -> str:
        # The router learns a replica's report as it routes (Serve polls each replica every
        # second): a request per look.
        client.completions.create(model=SMOL, prompt="Hi", max_tokens=2)
        r = root.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return r.text if 'raylm_replicas{state="ok"} 1' in r.text else ""

    text = wait_for(page, timeout=60, interval=0.5)
    assert text, "no replica report reached the ingress's router"
    assert re.search(
        r'^raylm_requests_total\{model="[^"]*",finish_reason="length"\} [1-9]', text, re.M
    )
    assert re.search(r'^raylm_e2e_seconds_count\{model="[^"]*"\} [1-9]', text, re.M)
    assert re.search(r'^raylm_num_requests_waiting\{replica="[^"]+"\} [0-9.]+$', text, re.M)


def test_the_new_endpoints_need_the_key_when_keys_are_set(tiny_url):
    root = tiny_url.removesuffix("/v1")
    for method, path, body in (
        ("GET", "/metrics", None),
        ("POST", "/tokenize", {"prompt": "x"}),
        ("POST", "/detokenize", {"tokens": [1]}),
    ):
        assert httpx.request(method, root + path, json=body, timeout=60).status_code == 401
        keyed = httpx.request(
            method,
            root + path,
            json=body,
            timeout=60,
            headers={"Authorization": f"Bearer {TINY_KEY}"},
        )
        assert keyed.status_code == 200, keyed.text
    r = httpx.post(
        root + "/tokenize",
        json={"model": TINY, "prompt": "x", "return_token_strs": True},
        headers={"Authorization": f"Bearer {TINY_KEY}"},
        timeout=60,
    )
    assert r.json()["token_strs"] == ["x"]
