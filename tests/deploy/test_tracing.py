"""OpenTelemetry tracing, served: a request's spans from the ingress, the fleet router, the replica
and the engine form one tree under the client's traceparent, streamed, whole and migrated; a
malformed traceparent starts a new trace; an unsampled one records nothing.

Every process exports its own spans over OTLP/HTTP, as in production, to a collector this module
runs on loopback (`Collector`: it decodes the protobuf export requests), so the test reads the
spans of the ingress and of both replicas, which live in other Ray worker processes. The ingress's
sampling decisions are also checked in-process against the SDK's in-memory exporter.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import ray
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.requests import Request

from cluster.tracing import TracingConfig, use_exporter
from deploy.tracing import start_request
from tests.deploy.conftest import delete_app, run_app, wait_for

APP = "traced"
MODEL = "tiny-traced"
# Long enough that a replica is still generating when the test kills it (the 4,096-position model).
LONG_TOKENS = 1000


@dataclass(frozen=True, slots=True)
class SpanSeen:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    attributes: dict
    start_ns: int
    end_ns: int
    error: bool


class Collector:
    """An OTLP/HTTP traces endpoint on 127.0.0.1 that keeps every span it receives."""

    def __init__(self) -> None:
        self.spans: list[SpanSeen] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                collector.receive(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/traces"

    def receive(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        request = ExportTraceServiceRequest.FromString(body)
        seen = [
            SpanSeen(
                s.trace_id.hex(),
                s.span_id.hex(),
                s.parent_span_id.hex(),
                s.name,
                {a.key: _value(a.value) for a in s.attributes},
                s.start_time_unix_nano,
                s.end_time_unix_nano,
                s.status.code == 2,  # STATUS_CODE_ERROR
            )
            for resource in request.resource_spans
            for scope in resource.scope_spans
            for s in scope.spans
        ]
        with self.lock:
            self.spans += seen

    def trace(self, trace_id: str) -> list[SpanSeen]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    yield c
    c.server.shutdown()


@pytest.fixture(scope="module")
def traced_url(ray_cluster, http_port, long_tiny_model_dir, collector):
    """Two replicas of the tiny model, every request traced, spans sent within 0.1 s."""
    from deploy.app import build_app

    args = {
        "model": long_tiny_model_dir,
        "served_model_name": MODEL,
        "max_model_len": 4096,
        "num_gpu_blocks": 600,
        "num_replicas": 2,
        "replica_num_cpus": 0.5,
        "ingress_num_cpus": 0.25,
        "tracing": {"otlp_endpoint": collector.url, "export_delay_s": 0.1},
        # The replica Serve starts in place of the one the migration test kills is still starting
        # when the module deletes the app: stopped, it is killed at this timeout (30 s by default:
        # it would finish starting beside the next module's work).
        "graceful_shutdown_timeout_s": 1,
    }
    run_app(build_app(args), APP, f"/{APP}")
    yield f"http://127.0.0.1:{http_port}/{APP}/v1"
    delete_app(APP)


def _traceparent(sampled: bool = True) -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}", trace_id, span_id


def _tree(collector: Collector, trace_id: str, replicas: int = 1) -> dict[str, list[SpanSeen]]:
    """The trace's spans by name, once the ingress's request span and `replicas` replica spans
    (exported by their own processes) have arrived."""

    def complete() -> bool:
        names = [s.name for s in collector.trace(trace_id)]
        return (
            "raylm.replica" in names
            and names.count("raylm.replica") >= replicas
            and any(n.startswith(("chat ", "text_completion ")) for n in names)
        )

    assert wait_for(complete, timeout=60), [s.name for s in collector.trace(trace_id)]
    by_name: dict[str, list[SpanSeen]] = {}
    for span in collector.trace(trace_id):
        by_name.setdefault(span.name, []).append(span)
    return by_name


def _check_request_tree(spans: dict[str, list[SpanSeen]], client_span: str, op: str) -> None:
    """One request span under the client's, one attempt under it, the router's decision and the
    replica's request under the attempt, the engine's phases under the replica's."""
    (root,) = spans[f"{op} {MODEL}"]
    assert root.parent_id == client_span and not root.error
    assert root.attributes["gen_ai.request.model"] == MODEL
    assert root.attributes["gen_ai.operation.name"] == op
    assert root.attributes["gen_ai.request.max_tokens"] == 8
    assert root.attributes["gen_ai.usage.output_tokens"] == 8
    assert root.attributes["gen_ai.usage.input_tokens"] > 0
    assert root.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert root.attributes["http.response.status_code"] == 200
    (attempt,) = spans["raylm.attempt"]
    assert attempt.parent_id == root.span_id and attempt.attributes["raylm.migration"] == 0
    (route,) = spans["raylm.route"]
    (replica,) = spans["raylm.replica"]
    assert route.parent_id == replica.parent_id == attempt.span_id
    assert route.attributes["raylm.router.candidates"] == 2
    assert route.attributes["raylm.router.ranking"][0] in replica.attributes["raylm.replica"]
    assert replica.attributes["gen_ai.usage.output_tokens"] == 8
    assert replica.attributes["gen_ai.response.finish_reasons"] == ["length"]
    phases = [spans[n][0] for n in ("raylm.queue", "raylm.prefill", "raylm.decode")]
    assert all(p.parent_id == replica.span_id for p in phases)
    assert phases[0].end_ns <= phases[1].start_ns < phases[1].end_ns <= phases[2].start_ns
    assert spans["raylm.decode"][0].attributes["raylm.decode.steps"] == 7  # 1st token: prefill's
    assert root.start_ns <= attempt.start_ns <= replica.start_ns <= replica.end_ns <= root.end_ns


def test_a_whole_chat_completion_is_one_tree_under_the_client_s_traceparent(traced_url, collector):
    header, trace_id, client_span = _traceparent()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    body["ignore_eos"] = True
    r = httpx.post(f"{traced_url}/chat/completions", json=body, headers={"traceparent": header})
    assert r.status_code == 200, r.text
    _check_request_tree(_tree(collector, trace_id), client_span, "chat")


def test_a_streamed_completion_is_one_tree_under_the_client_s_traceparent(traced_url, collector):
    header, trace_id, client_span = _traceparent()
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 8, "ignore_eos": True}
    with httpx.stream(
        "POST",
        f"{traced_url}/completions",
        json={**body, "stream": True},
        headers={"traceparent": header},
    ) as r:
        assert r.status_code == 200
        assert "data: [DONE]" in r.read().decode()
    _check_request_tree(_tree(collector, trace_id), client_span, "text_completion")


def test_a_malformed_traceparent_starts_a_new_trace_and_never_a_5xx(traced_url, collector):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    for header in ("00-zz-11-01", "ff-" + "0" * 32 + "-" + "0" * 16 + "-01", "00-" + "a" * 4000):
        r = httpx.post(f"{traced_url}/completions", json=body, headers={"traceparent": header})
        assert r.status_code == 200, r.text
        attempt_id = r.json()["id"] + "-0"

        def attempt_and_root(attempt_id=attempt_id):
            # The attempt ends before its root, so the two may reach the collector in different
            # export batches: wait for both.
            with collector.lock:
                found = [
                    s
                    for s in collector.spans
                    if s.name == "raylm.attempt" and s.attributes["raylm.request_id"] == attempt_id
                ]
            if not found:
                return None
            span = found[0]
            roots = [s for s in collector.trace(span.trace_id) if s.span_id == span.parent_id]
            return (span, roots) if roots else None

        seen = wait_for(attempt_and_root, timeout=60)
        assert seen is not None, header
        _, (root,) = seen
        assert root.parent_id == "", "a malformed traceparent must not be a parent"


def test_an_unsampled_traceparent_records_nothing(traced_url, collector):
    unsampled, quiet_id, _ = _traceparent(sampled=False)
    sampled, loud_id, _ = _traceparent()
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    for header in (unsampled, sampled):  # one ingress, one export queue: in this order
        r = httpx.post(f"{traced_url}/completions", json=body, headers={"traceparent": header})
        assert r.status_code == 200, r.text
    _tree(collector, loud_id)
    assert collector.trace(quiet_id) == []


def _replica_actor(unique_id: str) -> str:
    """The name of the app's live LLMReplica actor whose id is `unique_id`."""
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if f"{APP}#LLMReplica" in a["name"] and unique_id in a["name"]
    ]
    assert len(names) == 1, names
    return names[0]


async def _stream_and_kill(url: str, collector: Collector, header: str, trace_id: str) -> str:
    """Stream a long completion; once it streams, kill the replica the router chose for it."""
    body = {"model": MODEL, "prompt": "A long story:", "max_tokens": LONG_TOKENS}
    body.update(ignore_eos=True, stream=True)
    text, killed = "", False
    async with (
        httpx.AsyncClient(timeout=300) as client,
        client.stream(
            "POST", f"{url}/completions", json=body, headers={"traceparent": header}
        ) as r,
    ):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            text += event["choices"][0]["text"]
            if not killed:
                route = wait_for(
                    lambda: [s for s in collector.trace(trace_id) if s.name == "raylm.route"]
                )
                victim = route[0].attributes["raylm.router.ranking"][0]
                ray.kill(ray.get_actor(_replica_actor(victim), namespace="serve"), no_restart=True)
                killed = True
    return text


def test_a_migrated_stream_shows_both_attempts(traced_url, collector):
    header, trace_id, client_span = _traceparent()
    asyncio.run(_stream_and_kill(traced_url, collector, header, trace_id))
    spans = _tree(collector, trace_id)
    (root,) = spans[f"text_completion {MODEL}"]
    assert root.parent_id == client_span and not root.error
    assert root.attributes["gen_ai.usage.output_tokens"] == LONG_TOKENS
    first, second = sorted(spans["raylm.attempt"], key=lambda s: s.attributes["raylm.migration"])
    assert first.parent_id == second.parent_id == root.span_id
    assert [first.attributes["raylm.migration"], second.attributes["raylm.migration"]] == [0, 1]
    assert first.error and not second.error and first.end_ns <= second.start_ns
    assert second.attributes["raylm.request_id"] == first.attributes["raylm.request_id"] + "-m1"
    # The killed replica's spans died with it; the survivor's hang under the second attempt, and
    # it recomputed what the first had generated as part of its prompt.
    (replica,) = spans["raylm.replica"]
    assert replica.parent_id == second.span_id
    prefill = [s for s in spans["raylm.prefill"] if s.parent_id == replica.span_id]
    computed = sum(s.attributes["raylm.prefill.tokens"] for s in prefill)
    made = replica.attributes["gen_ai.usage.output_tokens"]
    assert 0 < made < LONG_TOKENS
    assert computed == replica.attributes["gen_ai.usage.input_tokens"] + LONG_TOKENS - made


# ---- the ingress's sampling decisions, in-process ------------------------------------------------
def _request(headers: dict[str, str]) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": raw}
    scope.update(query_string=b"", server=("127.0.0.1", 8000), scheme="http", root_path="")
    return Request(scope)


@pytest.fixture
def memory():
    """Tracing settings whose spans go to an in-memory exporter in this process."""

    def make(ratio: float) -> tuple[TracingConfig, InMemorySpanExporter]:
        config = TracingConfig(otlp_endpoint="http://127.0.0.1:9/v1/traces", sample_ratio=ratio)
        exporter = InMemorySpanExporter()
        use_exporter(config, exporter)
        return config, exporter

    return make


def test_tracing_off_or_sample_ratio_zero_makes_no_span(memory):
    header, _, _ = _traceparent()
    assert start_request(None, _request({"traceparent": header})) is None
    config, exporter = memory(0.0)
    for headers in ({}, {"traceparent": header}):
        assert start_request(config, _request(headers)) is None
    assert exporter.get_finished_spans() == ()


def test_the_client_s_trace_is_continued_and_a_bad_one_replaced(memory):
    config, exporter = memory(1.0)
    header, trace_id, client_span = _traceparent()
    for headers in (
        {"traceparent": header},
        {"traceparent": "00-" + "0" * 32 + "-" + "1" * 16 + "-01"},
        {},
    ):
        span = start_request(config, _request(headers))
        assert span is not None
        span.end(200)
    good, zero_id, none = exporter.get_finished_spans()
    assert (
        f"{good.context.trace_id:032x}" == trace_id and f"{good.parent.span_id:016x}" == client_span
    )
    assert zero_id.parent is None and none.parent is None  # an all-zero trace id is invalid
    assert good.attributes["gen_ai.operation.name"] == "text_completion"
    unsampled, _, _ = _traceparent(sampled=False)
    assert start_request(config, _request({"traceparent": unsampled})) is None
    assert len(exporter.get_finished_spans()) == 3


def test_the_tracing_settings_refuse_bad_values():
    url = "http://127.0.0.1:4318/v1/traces"
    for field, bad in [
        ("sample_ratio", 2**64),
        ("sample_ratio", -1),
        ("sample_ratio", float("nan")),
        ("sample_ratio", 1e300),
        ("export_delay_s", 2**64),
        ("export_delay_s", -1),
        ("export_delay_s", float("nan")),
        ("export_delay_s", 0),
        ("otlp_endpoint", "http://" + "a" * 10**6),
        ("otlp_endpoint", "ftp://collector"),
        ("otlp_endpoint", "http://collector /v1"),
        ("otlp_endpoint", 2**64),
        ("service_name", "x" * 10**6),
        ("service_name", ""),
        ("service_name", "a\nb"),
        ("service_name", -1),
    ]:
        with pytest.raises(ValueError, match=f"tracing.{field}"):
            from deploy.config import AppConfig

            AppConfig.from_args({"tracing": {"otlp_endpoint": url, field: bad}})


def test_the_endpoint_comes_from_the_environment_when_unset(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    with pytest.raises(ValueError, match="otlp_endpoint: set it, or OTEL_EXPORTER_OTLP_TRACES"):
        TracingConfig()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://tempo:4318/v1/traces")
    assert TracingConfig().otlp_endpoint == "http://tempo:4318/v1/traces"
