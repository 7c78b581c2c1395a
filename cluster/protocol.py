"""What the ingress sends a replica: one plain, cheap-to-pickle generation request."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler.block_manager import PrefixReport
from scheduler.outputs import SchedulerStats
from scheduler.sampling_params import SamplingParams


class EngineFailedError(RuntimeError):
    """A replica's engine failed (a forward pass or a worker died): its requests belong elsewhere."""


class ReplicaDrainingError(RuntimeError):
    """The replica is shutting down and takes no new request: route it elsewhere."""


@dataclass(slots=True)
class GenerateRequest:
    """A tokenized prompt bound for one LLMReplica.

    block_hashes are the chained hash_block_tokens of the prompt's full blocks (block size of the
    deployment), computed in the ingress so the fleet router can estimate prefix-cache affinity
    without tokenizing. The router reads it as ``pending_request.args[0]``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    tenant: str = "default"
    block_hashes: list[int] = field(default_factory=list)
    # Tokens this choice already emitted on a replica that failed: the new replica resumes after them.
    output_token_ids: list[int] = field(default_factory=list)
    # The Ray actor name of the caller (an ingress replica): when that actor dies, the replica
    # aborts the request instead of generating for nobody. None: not watched (e.g. a driver).
    caller: str | None = None

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id: must be a non-empty string")
        if not self.prompt_token_ids:
            raise ValueError(f"prompt_token_ids: request {self.request_id!r} has an empty prompt")


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
    state: str = "ok"  # "ok" | "failed" | "stalled" | "draining": the router picks only "ok" replicas
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
        return cls(num_waiting=stats.num_waiting, num_running=stats.num_running, num_swapped=stats.num_swapped,
                   kv_cache_usage=stats.kv_cache_usage, prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
                   num_preemptions=stats.num_preemptions, num_free_blocks=stats.num_free_blocks)

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


_PREFIX_FIELDS = ("prefix_hashes", "prefix_report_id", "prefix_base_id", "prefix_listed", "prefix_unlisted")
