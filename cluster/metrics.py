"""Serving metrics through ray.util.metrics (exported as ray_raylm_*).

A replica records what it sees, tagged by replica: its queues, KV cache, tokens, time to first
token and between tokens. The ingress records how each request ended as its client saw it, and
how long it took, migrations included: only the ingress knows a stop string from a client that
went away, and only it sees one request across the replicas it moved through.
"""

from __future__ import annotations

import bisect

from ray.util.metrics import Counter, Gauge, Histogram

from scheduler.outputs import SchedulerStats

_TAGS = ("replica", "model")
FINISH_REASONS = ("stop", "length", "abort", "error")
_LATENCY_BUCKETS = [
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
]
_E2E_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0]


class ReplicaMetrics:
    """The queue gauges, token counters and latency histograms of one LLMReplica."""

    def __init__(self, replica: str, model: str = "") -> None:
        self._tags = {"replica": replica, "model": model}
        # Every series that exists from the start, so a panel shows 0, not "No data" (the
        # per-rank expert counter and the fixed KV layout gauge are recorded once known).
        self._zero_gauges: list[Gauge] = []
        self._zero_counters: list[Counter] = []
        self._queue_gauges()
        self._token_counters()
        self._spec_counters()
        self._vision_counters()
        self._latency()
        self._preemptions_seen = 0
        self._expert_tokens_seen: list[int] = []
        # The scheduler's cumulative figures, and the scale of each counter's unit: the counters
        # want increments.
        self._cumulative = (
            (self.spec_proposed, "num_spec_proposed_tokens", 1.0),
            (self.spec_accepted, "num_spec_accepted_tokens", 1.0),
            (self.spec_rows, "num_spec_verify_rows", 1.0),
            (self.images_encoded, "num_images_encoded", 1.0),
            (self.encoder_cache_hits, "num_encoder_cache_hits", 1.0),
            (self.encoder_seconds, "encoder_time_us", 1e-6),
        )
        self._seen: dict[str, int] = {}
        self._export_zeros()

    def _gauge(self, name: str, doc: str, zero: bool = True) -> Gauge:
        gauge = Gauge(name, doc, tag_keys=_TAGS)
        gauge.set_default_tags(self._tags)
        if zero:
            self._zero_gauges.append(gauge)
        return gauge

    def _counter(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        """A counter tagged by replica and model (and `extra`: then not zeroed, its series
        being per tag value)."""
        counter = Counter(name, doc, tag_keys=_TAGS + extra)
        counter.set_default_tags(self._tags)
        if not extra:
            self._zero_counters.append(counter)
        return counter

    def _histogram(self, name: str, doc: str) -> Histogram:
        histogram = Histogram(name, doc, boundaries=_LATENCY_BUCKETS, tag_keys=_TAGS)
        histogram.set_default_tags(self._tags)
        return histogram

    def _queue_gauges(self) -> None:
        self.waiting = self._gauge(
            "raylm_num_requests_waiting", "Requests waiting to be scheduled."
        )
        self.running = self._gauge("raylm_num_requests_running", "Requests in the running batch.")
        self.swapped = self._gauge(
            "raylm_num_requests_swapped", "Requests swapped out to the CPU pool."
        )
        self.kv_usage = self._gauge(
            "raylm_kv_cache_usage", "Fraction of GPU KV blocks in use (0-1)."
        )
        self.hit_rate = self._gauge(
            "raylm_prefix_cache_hit_rate", "Prefix-cache hit rate of prompt tokens (0-1)."
        )
        self.kv_bytes_per_token = self._gauge(
            "raylm_kv_cache_bytes_per_token",
            "KV cache bytes one token takes on each tensor-parallel rank, all layers (MLA: its "
            "latent row; other attention: K and V of the rank's heads).",
            zero=False,
        )

    def _token_counters(self) -> None:
        self.prompt_tokens = self._counter("raylm_prompt_tokens_total", "Prompt tokens admitted.")
        self.generation_tokens = self._counter("raylm_generation_tokens_total", "Tokens generated.")
        self.preemptions = self._counter("raylm_preemptions_total", "Requests preempted.")
        self.expert_tokens = self._counter(
            "raylm_expert_tokens_total",
            "Mixture-of-experts models: (token, expert) rows computed per tensor-parallel rank, "
            "summed over layers (expert-parallel load balance).",
            ("rank",),
        )

    def _spec_counters(self) -> None:
        """Speculative decoding: mean accepted length is accepted / verify rows."""
        self.spec_proposed = self._counter(
            "raylm_spec_proposed_tokens_total", "Speculative tokens proposed and verified."
        )
        self.spec_accepted = self._counter(
            "raylm_spec_accepted_tokens_total", "Speculative tokens accepted by verification."
        )
        self.spec_rows = self._counter(
            "raylm_spec_verify_rows_total", "Verify rows (a decode that verified proposals)."
        )

    def _vision_counters(self) -> None:
        """Vision models (scheduler/features_images.py)."""
        self.images_encoded = self._counter(
            "raylm_images_encoded_total", "Images the tower encoded."
        )
        self.encoder_cache_hits = self._counter(
            "raylm_encoder_cache_hits_total", "Images read from the encoder cache, not encoded."
        )
        self.encoder_seconds = self._counter(
            "raylm_encoder_seconds_total", "The vision tower's time."
        )

    def _latency(self) -> None:
        self.ttft = self._histogram("raylm_ttft_seconds", "Time to first token at the replica.")
        self.itl = self._histogram("raylm_inter_token_seconds", "Time between output deltas.")
        # Requests that ended by themselves, by whether they met the model's SLO (TTFT and ITL
        # p90): the dashboards' SLO attainment. Tagged by model, for the per-model panels.
        self.slo_requests = Counter(
            "raylm_slo_requests_total",
            "Finished requests by whether they met the model's latency SLO.",
            tag_keys=("replica", "model", "slo"),
        )
        self.slo_requests.set_default_tags(self._tags)
        for outcome in ("met", "missed"):
            self.slo_requests._record(0.0, tags={"slo": outcome})

    def _export_zeros(self) -> None:
        """Ray's Counter.inc refuses 0, and a series appears only once recorded: record 0
        directly."""
        for gauge in self._zero_gauges:
            gauge.set(0.0)
        for counter in self._zero_counters:
            counter._record(0.0)

    def record_kv_layout(self, bytes_per_token: int) -> None:
        """The engine's KV layout, fixed at start (EngineCore.kv_bytes_per_token)."""
        self.kv_bytes_per_token.set(bytes_per_token)

    def record_stats(self, stats: SchedulerStats) -> None:
        self.waiting.set(stats.num_waiting)
        self.running.set(stats.num_running)
        self.swapped.set(stats.num_swapped)
        self.kv_usage.set(stats.kv_cache_usage)
        self.hit_rate.set(stats.prefix_cache_hit_rate)
        # The scheduler counts preemptions cumulatively; the counter wants increments.
        if stats.num_preemptions > self._preemptions_seen:
            self.preemptions.inc(stats.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = stats.num_preemptions
        for metric, name, scale in self._cumulative:
            now, seen = getattr(stats, name), self._seen.get(name, 0)
            if now > seen:
                metric.inc((now - seen) * scale)
            self._seen[name] = now

    def record_expert_load(self, totals: list[int]) -> None:
        """The engine's cumulative (token, expert) rows per rank (EngineCore.expert_load)."""
        seen = self._expert_tokens_seen
        seen.extend([0] * (len(totals) - len(seen)))
        for rank, total in enumerate(totals):
            if total > seen[rank]:
                self.expert_tokens.inc(total - seen[rank], tags={"rank": str(rank)})
            seen[rank] = total

    def record_slo(self, met: bool) -> None:
        self.slo_requests.inc(1, tags={"slo": "met" if met else "missed"})

    def record_admitted(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def record_tokens(self, num_tokens: int, ttft: float | None, itl: float | None) -> None:
        if num_tokens:
            self.generation_tokens.inc(num_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
        if itl is not None:
            self.itl.observe(itl)


class RequestMetrics:
    """What the ingress records of each choice of a request, as its client saw it: a choice that
    moved between replicas counts once, with its whole latency."""

    def __init__(self, model: str = "") -> None:
        self.model = model  # the served name: one app may serve several
        self.requests = Counter(
            "raylm_requests_total",
            "Finished requests by finish reason, one per choice, as the client saw them.",
            tag_keys=("finish_reason", "model"),
        )
        self.e2e = Histogram(
            "raylm_e2e_seconds",
            "Latency of each choice at the ingress, from admission to its end (migrations "
            "included).",
            boundaries=_E2E_BUCKETS,
            tag_keys=("model",),
        )
        self.images = Counter(
            "raylm_images_total", "Images received in requests (image parts).", tag_keys=("model",)
        )
        self.images_refused = Counter(
            "raylm_images_refused_total",
            "Images refused before reaching a replica, by reason (deploy/image_parts.py).",
            tag_keys=("model", "reason"),
        )
        for metric in (self.requests, self.e2e, self.images, self.images_refused):
            metric.set_default_tags({"model": model})
        # Every reason's series exists from the start (see ReplicaMetrics._export_zeros).
        for reason in FINISH_REASONS:
            self.requests._record(0.0, tags={"finish_reason": reason})
        # The same figures kept here too, for the ingress's own /metrics page (Ray's exporter
        # cannot be read back).
        self.finished: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self.e2e_buckets = list(_E2E_BUCKETS)
        self.e2e_counts = [0] * len(_E2E_BUCKETS)  # per bucket, not cumulative
        self.e2e_sum = 0.0
        self.e2e_count = 0
        self.images_received = 0
        self.images_refused_by: dict[str, int] = {}

    def record_finished(self, finish_reason: str, e2e: float) -> None:
        self.requests.inc(1, tags={"finish_reason": finish_reason})
        self.e2e.observe(e2e)
        self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1
        self.e2e_sum += e2e
        self.e2e_count += 1
        bucket = bisect.bisect_left(self.e2e_buckets, e2e)
        if bucket < len(self.e2e_counts):
            self.e2e_counts[bucket] += 1

    def record_images(self, count: int) -> None:
        self.images.inc(count)
        self.images_received += count

    def record_image_refused(self, reason: str) -> None:
        """An image refused: `reason` is one of frontend/images.py's (pixels, bytes, ...) or
        `model` (the model takes no images)."""
        self.images_refused.inc(1, tags={"reason": reason})
        self.images_refused_by[reason] = self.images_refused_by.get(reason, 0) + 1
