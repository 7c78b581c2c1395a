"""The ingress's spans: one SERVER span per sampled HTTP request, parented under the client's W3C
`traceparent` (a malformed one is ignored: a new trace), with the OpenTelemetry GenAI attributes;
under it one span per attempt of each choice (a migrated choice has several), whose context goes
to the fleet router and the replica with the request (cluster/tracing.py `TraceContext`).

Off, or for a request the sampler leaves out, there is no `RequestSpan`: `start_request` returns
None and every hook is one `is None` test. The request's span travels to the choices it makes in
a context variable set for the duration of the route's answer (`current`).
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from cluster.tracing import TraceContext, TracingConfig, parent_of, traceparent_of, tracer

# The GenAI semantic conventions' operation of each generating route.
OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/messages": "chat",
    "/v1/responses": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
}
# What a span may say of a body's numbers: plain finite numbers, never a client's object.
_NUMERIC = (int, float)

_CURRENT: contextvars.ContextVar[RequestSpan | None] = contextvars.ContextVar(
    "raylm_request_span", default=None
)


def current_span() -> RequestSpan | None:
    """The sampled request the code running now answers (None: tracing off, or not sampled)."""
    return _CURRENT.get()


@dataclass(slots=True)
class RequestSpan:
    """One sampled HTTP request's span, and what its choices report for its usage attributes."""

    config: TracingConfig
    span: Any  # opentelemetry.trace.Span
    operation: str
    prompts: dict[int, int] = field(default_factory=dict)  # prompt index -> its tokens
    outputs: dict[int, int] = field(default_factory=dict)  # choice index -> tokens generated
    finishes: dict[int, str] = field(default_factory=dict)  # choice index -> finish reason

    def describe(self, served_model: str, body: Any) -> None:
        """The request's GenAI attributes, once its body is valid."""
        span = self.span
        span.update_name(f"{self.operation} {served_model}")
        span.set_attribute("gen_ai.request.model", str(getattr(body, "model", None) or ""))
        span.set_attribute("gen_ai.response.model", served_model)
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
            value = getattr(body, name, None)
            if isinstance(value, _NUMERIC) and not isinstance(value, bool):
                span.set_attribute(f"gen_ai.request.{name}", value)
        n = getattr(body, "n", None)
        if isinstance(n, int) and n > 1:
            span.set_attribute("gen_ai.request.choice.count", n)

    def attempt(self, choice: int, migration: int, request_id: str) -> Attempt:
        """A span for one attempt of a choice on the replicas (migration 0: its first)."""
        from opentelemetry.trace import set_span_in_context

        span = tracer(self.config).start_span(
            "raylm.attempt",
            context=set_span_in_context(self.span),
            attributes={
                "raylm.choice.index": choice,
                "raylm.migration": migration,
                "raylm.request_id": request_id,
            },
        )
        return Attempt(span, TraceContext(traceparent_of(span), self.config))

    def choice_done(
        self, index: int, prompt_index: int, num_prompt: int, num_output: int, finish: str
    ) -> None:
        self.prompts[prompt_index] = num_prompt
        self.outputs[index] = num_output
        self.finishes[index] = finish

    def end(self, status: int, error: BaseException | None = None) -> None:
        span = self.span
        span.set_attribute("http.response.status_code", status)
        if self.finishes:
            span.set_attribute("gen_ai.usage.input_tokens", sum(self.prompts.values()))
            span.set_attribute("gen_ai.usage.output_tokens", sum(self.outputs.values()))
            reasons = [self.finishes[i] for i in sorted(self.finishes)]
            span.set_attribute("gen_ai.response.finish_reasons", reasons)
        if error is not None or status >= 500:
            _fail(span, error, f"HTTP {status}")
        span.end()


@dataclass(slots=True)
class Attempt:
    """One attempt of a choice: its span, and the context the router and the replica get."""

    span: Any
    context: TraceContext

    def fail(self, error: BaseException) -> None:
        _fail(self.span, error, type(error).__name__)


def _fail(span: Any, error: BaseException | None, description: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    if error is not None:
        span.set_attribute("error.type", type(error).__name__)
    span.set_status(Status(StatusCode.ERROR, description))


def start_request(config: TracingConfig | None, request: Request) -> RequestSpan | None:
    """The request's span when tracing is on and the sampler keeps it, else None."""
    if config is None:
        return None
    from opentelemetry.trace import SpanKind

    path = request.url.path
    operation = next((op for p, op in OPERATIONS.items() if path.endswith(p)), "http")
    parent = parent_of(request.headers.get("traceparent", ""))
    span = tracer(config).start_span(
        f"{request.method} {path}",
        context=parent,
        kind=SpanKind.SERVER,
        attributes={
            "http.request.method": request.method,
            "url.path": path,
            "gen_ai.operation.name": operation,
        },
    )
    if not span.is_recording():  # the sampler left it out: nothing more is made for it
        return None
    return RequestSpan(config, span, operation)


class current:
    """`with current(span):` the span of the request being answered (for the choices it makes);
    a cancelled answer (the client gone) ends the span. A no-op for None."""

    __slots__ = ("span", "token")

    def __init__(self, span: RequestSpan | None) -> None:
        self.span = span
        self.token: contextvars.Token | None = None

    def __enter__(self) -> None:
        if self.span is not None:
            self.token = _CURRENT.set(self.span)

    def __exit__(self, kind: Any, error: Any, tb: Any) -> None:
        if self.token is not None:
            _CURRENT.reset(self.token)
        if self.span is not None and error is not None and not isinstance(error, Exception):
            self.span.end(499, error)  # cancelled: no response will be sent


def ended_with(span: RequestSpan | None, response: Response) -> Response:
    """`response`, with the request's span ended now, or, for a stream, when the stream ends."""
    if span is None:
        return response
    if not isinstance(response, StreamingResponse):
        span.end(response.status_code)
        return response
    response.body_iterator = _ending(response.body_iterator, span, response.status_code)
    return response


async def _ending(body: AsyncIterable[Any], span: RequestSpan, status: int) -> AsyncIterator[Any]:
    error: BaseException | None = None
    try:
        async for chunk in body:
            yield chunk
    except BaseException as exc:
        error = exc
        raise
    finally:
        span.end(status if error is None else 499, error)
