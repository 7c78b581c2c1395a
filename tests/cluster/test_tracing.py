"""The Ray side's spans (cluster/tracing.py), in-process with the SDK's in-memory exporter: a
replica's request from the engine's record (queue, KV load, prefill chunks, decode) and the fleet
router's decision, each under the attempt's traceparent; and raylm's serving modules import
without the OpenTelemetry SDK."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cluster.tracing import (
    ReplicaSide,
    TraceContext,
    TracingConfig,
    record_replica,
    record_route,
    use_exporter,
)
from engine.tracing import Chunk, RequestTrace

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
MS = 1_000_000
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def traced() -> tuple[TraceContext, InMemorySpanExporter]:
    config = TracingConfig(otlp_endpoint="http://127.0.0.1:9/v1/traces", service_name="replica-t")
    exporter = InMemorySpanExporter()
    use_exporter(config, exporter)
    return TraceContext(f"00-{TRACE_ID}-{PARENT}-01", config), exporter


def _record() -> RequestTrace:
    """Queued 1 ms, a 2 ms KV load, two prefill chunks, three decode steps, finished at 20 ms."""
    t0 = 1_700_000_000_000 * MS
    record = RequestTrace(t0, scheduled_ns=t0 + 3 * MS, num_cached_tokens=32)
    record.kv_loads.append((t0 + 1 * MS, t0 + 3 * MS))
    record.prefill += [
        Chunk(t0 + 3 * MS, 64, 32, t0 + 6 * MS),
        Chunk(t0 + 6 * MS, 8, 96, t0 + 8 * MS),
    ]
    record.decode = Chunk(t0 + 8 * MS, 3, 104, t0 + 17 * MS, steps=3)
    record.finish_ns, record.finish_reason = t0 + 20 * MS, "length"
    return record


def test_a_replica_s_spans_form_one_tree_under_the_attempt(traced):
    trace, exporter = traced
    record = _record()
    side = ReplicaSide("replica-a", "cmpl-1-0", 104, 4, "decode", "remote")
    record_replica(trace, side, record, end_ns=0)
    spans = {s.name: [] for s in exporter.get_finished_spans()}
    for s in exporter.get_finished_spans():
        spans[s.name].append(s)
    (root,) = spans["raylm.replica"]
    assert f"{root.context.trace_id:032x}" == TRACE_ID and f"{root.parent.span_id:016x}" == PARENT
    assert root.resource.attributes["service.name"] == "replica-t"
    assert (root.start_time, root.end_time) == (record.arrival_ns, record.finish_ns)
    assert root.attributes["gen_ai.usage.input_tokens"] == 104
    assert root.attributes["gen_ai.usage.output_tokens"] == 4
    assert root.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert root.attributes["raylm.num_cached_tokens"] == 32
    assert root.attributes["raylm.disagg.role"] == "decode"
    children = [s for s in exporter.get_finished_spans() if s is not root]
    assert all(s.parent.span_id == root.context.span_id for s in children)
    (queue,) = spans["raylm.queue"]
    assert (queue.start_time, queue.end_time) == (record.arrival_ns, record.scheduled_ns)
    (load,) = spans["raylm.kv_load"]
    assert (load.start_time, load.end_time) == record.kv_loads[0]
    assert load.attributes["raylm.kv.source"] == "remote"
    chunks = [
        (s.attributes["raylm.prefill.first_token"], s.attributes["raylm.prefill.tokens"])
        for s in spans["raylm.prefill"]
    ]
    assert chunks == [(32, 64), (96, 8)]
    (decode,) = spans["raylm.decode"]
    assert (decode.start_time, decode.end_time) == (record.decode.start_ns, record.decode.end_ns)
    assert decode.attributes["raylm.decode.tokens"] == 3
    assert decode.attributes["raylm.decode.steps"] == 3


def test_an_unfinished_record_ends_where_the_replica_gave_up(traced):
    """A cancelled request: its open chunk and the replica span end at the time given."""
    trace, exporter = traced
    record = _record()
    record.finish_ns = record.finish_reason = None
    record.decode.end_ns = 0  # a step was in flight when it was cancelled
    end = record.decode.start_ns + 20 * MS
    record_replica(trace, ReplicaSide("r", "x", 104, 2, "whole", "tiers"), record, end_ns=end)
    by_name = {s.name: s for s in exporter.get_finished_spans()}
    assert by_name["raylm.replica"].end_time == by_name["raylm.decode"].end_time == end
    assert "gen_ai.response.finish_reasons" not in by_name["raylm.replica"].attributes


def test_the_router_s_decision_lists_its_ranking(traced):
    trace, exporter = traced
    ranking = [f"replica-{i}" for i in range(20)]
    record_route(trace, 10 * MS, 11 * MS, "prefix_affinity", ranking)
    (span,) = exporter.get_finished_spans()
    assert span.name == "raylm.route" and f"{span.parent.span_id:016x}" == PARENT
    assert span.attributes["raylm.router.candidates"] == 20
    assert list(span.attributes["raylm.router.ranking"]) == ranking[:8]
    assert span.attributes["raylm.router.policy"] == "prefix_affinity"


def test_a_trace_context_the_sampler_drops_records_nothing(traced):
    """sample_ratio 0: even a context that reached a replica makes no span there."""
    trace, _ = traced
    config = TracingConfig(otlp_endpoint="http://127.0.0.1:9/v1/traces", sample_ratio=0.0)
    exporter = InMemorySpanExporter()
    use_exporter(config, exporter)
    off = TraceContext(trace.traceparent, config)
    record_replica(off, ReplicaSide("r", "x", 1, 1, "whole", "tiers"), _record(), end_ns=0)
    record_route(off, 0, 1, "prefix_affinity", ["r"])
    assert exporter.get_finished_spans() == ()


def _eager_imports(tree: ast.AST) -> set[str]:
    """Top-level names a module imports when it is imported: not those inside functions, nor
    those under `if TYPE_CHECKING:`."""
    names: set[str] = set()
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        names |= _eager_imports(node)
    return names


def _all_imports(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_raylm_imports_without_opentelemetry():
    """Tracing is an optional extra: no module imports OpenTelemetry when it is imported (the
    tracing modules import it inside the functions that run once tracing is configured), and
    the scheduler, the engine and the workers never import it at all."""
    eager, anywhere = [], []
    for package in sorted(p.parent.name for p in ROOT.glob("*/__init__.py")):
        if package == "tests":
            continue
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            if "opentelemetry" in _eager_imports(tree):
                eager.append(str(path.relative_to(ROOT)))
            if package in ("scheduler", "engine", "workers") and "opentelemetry" in _all_imports(
                tree
            ):
                anywhere.append(str(path.relative_to(ROOT)))
    assert not eager, eager
    assert not anywhere, anywhere
    assert "opentelemetry" in _eager_imports(ast.parse("import opentelemetry.trace"))
    lazy = "def f():\n    import opentelemetry\nif TYPE_CHECKING:\n    import opentelemetry"
    assert _eager_imports(ast.parse(lazy)) == set()
