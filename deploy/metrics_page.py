"""GET /metrics on the HTTP port: what the ingress sees, as Prometheus text (format 0.0.4).

The ingress's own figures (finished choices by reason, end-to-end latency, requests in flight)
and each replica's latest report as this ingress's fleet router holds it (queues, KV usage,
prefix hits, state). Ray's export (ray_raylm_* on every node's metrics port) stays as it was;
these carry no `ray_` prefix. With several ingress replicas, each page is one ingress's view.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

from cluster.metrics import RequestMetrics
from router.stats import ReplicaState, RoutingStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_REPLICA_GAUGES = (
    ("raylm_num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    ("raylm_num_requests_running", "num_running", "Requests in the running batch."),
    ("raylm_num_requests_swapped", "num_swapped", "Requests swapped out to the CPU pool."),
    ("raylm_kv_cache_usage", "kv_cache_usage", "Fraction of GPU KV blocks in use (0-1)."),
    ("raylm_prefix_cache_hit_rate", "prefix_cache_hit_rate", "Prefix-cache hit rate (0-1)."),
    ("raylm_num_free_blocks", "num_free_blocks", "Free KV blocks."),
)
# A replica's cumulative figures: name, SchedulerStats field, its unit's scale, help.
_REPLICA_COUNTERS = (
    ("raylm_images_encoded_total", "num_images_encoded", 1, "Images the vision tower encoded."),
    (
        "raylm_encoder_cache_hits_total",
        "num_encoder_cache_hits",
        1,
        "Images read from the encoder cache instead of encoded.",
    ),
    ("raylm_encoder_seconds_total", "encoder_time_us", 1e-6, "The vision tower's time."),
)


def render(
    metrics: list[RequestMetrics],
    reports: dict[str, RoutingStats],
    in_flight: int,
    loras: Collection[str] | None = None,
) -> str:
    """The whole page: each model's request figures, labelled by model, then the replicas'.

    The caller chooses what the page shows (its models' metrics and replicas' reports); loras: the
    adapters it may see (None: every one), as a key scoped to some adapters sees /v1/models."""
    return "".join(f"{line}\n" for line in _lines(metrics, reports, in_flight, loras))


def _lines(
    metrics: list[RequestMetrics],
    reports: dict[str, RoutingStats],
    in_flight: int,
    loras: Collection[str] | None,
) -> Iterator[str]:
    yield from _request_lines(metrics)
    yield from _image_lines(metrics)
    yield from _head("raylm_ingress_requests_in_flight", "gauge", "HTTP requests being served.")
    yield f"raylm_ingress_requests_in_flight {in_flight}"
    yield from _replica_lines(reports)
    yield from _lora_lines(reports, loras)


def _request_lines(metrics: list[RequestMetrics]) -> Iterator[str]:
    """Each model's finished choices by reason, and its end-to-end latency histogram."""
    yield from _head("raylm_requests_total", "counter", "Finished choices by finish reason.")
    for m in metrics:
        model = f'model="{_label(m.model)}"'
        for reason, count in sorted(m.finished.items()):
            yield f'raylm_requests_total{{{model},finish_reason="{_label(reason)}"}} {count}'
    yield from _head("raylm_e2e_seconds", "histogram", "Latency of each choice at the ingress.")
    for m in metrics:
        model = f'model="{_label(m.model)}"'
        cumulative = 0
        for bound, count in zip(m.e2e_buckets, m.e2e_counts):
            cumulative += count
            yield f'raylm_e2e_seconds_bucket{{{model},le="{bound:g}"}} {cumulative}'
        yield f'raylm_e2e_seconds_bucket{{{model},le="+Inf"}} {m.e2e_count}'
        yield f"raylm_e2e_seconds_sum{{{model}}} {m.e2e_sum!r}"
        yield f"raylm_e2e_seconds_count{{{model}}} {m.e2e_count}"


def _replica_lines(reports: dict[str, RoutingStats]) -> Iterator[str]:
    """Replicas by state, then each replica's gauges and counters from its last report."""
    yield from _head("raylm_replicas", "gauge", "Replicas known to the router, by state.")
    states = [r.state.value for r in reports.values()]
    for state in ReplicaState:
        yield f'raylm_replicas{{state="{state.value}"}} {states.count(state.value)}'
    for name, attr, doc in _REPLICA_GAUGES:
        yield from _head(name, "gauge", doc)
        for replica, report in sorted(reports.items()):
            value = getattr(report.scheduler, attr)
            yield f'{name}{{replica="{_label(replica)}"}} {float(value)!r}'
    for name, attr, scale, doc in _REPLICA_COUNTERS:
        yield from _head(name, "counter", doc)
        for replica, report in sorted(reports.items()):
            value = getattr(report.scheduler, attr) * scale
            yield f'{name}{{replica="{_label(replica)}"}} {float(value)!r}'


def _lora_lines(reports: dict[str, RoutingStats], loras: Collection[str] | None) -> Iterator[str]:
    """The adapters in each replica's device slots, those the caller may see only."""
    yield from _head("raylm_lora_adapters_loaded", "gauge", "LoRA adapters in device slots.")
    for replica, report in sorted(reports.items()):
        count = len(_visible(report.scheduler.loaded_loras, loras))
        yield f'raylm_lora_adapters_loaded{{replica="{_label(replica)}"}} {count}'
    yield from _head("raylm_lora_adapter_loaded", "gauge", "1 for each adapter in a device slot.")
    for replica, report in sorted(reports.items()):
        labels = f'replica="{_label(replica)}"'
        for lora in _visible(report.scheduler.loaded_loras, loras):
            yield f'raylm_lora_adapter_loaded{{{labels},lora="{_label(lora)}"}} 1'


def _image_lines(metrics: list[RequestMetrics]) -> Iterator[str]:
    yield from _head("raylm_images_total", "counter", "Images received in requests.")
    for m in metrics:
        yield f'raylm_images_total{{model="{_label(m.model)}"}} {m.images_received}'
    yield from _head(
        "raylm_images_refused_total", "counter", "Images refused at the ingress, by reason."
    )
    for m in metrics:
        model = f'model="{_label(m.model)}"'
        for reason, count in sorted(m.images_refused_by.items()):
            yield f'raylm_images_refused_total{{{model},reason="{_label(reason)}"}} {count}'


def _visible(loaded: Collection[str], allowed: Collection[str] | None) -> list[str]:
    """The loaded adapters a caller scoped to `allowed` may see (None: every one)."""
    return [a for a in loaded if allowed is None or a in allowed]


def _head(name: str, kind: str, doc: str) -> Iterator[str]:
    yield f"# HELP {name} {doc}"
    yield f"# TYPE {name} {kind}"


def _label(value: str) -> str:
    """A label value escaped as the text format asks."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
