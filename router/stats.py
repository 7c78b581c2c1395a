"""What a replica reports to the fleet router: queues, KV usage, state and its prefix report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scheduler.block_manager import PrefixReport
from scheduler.outputs import SchedulerStats

# How often Serve asks each replica for its report (request_routing_stats_period_s); the simulator
# reports at the same period.
ROUTING_STATS_PERIOD_S = 1.0
# Prefix hashes per report: enough to describe the hot prefixes, each report one pickled list of
# 128-bit ints.
MAX_REPORTED_PREFIX_HASHES = 4096


@dataclass(slots=True)
class RoutingStats:
    """A replica's figures for the router; a dict only at Serve's edge (record_routing_stats)."""

    num_waiting: int = 0
    num_running: int = 0
    num_swapped: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    num_free_blocks: int = 0
    state: str = (
        "ok"  # "ok" | "failed" | "stalled" | "draining": the router picks only "ok" replicas
    )
    prefix_hashes: list[int] | None = None  # most recently cached blocks, oldest first
    # The pool's report number, and the change of prefix_hashes since report prefix_base_id (a
    # router that applied that one applies these instead of comparing whole lists).
    prefix_report_id: int | None = None
    prefix_base_id: int | None = None
    prefix_listed: list[int] | None = None
    prefix_unlisted: list[int] | None = None

    @classmethod
    def of(cls, stats: SchedulerStats | None) -> RoutingStats:
        if stats is None:
            return cls()
        return cls(
            num_waiting=stats.num_waiting,
            num_running=stats.num_running,
            num_swapped=stats.num_swapped,
            kv_cache_usage=stats.kv_cache_usage,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            num_preemptions=stats.num_preemptions,
            num_free_blocks=stats.num_free_blocks,
        )

    def set_prefix(self, report: PrefixReport) -> None:
        """Carry the pool's prefix report (its change only when it gives one)."""
        self.prefix_hashes = report.hashes
        self.prefix_report_id = report.report_id
        if report.base_id is not None:
            self.prefix_base_id = report.base_id
            self.prefix_listed = report.listed
            self.prefix_unlisted = report.unlisted

    def as_dict(self) -> dict[str, Any]:
        """The figures, and the prefix fields that are set."""
        out = {name: getattr(self, name) for name in self.__slots__ if name not in _PREFIX_FIELDS}
        for name in _PREFIX_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


_PREFIX_FIELDS = (
    "prefix_hashes",
    "prefix_report_id",
    "prefix_base_id",
    "prefix_listed",
    "prefix_unlisted",
)
