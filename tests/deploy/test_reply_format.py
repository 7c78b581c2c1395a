"""`answer`: one reading of a generation's deltas for every output format. Streamed, an error
before the first delta keeps its HTTP status and one after it becomes the format's error event,
followed by its closing events; whole, the format's object once every delta is in."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from deploy.errors import RequestTimeoutError
from deploy.generation import ChoiceDelta
from deploy.reply import ReplySplit
from deploy.reply_format import TypedEvents, answer, sse, typed_sse
from deploy.responses import ResponsesRequest
from deploy.responses_events import ResponseBuilder


def _deltas(texts: list[str], fail_after: int | None = None) -> AsyncIterator[ChoiceDelta]:
    async def gen() -> AsyncIterator[ChoiceDelta]:
        for i, text in enumerate(texts):
            if fail_after is not None and i == fail_after:
                raise RequestTimeoutError("deadline passed", code="request_timeout")
            last = i == len(texts) - 1
            yield ChoiceDelta(0, 0, text, [5 + i], None, "stop" if last else None, 3, i + 1, 0)

    return gen()


def _format() -> TypedEvents:
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi"})
    builder = ResponseBuilder(body, "m", ReplySplit(None))
    return TypedEvents(builder, builder.response)


def _streamed(deltas: AsyncIterator[ChoiceDelta]) -> tuple[int, bytes]:
    """The status and the body of a streamed answer (read in the loop that started it)."""

    async def run() -> tuple[int, bytes]:
        response = await answer(_format(), deltas, stream=True)
        if not hasattr(response, "body_iterator"):
            return response.status_code, response.body
        return response.status_code, b"".join([c async for c in response.body_iterator])

    return asyncio.run(run())


def _events(raw: bytes) -> list[dict]:
    return [
        json.loads(line[len("data: ") :])
        for line in raw.decode().splitlines()
        if line.startswith("data: ")
    ]


def test_a_whole_reply_is_the_formats_object_of_every_delta():
    response = asyncio.run(answer(_format(), _deltas(["Hel", "lo"]), stream=False))
    assert response.status_code == 200
    reply = json.loads(response.body)
    assert reply["status"] == "completed"
    assert reply["output"][0]["content"][0]["text"] == "Hello"
    assert reply["usage"]["output_tokens"] == 2


def test_a_streamed_reply_sends_the_formats_events_in_order():
    status, raw = _streamed(_deltas(["Hel", "lo"]))
    assert status == 200
    events = _events(raw)
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == ["Hel", "lo"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_an_error_before_the_first_delta_keeps_its_status():
    status, raw = _streamed(_deltas(["a"], fail_after=0))
    assert status == 408
    assert json.loads(raw)["error"]["code"] == "request_timeout"


def test_an_error_after_the_stream_began_is_the_formats_last_event():
    status, raw = _streamed(_deltas(["a", "b", "c"], fail_after=2))
    assert status == 200
    events = _events(raw)
    assert events[-1]["type"] == "error"
    assert events[-1]["code"] == "request_timeout"
    assert "response.completed" not in [e["type"] for e in events]


def test_a_whole_reply_that_fails_is_the_error_json_of_its_status():
    response = asyncio.run(answer(_format(), _deltas(["a", "b"], fail_after=1), stream=False))
    assert response.status_code == 408
    assert json.loads(response.body)["error"]["code"] == "request_timeout"


def test_the_two_sse_encodings():
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert typed_sse({"type": "t", "x": 1}) == b'event: t\ndata: {"type":"t","x":1}\n\n'
