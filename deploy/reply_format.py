"""How a generation's deltas become an HTTP reply, for any output format.

A format (chat.completion, text_completion, the Responses object, ...) is a `ReplyFormat`: the
events of a streamed reply, or the whole reply once every delta is in. `answer` runs one over a
generation's deltas, streamed or not; the format never decides how the deltas are read.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi.responses import JSONResponse, Response, StreamingResponse

from deploy.errors import error_response
from deploy.generation import ChoiceDelta


class ReplyFormat(Protocol):
    """One reply in one output format. Streamed: `start`, `feed` per delta, then `end`, or `error`
    when the generation fails after the stream began; `close` always last. Whole: `add` per delta,
    then `whole`."""

    def start(self) -> list[bytes]: ...

    def feed(self, delta: ChoiceDelta) -> list[bytes]: ...

    def end(self) -> list[bytes]: ...

    def error(self, exc: Exception) -> list[bytes]: ...

    def close(self) -> list[bytes]: ...

    def add(self, delta: ChoiceDelta) -> None: ...

    async def whole(self) -> Response: ...


async def answer(fmt: ReplyFormat, deltas: AsyncIterator[ChoiceDelta], stream: bool) -> Response:
    """The reply: server-sent events as the deltas arrive, or the whole reply at the end. An error
    before the first delta (overload, a replica's rejection) keeps its HTTP status."""
    if stream:
        try:
            first = await anext(deltas, None)
        except Exception as exc:
            return error_response(exc)
        return StreamingResponse(
            _events(fmt, _prepend(first, deltas)), media_type="text/event-stream"
        )
    try:
        async for delta in deltas:
            fmt.add(delta)
        return await fmt.whole()
    except Exception as exc:
        return error_response(exc)


async def _events(fmt: ReplyFormat, deltas: AsyncIterator[ChoiceDelta]) -> AsyncIterator[bytes]:
    for event in fmt.start():
        yield event
    try:
        async for delta in deltas:
            for event in fmt.feed(delta):
                yield event
        for event in fmt.end():
            yield event
    except Exception as exc:
        for event in fmt.error(exc):
            yield event
    for event in fmt.close():
        yield event


async def _prepend(
    first: ChoiceDelta | None, rest: AsyncIterator[ChoiceDelta]
) -> AsyncIterator[ChoiceDelta]:
    if first is not None:
        yield first
        async for delta in rest:
            yield delta


def sse(payload: dict | str) -> bytes:
    """One OpenAI server-sent event (`data:` only)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def typed_sse(event: dict[str, Any]) -> bytes:
    """One typed server-sent event (`event:` then `data:`), as the Responses API sends them."""
    data = json.dumps(event, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


class EventBuilder(Protocol):
    """A reply built as typed events (the Responses API, Anthropic's Messages): each delta returns
    the events it makes; the whole reply is the object the events built."""

    def start(self) -> list[dict[str, Any]]: ...

    def feed(self, delta: ChoiceDelta) -> list[dict[str, Any]]: ...

    def error(self, exc: BaseException) -> dict[str, Any]: ...


@dataclass(slots=True)
class TypedEvents:
    """A `ReplyFormat` over an EventBuilder: its events as typed SSE, its object as the whole
    reply (`result`: the builder's finished object, e.g. `ResponseBuilder.response`)."""

    builder: EventBuilder
    result: Callable[[], dict[str, Any]]
    encode: Callable[[dict[str, Any]], bytes] = typed_sse

    def start(self) -> list[bytes]:
        return [self.encode(e) for e in self.builder.start()]

    def feed(self, delta: ChoiceDelta) -> list[bytes]:
        return [self.encode(e) for e in self.builder.feed(delta)]

    def end(self) -> list[bytes]:
        return []

    def error(self, exc: Exception) -> list[bytes]:
        return [self.encode(self.builder.error(exc))]

    def close(self) -> list[bytes]:
        return []

    def add(self, delta: ChoiceDelta) -> None:
        self.builder.feed(delta)

    async def whole(self) -> Response:
        return JSONResponse(self.result())
