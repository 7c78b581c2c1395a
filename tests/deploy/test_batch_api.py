"""The Batch API served (the shared `tiny` app): the official openai client uploads a file, runs
a batch to completion and reads its output; malformed lines, cancel, another key's 404, the caps,
the quota and every bounded field."""

import json

import httpx
import openai
import pytest

from tests.deploy.conftest import (
    BATCH_MAX_FILE_BYTES,
    BATCH_MAX_LINE_BYTES,
    BATCH_MAX_LINES,
    BATCH_QUOTA_BYTES,
    TINY,
    TINY_KEY,
    TINY_TENANT_KEY,
    wait_for,
)

FINAL = ("completed", "failed", "expired", "cancelled")


def _client(url: str, key: str = TINY_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=300)


def _chat(i: int, **more) -> dict:
    return {
        "model": TINY,
        "messages": [{"role": "user", "content": f"question number {i}"}],
        "max_tokens": 4,
        "temperature": 0,
        **more,
    }


def _line(i: int, url: str = "/v1/chat/completions", body: dict | None = None) -> str:
    row = {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body or _chat(i)}
    return json.dumps(row)


def _jsonl(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def _finished(client: openai.OpenAI, batch_id: str):
    batch = wait_for(
        lambda: (b := client.batches.retrieve(batch_id)).status in FINAL and b, 300, 0.2
    )
    assert batch, f"batch {batch_id} did not end"
    return batch


def _rows(client: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(r) for r in client.files.content(file_id).content.splitlines()]


def _run(client, lines: list[str], endpoint: str = "/v1/chat/completions"):
    upload = client.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
    assert upload.purpose == "batch" and upload.bytes == len(_jsonl(lines))
    batch = client.batches.create(
        input_file_id=upload.id, endpoint=endpoint, completion_window="24h"
    )
    assert batch.status in ("validating", "in_progress") and batch.input_file_id == upload.id
    return _finished(client, batch.id)


def test_a_chat_batch_runs_to_completion_through_the_client(tiny_url):
    client = _client(tiny_url)
    lines = [_line(i) for i in range(20)] + ["{not json", _line(99, body=_chat(99, stream=True))]
    batch = _run(client, lines)
    assert batch.status == "completed"
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (22, 20, 2)
    out = _rows(client, batch.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(f"req-{i}" for i in range(20))
    for row in out:
        assert set(row) == {"id", "custom_id", "response", "error"} and row["error"] is None
        assert row["response"]["status_code"] == 200
        assert row["response"]["body"]["object"] == "chat.completion"
        assert row["response"]["body"]["usage"]["completion_tokens"] == 4
    # A line is the request it holds: its greedy answer is the interactive one's.
    alone = client.chat.completions.create(**_chat(7))
    seven = next(r for r in out if r["custom_id"] == "req-7")["response"]["body"]
    assert seven["choices"][0]["message"]["content"] == alone.choices[0].message.content
    errors = {r["custom_id"]: r for r in _rows(client, batch.error_file_id)}
    assert errors[None]["response"] is None and errors[None]["error"]["code"] == "invalid_request"
    streamed = errors["req-99"]["response"]
    assert streamed["status_code"] == 400 and streamed["body"]["error"]["param"] == "stream"
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    listed = client.batches.list(limit=100)
    assert batch.id in [b.id for b in listed.data]


@pytest.mark.parametrize(
    "endpoint, body, field",
    [
        ("/v1/completions", {"model": TINY, "prompt": "hello", "max_tokens": 3}, "text"),
        ("/v1/embeddings", {"model": TINY, "input": "hello"}, "data"),
        ("/v1/responses", {"model": TINY, "input": "hello", "max_output_tokens": 3}, "output"),
    ],
)
def test_every_endpoint_runs_its_lines(tiny_url, endpoint, body, field):
    client = _client(tiny_url)
    bad = {**body, "model": "no-such-model"}
    lines = [_line(0, endpoint, body), _line(1, endpoint, body), _line(2, endpoint, bad)]
    batch = _run(client, lines, endpoint)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
    out = _rows(client, batch.output_file_id)
    assert all(field in json.dumps(r["response"]["body"]) for r in out)
    (missing,) = _rows(client, batch.error_file_id)
    assert missing["response"]["status_code"] == 404  # the route's own answer, kept whole


def test_a_line_for_another_endpoint_is_an_error_line(tiny_url):
    client = _client(tiny_url)
    batch = _run(client, [_line(0), _line(1, "/v1/completions", {"model": TINY, "prompt": "x"})])
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
    (row,) = _rows(client, batch.error_file_id)
    assert row["custom_id"] == "req-1" and "url" in row["error"]["message"]


def test_cancel_stops_a_running_batch(tiny_url):
    client = _client(tiny_url)
    slow = [_line(i, body=_chat(i, max_tokens=200, ignore_eos=True)) for i in range(40)]
    upload = client.files.create(file=("slow.jsonl", _jsonl(slow)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = _finished(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    answered = done.request_counts.completed + done.request_counts.failed
    assert answered < 40  # two lines in flight at a time, 200 tokens each: far from done
    if done.request_counts.completed:
        assert len(_rows(client, done.output_file_id)) == done.request_counts.completed
    assert client.batches.cancel(batch.id).status == "cancelled"  # a final batch stays so


def test_another_keys_files_and_batches_are_not_found(tiny_url):
    owner, other = _client(tiny_url), _client(tiny_url, TINY_TENANT_KEY)
    batch = _run(owner, [_line(0)])
    file_id = batch.input_file_id
    for call in (
        lambda: other.files.retrieve(file_id),
        lambda: other.files.content(file_id),
        lambda: other.files.delete(file_id),
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
        lambda: other.files.retrieve(batch.output_file_id),
        lambda: other.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert file_id not in [f.id for f in other.files.list().data]
    assert batch.id not in [b.id for b in other.batches.list().data]
    assert owner.files.retrieve(file_id).id == file_id
    with pytest.raises(openai.AuthenticationError):
        _client(tiny_url, "wrong-key").files.list()
    assert httpx.get(f"{tiny_url}/batches", timeout=30).status_code == 401


def _upload(url: str, data: bytes, purpose: str = "batch", key: str = TINY_KEY) -> httpx.Response:
    files = {"file": ("in.jsonl", data)}
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(
        f"{url}/files", files=files, data={"purpose": purpose}, headers=headers, timeout=60
    )


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_upload_caps(tiny_url):
    ten_mb_line = b'{"custom_id": "' + b"x" * (10 << 20) + b'"}\n'
    assert "bytes" in _error(_upload(tiny_url, ten_mb_line), 413)["message"]
    many = b'{"custom_id": "a"}\n' * 100_000
    assert len(many) > BATCH_MAX_FILE_BYTES  # refused by size before its lines are counted
    _error(_upload(tiny_url, many), 413)
    lines = _error(_upload(tiny_url, b"{}\n" * (BATCH_MAX_LINES + 1)), 400)
    assert lines["param"] == "file" and f"at most {BATCH_MAX_LINES}" in lines["message"]
    long = _error(_upload(tiny_url, b"x" * (BATCH_MAX_LINE_BYTES + 1)), 400)
    assert long["param"] == "file" and f"at most {BATCH_MAX_LINE_BYTES}" in long["message"]
    assert _error(_upload(tiny_url, b"\n"), 400)["param"] == "file"
    assert _error(_upload(tiny_url, b"{}\n", purpose="fine-tune"), 400)["param"] == "purpose"
    headers = {"authorization": f"Bearer {TINY_KEY}"}
    as_json = httpx.post(f"{tiny_url}/files", json={"purpose": "batch"}, headers=headers)
    assert _error(as_json, 400)["param"] == "file"
    extra = httpx.post(
        f"{tiny_url}/files",
        files={"file": ("a", b"{}\n")},
        data={"purpose": "batch", "expires_after": "1"},
        headers=headers,
    )
    assert _error(extra, 400)["param"] == "expires_after"


def test_the_key_quota(tiny_url):
    client = _client(tiny_url, TINY_TENANT_KEY)  # its own folder: other tests' files don't count
    chunk = (b'{"custom_id": "' + b"q" * 60_000 + b'"}\n') * 15  # 900 KB in 60 KB lines
    kept = []
    for _ in range(BATCH_QUOTA_BYTES // len(chunk)):
        kept.append(client.files.create(file=("q.jsonl", chunk), purpose="batch").id)
    refused = _error(_upload(tiny_url, chunk, key=TINY_TENANT_KEY), 400)
    assert refused["code"] == "storage_quota_exceeded" and refused["param"] == "file"
    deleted = client.files.delete(kept.pop())
    assert deleted.deleted and deleted.id not in [f.id for f in client.files.list().data]
    kept.append(client.files.create(file=("q.jsonl", chunk), purpose="batch").id)  # room again
    for file_id in kept:
        client.files.delete(file_id)


HOSTILE = [2**64, -1, float("nan"), 10**30, "x" * 100_000, None, [], {}]


@pytest.mark.parametrize("value", HOSTILE)
@pytest.mark.parametrize("field", ["input_file_id", "endpoint", "completion_window", "metadata"])
def test_batch_fields_are_bounded(tiny_url, field, value):
    body = {
        "input_file_id": "file-" + "0" * 24,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        field: value,
    }
    raw = json.dumps(body, allow_nan=True)
    headers = {"authorization": f"Bearer {TINY_KEY}", "content-type": "application/json"}
    response = httpx.post(f"{tiny_url}/batches", content=raw, headers=headers, timeout=30)
    if field == "metadata" and value in (None, {}):  # valid metadata: the file is what is missing
        assert _error(response, 404)["code"] == "not_found"
        return
    if value == HOSTILE[4]:  # past the 64 KiB a batch body may take, before it is parsed
        _error(response, 413)
        return
    error = _error(response, 400)
    assert error["param"] is None or error["param"].startswith(field)


def test_batch_body_refusals_name_the_field(tiny_url):
    client = _client(tiny_url)
    upload = client.files.create(file=("in.jsonl", _jsonl([_line(0)])), purpose="batch")
    base = {"input_file_id": upload.id, "endpoint": "/v1/chat/completions"}
    for more, param in (
        ({"completion_window": "48h"}, "completion_window"),
        ({"completion_window": "24h", "endpoint": "/v1/models"}, "endpoint"),
        ({"completion_window": "24h", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"completion_window": "24h", "metadata": {"k": "v" * 513}}, "metadata"),
        ({"completion_window": "24h", "extra": 1}, "extra"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.post("/batches", body={**base, **more}, cast_to=object)
        assert caught.value.body["param"].startswith(param)
    huge = httpx.post(
        f"{tiny_url}/batches",
        content=b'{"input_file_id": "' + b"f" * (1 << 20) + b'"}',
        headers={"authorization": f"Bearer {TINY_KEY}", "content-type": "application/json"},
    )
    _error(huge, 413)


@pytest.mark.parametrize("value", ["18446744073709551616", "-1", "NaN", "1e3", "0", "9" * 40])
@pytest.mark.parametrize("path", ["/batches", "/files"])
def test_list_limits_are_bounded(tiny_url, path, value):
    headers = {"authorization": f"Bearer {TINY_KEY}"}
    response = httpx.get(f"{tiny_url}{path}", params={"limit": value}, headers=headers)
    assert _error(response, 400)["param"] == "limit"
    other = httpx.get(f"{tiny_url}{path}", params={"after": "x" * 100}, headers=headers)
    assert _error(other, 400)["param"] == "after"
    unknown = httpx.get(f"{tiny_url}{path}", params={"page": "2"}, headers=headers)
    assert _error(unknown, 400)["param"] == "page"


@pytest.mark.parametrize(
    "object_id", ["file-" + "0" * 24, "batch_" + "0" * 24, "..", "x" * 10_000, "%00", "file-ZZ"]
)
def test_unknown_ids_are_not_found(tiny_url, object_id):
    headers = {"authorization": f"Bearer {TINY_KEY}", "content-type": "application/json"}
    for method, path in (
        ("GET", f"/files/{object_id}"),
        ("GET", f"/files/{object_id}/content"),
        ("DELETE", f"/files/{object_id}"),
        ("GET", f"/batches/{object_id}"),
        ("POST", f"/batches/{object_id}/cancel"),
    ):
        response = httpx.request(method, f"{tiny_url}{path}", headers=headers, timeout=30)
        assert response.status_code == 404, (method, path, response.text)
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_pages_of_batches(tiny_url):
    client = _client(tiny_url)
    upload = client.files.create(file=("in.jsonl", _jsonl([_line(0)])), purpose="batch")
    made = [
        client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id
        for _ in range(3)
    ]
    first = client.batches.list(limit=2)
    assert len(first.data) == 2 and first.has_more
    assert [b.id for b in first.data] == made[::-1][:2]  # newest first
    rest = client.batches.list(limit=2, after=first.data[-1].id)
    assert rest.data[0].id == made[0]
    for batch_id in made:
        assert _finished(client, batch_id).status == "completed"


@pytest.mark.parametrize(
    "path, headers, refused",
    [
        ("/v1/files", {"content-type": "multipart/form-data; boundary=x"}, True),  # a page's form
        ("/v1/files", {"content-type": "multipart/form-data; b=x", "authorization": "k"}, False),
        ("/app/v1/files", {"content-type": "multipart/form-data", "authorization": "k"}, False),
        (
            "/v1/chat/completions",
            {"content-type": "multipart/form-data", "authorization": "k"},
            True,
        ),
        ("/v1/files", {"content-type": "text/plain", "authorization": "k"}, True),
    ],
)
def test_only_a_keyed_upload_passes_the_browser_guard_as_a_form(path, headers, refused):
    from starlette.datastructures import Headers

    from deploy.browser_guard import BrowserPolicy

    policy = BrowserPolicy.of(True, None, None)
    refusal = policy.refusal("POST", Headers({"host": "127.0.0.1", **headers}), path)
    assert (refusal is not None and refusal.status == 415) if refused else refusal is None
