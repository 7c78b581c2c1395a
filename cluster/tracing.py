"""OpenTelemetry tracing: the settings, each process's exporter, and the spans the Ray side makes
(the fleet router's decision; a replica's request, built after it ends from the engine's record).

The trace context crosses from the ingress to the router and the replicas as a `TraceContext`
(the W3C `traceparent` of the span to parent under, and the settings to export with), passed only
for a sampled request: a request without one costs the router and the replica one `is None`.
OpenTelemetry is imported lazily, so raylm imports without it while tracing is off (the
`tracing` extra installs it). docs/tracing.md has the span tree and its attributes.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from settings import check_settings, clipped, setting

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Tracer

    from engine.tracing import Chunk, RequestTrace

logger = logging.getLogger(__name__)

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"  # OpenTelemetry's own variable
MAX_ENDPOINT_CHARS = 2048
MAX_SERVICE_NAME_CHARS = 256
_ENDPOINT = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+(/[\x21-\x7e]*)?")  # host[:port][/path]
_SERVICE_NAME = re.compile(r"[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?")  # printable ASCII, trimmed
# How many replicas of its ranking a router span lists (a fleet may have hundreds).
MAX_RANKING_SHOWN = 8


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """Where and how much to trace (the app's `tracing:` section; docs/tracing.md)."""

    otlp_endpoint: str | None = setting(
        None,
        "OTLP/HTTP traces endpoint the spans are sent to, `http(s)://host:port/v1/traces` "
        f"(unset: {ENDPOINT_ENV} where the app is built)",
    )
    service_name: str = setting("raylm", "the spans' `service.name` resource attribute")
    sample_ratio: float = setting(
        1.0,
        "the fraction of requests traced, decided by trace id (the same in every process); a "
        "client's traceparent with the sampled flag off is never traced; 0 traces nothing",
        ge=0,
        le=1,
    )
    export_delay_s: float = setting(
        5.0, "longest a finished span waits in its process before it is sent", gt=0, le=300
    )

    def __post_init__(self) -> None:
        check_settings(self)
        endpoint = self.otlp_endpoint or os.environ.get(ENDPOINT_ENV) or None
        if endpoint is None:
            raise ValueError(f"otlp_endpoint: set it, or {ENDPOINT_ENV}")
        if len(endpoint) > MAX_ENDPOINT_CHARS or not _ENDPOINT.fullmatch(endpoint):
            raise ValueError(
                f"otlp_endpoint: must be an http(s) URL of at most {MAX_ENDPOINT_CHARS} "
                f"characters, got {clipped(repr(endpoint))}"
            )
        object.__setattr__(self, "otlp_endpoint", endpoint)
        name = self.service_name
        if len(name) > MAX_SERVICE_NAME_CHARS or not _SERVICE_NAME.fullmatch(name):
            raise ValueError(
                f"service_name: must be 1 to {MAX_SERVICE_NAME_CHARS} printable ASCII "
                f"characters, got {clipped(repr(name))}"
            )


@dataclass(frozen=True, slots=True)
class TraceContext:
    """A sampled request's trace, as it crosses a process: the span to parent under, and where
    the spans go."""

    traceparent: str
    config: TracingConfig


# ---- each process's provider --------------------------------------------------------------------
_providers: dict[TracingConfig, TracerProvider] = {}
_tracers: dict[TracingConfig, Tracer] = {}
# The ingress's event loop and Serve's router loop (a thread of its own) may both make the first.
_providers_lock = threading.Lock()


def tracer(config: TracingConfig) -> Tracer:
    """This process's tracer for the settings: built on first use, exporting in batches from a
    thread of its own (a request never waits for the collector)."""
    found = _tracers.get(config)
    if found is None:
        with _providers_lock:
            found = _tracers.get(config) or _otlp_provider(config).get_tracer("raylm")
            _tracers[config] = found
    return found


def _otlp_provider(config: TracingConfig) -> TracerProvider:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint)
    delay_ms = config.export_delay_s * 1000
    return _install(config, BatchSpanProcessor(exporter, schedule_delay_millis=delay_ms))


def use_exporter(config: TracingConfig, exporter: SpanExporter) -> TracerProvider:
    """Export this process's spans of `config` through `exporter` as each ends (an in-memory
    exporter in a test, a console exporter when debugging)."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    old = _providers.pop(config, None)
    if old is not None:
        old.shutdown()
    provider = _install(config, SimpleSpanProcessor(exporter))
    _tracers[config] = provider.get_tracer("raylm")
    return provider


def _install(config: TracingConfig, processor: Any) -> TracerProvider:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased

    ratio = TraceIdRatioBased(config.sample_ratio)
    sampler = ParentBased(ratio, remote_parent_sampled=ratio, remote_parent_not_sampled=ALWAYS_OFF)
    resource = Resource.create({"service.name": config.service_name})
    provider = TracerProvider(sampler=sampler, resource=resource)
    provider.add_span_processor(processor)
    _providers[config] = provider
    return provider


def parent_of(traceparent: str) -> Any:
    """The OpenTelemetry context whose remote span is `traceparent` (an empty context when it is
    malformed: a new trace)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent})


def traceparent_of(span: Any) -> str:
    """The W3C traceparent naming `span` (its children's parent)."""
    from opentelemetry.trace import set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, set_span_in_context(span))
    return carrier["traceparent"]


def span_between(
    tracer_: Tracer, name: str, parent: Any, start_ns: int, end_ns: int, **attributes: Any
) -> Any:
    """A finished span over [start_ns, end_ns] under `parent` (a span, or a context)."""
    from opentelemetry.trace import Span, set_span_in_context

    context = set_span_in_context(parent) if isinstance(parent, Span) else parent
    span = tracer_.start_span(name, context=context, start_time=start_ns, attributes=attributes)
    span.end(end_time=max(end_ns, start_ns))
    return span


# ---- the Ray side's spans -----------------------------------------------------------------------
def record_route(
    trace: TraceContext, start_ns: int, end_ns: int, policy: str, ranking: list[str]
) -> None:
    """The fleet router's decision: the replicas it ranked, best first."""
    span_between(
        tracer(trace.config),
        "raylm.route",
        parent_of(trace.traceparent),
        start_ns,
        end_ns,
        **{
            "raylm.router.policy": policy,
            "raylm.router.candidates": len(ranking),
            "raylm.router.ranking": ranking[:MAX_RANKING_SHOWN],
        },
    )


@dataclass(frozen=True, slots=True)
class ReplicaSide:
    """What the replica knows of a request beyond the engine's record."""

    replica: str
    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int  # generated on this replica
    role: str  # "prefill", "decode" (disaggregated), or "whole"
    kv_source: str  # where its loaded KV came from: "remote" (a transfer) or "tiers"


def record_replica(
    trace: TraceContext, side: ReplicaSide, record: RequestTrace, end_ns: int
) -> None:
    """A replica's spans of one request, from the engine's record: the request on the replica,
    its queue wait, its KV loads, each prefill chunk and its decode."""
    tracer_ = tracer(trace.config)
    end = record.finish_ns or end_ns
    root = tracer_.start_span(
        "raylm.replica",
        context=parent_of(trace.traceparent),
        start_time=record.arrival_ns,
        attributes=_replica_attributes(side, record),
    )
    queued_until = record.scheduled_ns or end
    span_between(tracer_, "raylm.queue", root, record.arrival_ns, queued_until)
    for start, stop in record.kv_loads:
        span_between(
            tracer_, "raylm.kv_load", root, start, stop, **{"raylm.kv.source": side.kv_source}
        )
    for chunk in record.prefill:
        _chunk_span(tracer_, "raylm.prefill", root, chunk, end)
    if record.decode is not None:
        _decode_span(tracer_, root, record.decode, end)
    root.end(end_time=max(end, record.arrival_ns))


def _decode_span(tracer_: Tracer, parent: Any, decode: Chunk, end_ns: int) -> None:
    """The request's decode, its steps and tokens counted (still running: up to end_ns)."""
    span_between(
        tracer_,
        "raylm.decode",
        parent,
        decode.start_ns,
        decode.end_ns or end_ns,
        **{"raylm.decode.steps": decode.steps, "raylm.decode.tokens": decode.tokens},
    )


def _chunk_span(tracer_: Tracer, name: str, parent: Any, chunk: Chunk, end_ns: int) -> None:
    span_between(
        tracer_,
        name,
        parent,
        chunk.start_ns,
        chunk.end_ns or end_ns,
        **{"raylm.prefill.first_token": chunk.first, "raylm.prefill.tokens": chunk.tokens},
    )


def _replica_attributes(side: ReplicaSide, record: RequestTrace) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "raylm.replica": side.replica,
        "raylm.request_id": side.request_id,
        "raylm.disagg.role": side.role,
        "gen_ai.usage.input_tokens": side.num_prompt_tokens,
        "gen_ai.usage.output_tokens": side.num_output_tokens,
        "raylm.num_cached_tokens": record.num_cached_tokens,
        "raylm.num_preemptions": record.num_preemptions,
    }
    if record.finish_reason is not None:
        attributes["gen_ai.response.finish_reasons"] = [record.finish_reason]
    return attributes
