"""LoRA adapter metrics of one replica (exported as ray_raylm_lora_*): the adapters in its device
slots, the loads and evictions of those slots, and the requests each adapter served; tagged by
replica and by model (the base model's served name: an app may serve several)."""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge

_TAGS = ("replica", "model")


class LoraMetrics:
    """The slot gauge and the load, eviction and per-adapter request counters of one LLMReplica."""

    def __init__(self, replica: str, model: str = "") -> None:
        self.loaded = Gauge(
            "raylm_lora_adapters_loaded", "LoRA adapters in device slots.", tag_keys=_TAGS
        )
        self.loads = Counter(
            "raylm_lora_loads_total", "LoRA adapters loaded into a device slot.", tag_keys=_TAGS
        )
        self.evictions = Counter(
            "raylm_lora_evictions_total",
            "LoRA adapters evicted from a device slot for another one.",
            tag_keys=_TAGS,
        )
        # Adapter names are checked (1-64 of [A-Za-z0-9._-]) and bounded by the registered
        # adapters (max_cpu_loras), so the label's cardinality is too.
        self.requests = Counter(
            "raylm_lora_requests_total", "Requests per LoRA adapter.", tag_keys=(*_TAGS, "lora")
        )
        for metric in (self.loaded, self.loads, self.evictions, self.requests):
            metric.set_default_tags({"replica": replica, "model": model})
        self.loaded.set(0)
        self._seen = (0, 0)

    def record_slots(self, loaded: tuple[str, ...], num_loads: int, num_evictions: int) -> None:
        """The slots' adapters and their cumulative loads and evictions (the scheduler's)."""
        self.loaded.set(len(loaded))
        for metric, now, seen in zip(
            (self.loads, self.evictions), (num_loads, num_evictions), self._seen
        ):
            if now > seen:
                metric.inc(now - seen)
        self._seen = (num_loads, num_evictions)

    def record_request(self, lora_name: str) -> None:
        self.requests.inc(tags={"lora": lora_name})
