"""The Batch API's store and runner on a real directory, without Ray: caps and quotas, ids that
never reach a path, result lines in OpenAI's shape, and a batch resumed after its runner died
answering every line exactly once."""

import asyncio
import json
import os
import stat

import pytest

from deploy.batch_runner import BatchRunner, done_lines, parse_line
from deploy.batch_store import BatchStore, NotFound, QuotaExceeded, StoreLimits, TooLarge

ENDPOINT = "/v1/chat/completions"
LIMITS = StoreLimits(
    max_file_bytes=1 << 20, max_lines=100, max_line_bytes=4096, quota_bytes=1 << 20, max_files=8
)


def line(i: int, **extra) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]}
    row = {"custom_id": f"c{i}", "method": "POST", "url": ENDPOINT, "body": body, **extra}
    return json.dumps(row).encode()


def jsonl(rows: list[bytes]) -> bytes:
    return b"\n".join(rows) + b"\n"


@pytest.fixture
def store(tmp_path):
    return BatchStore(tmp_path / "batch", LIMITS)


class Answers:
    """The ingress's side of the seam: answers each body by its content, records every call."""

    def __init__(self, stop_after: int | None = None, busy_first: int = 0):
        self.calls: list[str] = []
        self.stop_after = stop_after
        self.busy = busy_first

    async def __call__(self, url: str, body: dict) -> tuple[int, dict]:
        content = body["messages"][0]["content"]
        if self.busy > 0:  # the tenant is at its limit: the runner must wait and retry
            self.busy -= 1
            return 429, {"error": {"message": "busy"}}
        self.calls.append(content)
        if self.stop_after is not None and len(self.calls) > self.stop_after:
            await asyncio.Event().wait()  # hangs: the runner is killed while this is in flight
        if content == "q3":
            return 400, {"error": {"message": "bad", "param": "messages"}}
        return 200, {"object": "chat.completion", "answer": content.upper()}


def rows_of(store, owner, file_id) -> list[dict]:
    return [json.loads(r) for r in store.content_path(owner, file_id).read_bytes().splitlines()]


def test_upload_caps_quota_and_permissions(store):
    data = jsonl([line(i) for i in range(5)])
    record = store.add_file("k1", "in.jsonl", "batch", data)
    assert record.bytes == len(data) and record.purpose == "batch"
    path = store.content_path("k1", record.id)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    with pytest.raises(TooLarge, match="file: .* at most 1048576"):
        store.add_file("k1", "x", "batch", b"{}\n" * (LIMITS.max_file_bytes // 3 + 1))
    with pytest.raises(ValueError, match="file: 101 lines, at most 100"):
        store.add_file("k1", "x", "batch", b"{}\n" * 101)
    with pytest.raises(ValueError, match="file: a line of 5000 bytes, at most 4096"):
        store.add_file("k1", "x", "batch", b"x" * 5000)
    with pytest.raises(ValueError, match="file: empty"):
        store.add_file("k1", "x", "batch", b"\n\n")
    for _ in range(LIMITS.max_files - 1):
        store.add_file("k1", "x", "batch", data)
    with pytest.raises(QuotaExceeded, match="at most 8"):
        store.add_file("k1", "x", "batch", data)
    assert len(store.list_files("k2")) == 0  # another key's folder is empty


def test_byte_quota(store):
    big = jsonl([b"x" * 4000] * 200)  # 800 KB of the 1 MiB quota
    store.add_file("k1", "a", "batch", big[: 4001 * 100])
    store.add_file("k1", "b", "batch", big[: 4001 * 100])
    with pytest.raises(QuotaExceeded, match="exceeds the key's quota of 1048576 bytes"):
        store.add_file("k1", "c", "batch", big[: 4001 * 100])
    store.add_file("k2", "c", "batch", big[: 4001 * 100])  # a quota per key


@pytest.mark.parametrize(
    "bad", ["../etc/passwd", "file-" + "0" * 23, "file-" + "g" * 24, "x" * 10**6, "", "batch_1"]
)
def test_ids_that_are_not_ours_are_not_found(store, bad):
    with pytest.raises(NotFound):
        store.get_file("k1", bad)
    with pytest.raises(NotFound):
        store.get_batch("k1", bad)


def test_another_owners_file_is_not_found(store):
    record = store.add_file("k1", "in.jsonl", "batch", jsonl([line(0)]))
    with pytest.raises(NotFound):
        store.get_file("k2", record.id)
    with pytest.raises(NotFound):
        store.delete_file("k2", record.id)
    assert store.get_file("k1", record.id) == record


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"not json", "not valid JSON"),
        (b"[1]", "JSON object"),
        (json.dumps({"method": "POST"}).encode(), "custom_id"),
        (json.dumps({"custom_id": "x" * 513}).encode(), "custom_id"),
        (json.dumps({"custom_id": 2**64}).encode(), "custom_id"),
        (line(0, extra=1), "extra: unknown field"),
        (line(0).replace(b'"POST"', b'"GET"'), "method"),
        (line(0).replace(ENDPOINT.encode(), b"/v1/embeddings"), "url"),
        (
            json.dumps({"custom_id": "a", "method": "POST", "url": ENDPOINT, "body": 1}).encode(),
            "body",
        ),
        (b"[" * 100_000, "not valid JSON"),
    ],
)
def test_malformed_lines_carry_their_reason(raw, reason):
    parsed = parse_line(raw, 7, ENDPOINT)
    assert parsed.body is None and reason in parsed.error


def run(store, owner, batch_id, send, in_flight=2):
    return asyncio.run(BatchRunner(store, owner, batch_id, send, in_flight, retry_s=0.001).run())


def test_batch_runs_every_line_once_in_openai_shape(store):
    rows = [line(i) for i in range(6)] + [b"{broken"]
    record = store.add_file("k1", "in.jsonl", "batch", jsonl(rows))
    state = store.new_batch("k1", ENDPOINT, record.id, {"job": "eval"})
    answers = Answers(busy_first=3)
    done = run(store, "k1", state.id, answers)
    assert done.status == "completed"
    assert (done.total, done.completed, done.failed) == (7, 5, 2)
    assert sorted(answers.calls) == [f"q{i}" for i in range(6)]  # the 429s were retried
    out = rows_of(store, "k1", done.output_file_id)
    assert sorted(r["custom_id"] for r in out) == ["c0", "c1", "c2", "c4", "c5"]
    first = next(r for r in out if r["custom_id"] == "c0")
    assert set(first) == {"id", "custom_id", "response", "error"} and first["error"] is None
    assert first["response"]["status_code"] == 200
    assert first["response"]["body"]["answer"] == "Q0"
    errors = {r["custom_id"]: r for r in rows_of(store, "k1", done.error_file_id)}
    assert errors["c3"]["response"]["status_code"] == 400  # the route's own 4xx, kept whole
    assert errors[None]["response"] is None
    assert errors[None]["error"]["code"] == "invalid_request"
    shown = done.as_openai()
    assert shown["output_file_id"] == done.output_file_id
    assert shown["error_file_id"] == done.error_file_id
    assert shown["request_counts"] == {"total": 7, "completed": 5, "failed": 2}
    assert store.get_file("k1", done.output_file_id).purpose == "batch_output"
    assert run(store, "k1", state.id, answers).status == "completed"  # a final batch stays put
    assert len(answers.calls) == 6


def test_a_killed_runner_resumes_answering_each_line_once(store):
    rows = [line(i) for i in range(12)]
    record = store.add_file("k1", "in.jsonl", "batch", jsonl(rows))
    state = store.new_batch("k1", ENDPOINT, record.id, None)
    first = Answers(stop_after=5)

    async def killed() -> None:
        runner = BatchRunner(store, "k1", state.id, first, 2, retry_s=0.001)
        task = asyncio.create_task(runner.run())
        while len(first.calls) < 7:  # two lines hang in flight, five are written
            await asyncio.sleep(0)
        task.cancel()  # the ingress dies: the two in flight were never answered
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(killed())
    path = store.content_path("k1", state.output_file_id)
    with open(path, "ab") as f:
        f.write(b'{"id": "batch_req_torn')  # a write cut short by the crash
    midway = store.get_batch("k1", state.id)
    assert midway.status == "in_progress" and midway.completed + midway.failed == 5
    second = Answers()
    done = run(store, "k1", state.id, second)
    assert done.status == "completed" and (done.completed, done.failed) == (11, 1)
    answered = [
        r["custom_id"]
        for f in (done.output_file_id, done.error_file_id)
        for r in rows_of(store, "k1", f)
    ]
    assert sorted(answered) == sorted(f"c{i}" for i in range(12))  # each once
    assert len(second.calls) == 12 - 5


def test_cancel_stops_the_batch_and_keeps_what_was_answered(store):
    record = store.add_file("k1", "in.jsonl", "batch", jsonl([line(i) for i in range(10)]))
    state = store.new_batch("k1", ENDPOINT, record.id, None)
    answers = Answers(stop_after=3)

    async def cancelled():
        runner = BatchRunner(store, "k1", state.id, answers, 1, retry_s=0.001)
        task = asyncio.create_task(runner.run())
        while len(answers.calls) < 4:
            await asyncio.sleep(0)
        runner.cancel()
        return await task

    done = asyncio.run(cancelled())
    assert done.status == "cancelled" and done.times["cancelled_at"] >= done.created_at
    assert (done.completed, done.failed) == (3, 0)  # q0, q1, q2; q3 abandoned in flight
    assert done.as_openai()["output_file_id"] == done.output_file_id


def test_cancel_written_by_another_replica_is_seen(store):
    record = store.add_file("k1", "in.jsonl", "batch", jsonl([line(i) for i in range(4)]))
    state = store.new_batch("k1", ENDPOINT, record.id, None)
    state.mark("cancelling")
    store.save_batch("k1", state)
    answers = Answers()
    done = run(store, "k1", state.id, answers)
    assert done.status == "cancelled" and answers.calls == []
    assert done.as_openai()["output_file_id"] is None  # nothing answered, no output file


def test_input_deleted_before_the_run_fails_the_batch(store):
    record = store.add_file("k1", "in.jsonl", "batch", jsonl([line(0)]))
    state = store.new_batch("k1", ENDPOINT, record.id, None)
    store.delete_file("k1", record.id)
    done = run(store, "k1", state.id, Answers())
    assert done.status == "failed" and done.errors[0]["code"] == "missing_input_file"


def test_unfinished_lists_what_a_restart_resumes(store):
    record = store.add_file("k1", "in.jsonl", "batch", jsonl([line(0)]))
    pending = store.new_batch("k1", ENDPOINT, record.id, None)
    finished = store.new_batch("k1", ENDPOINT, record.id, None)
    run(store, "k1", finished.id, Answers())
    assert [(o, s.id) for o, s in store.unfinished()] == [("k1", pending.id)]


def test_done_lines_cuts_a_torn_tail(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": "batch_req_ab_3"}\n{"id": "batch_req_ab_4"}\n{"id": "ba')
    assert done_lines(path) == {3, 4}
    assert path.read_bytes().endswith(b"}\n")


def test_listings_keep_creation_order_within_a_second(store):
    record = store.add_file("k1", "in.jsonl", "batch", jsonl([line(0)]))
    made = [store.new_batch("k1", ENDPOINT, record.id, None).id for _ in range(6)]
    assert [s.id for s in store.list_batches("k1")] == made[::-1]  # newest first, as OpenAI
    files = [store.add_file("k1", "f", "batch", jsonl([line(0)])).id for _ in range(3)]
    assert [f.id for f in store.list_files("k1")][-3:] == files
