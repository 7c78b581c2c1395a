"""ReplicaTelemetry: what one replica records about its requests and steps.

The Ray metrics (cluster/metrics.py, cluster/lora_metrics.py), its cold start by phase
(cluster/cold_start.py), the TTFT and ITL windows whose p90s the autoscaling policy reads,
each finished request's SLO attainment, and a sampled request's spans (cluster/tracing.py).
All of it runs on the replica's event loop, from the deltas the engine thread hands over.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from cluster.cold_start import ColdStart
from cluster.lora_metrics import LoraMetrics
from cluster.metrics import ReplicaMetrics
from cluster.replica_stream import ReplicaStream
from cluster.tracing import ReplicaSide, TraceContext, record_replica
from router.autoscaling import LatencyWindow, ReplicaSignals, SloTargets
from scheduler.outputs import RequestOutput, SchedulerStats
from scheduler.request import EngineRequest

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.core import EngineCore

logger = logging.getLogger(__name__)

# The window of the TTFT and ITL p90 a replica reports to the autoscaling policy.
LATENCY_WINDOW_S = 30.0


class ReplicaTelemetry:
    """One replica's metrics, latency windows, SLO counts, cold start and traces."""

    def __init__(self, replica: str, model: str, slo: SloTargets | None) -> None:
        """slo: the model's latency targets, whose attainment each finished request counts (and
        the autoscaling policy compares the measured p90s with); model: the metrics' tag."""
        self.replica = replica
        self.slo = slo
        self.metrics = ReplicaMetrics(replica, model)
        self.lora_metrics = LoraMetrics(replica, model)
        self.cold_start = ColdStart(model, replica)
        self._ttft_window = LatencyWindow(LATENCY_WINDOW_S)
        self._itl_window = LatencyWindow(LATENCY_WINDOW_S)

    def admitted(self, request: EngineRequest) -> None:
        self.cold_start.first_request()
        self.metrics.record_admitted(len(request.prompt_token_ids))
        if request.lora_name is not None:
            self.lora_metrics.record_request(request.lora_name)

    def settle(self, stream: ReplicaStream, output: RequestOutput, now: float) -> None:
        """The output's tokens in the metrics, with the time to the first and between the next."""
        if not output.new_token_ids:
            return
        last = stream.last_token
        ttft = now - stream.arrival if last is None else None
        itl = None if last is None else now - last
        if last is None:
            self.cold_start.first_token()
        self.metrics.record_tokens(len(output.new_token_ids), ttft=ttft, itl=itl)
        stream.last_token = now
        if ttft is not None:
            stream.ttft = ttft
            self._ttft_window.add(now, ttft)
        if itl is not None:
            self._itl_window.add(now, itl)
            stream.gaps += 1
            stream.slow_gaps += self.slo is not None and itl > self.slo.itl_p90_s

    def count_slo(self, stream: ReplicaStream) -> None:
        """A request that ended by itself met the SLO if its TTFT did and at most a tenth of its
        inter-token gaps exceeded the ITL target (its ITL p90 met it)."""
        if self.slo is None or stream.ttft is None:
            return
        met = stream.ttft <= self.slo.ttft_p90_s and stream.slow_gaps * 10 <= stream.gaps
        self.metrics.record_slo(met)

    def after_step(self, stats: SchedulerStats, engine: EngineCore) -> None:
        self.metrics.record_stats(stats)
        self.metrics.record_expert_load(engine.expert_load())
        slots = engine.scheduler.loras  # plain counters, read as expert_load() is
        self.lora_metrics.record_slots(stats.loaded_loras, slots.num_loads, slots.num_evictions)

    def signals(self, stats: SchedulerStats, config: EngineConfig) -> ReplicaSignals:
        """What the autoscaling policy reads (cluster/autoscaling_policy.py): KV usage, queues and
        backlog, batch size against max_num_seqs, and the TTFT and ITL p90 over the last
        LATENCY_WINDOW_S (-1: no samples)."""
        now = time.perf_counter()
        return ReplicaSignals(
            kv_cache_usage=min(1.0, stats.kv_cache_usage),
            num_waiting=stats.num_waiting,
            num_waiting_prompt_tokens=stats.num_waiting_prompt_tokens,
            num_running=stats.num_running,
            max_num_seqs=config.scheduler.max_num_seqs,
            ttft_p90_s=self._ttft_window.p90(now),
            itl_p90_s=self._itl_window.p90(now),
            kv_cache_tokens=stats.num_gpu_blocks * config.block_size,
        )

    def record_trace(
        self,
        trace: TraceContext,
        engine: EngineCore,
        request: EngineRequest,
        role: str,
        source: str,
        last: RequestOutput | None,
    ) -> None:
        """The request's spans on this replica, from the engine's record; a tracing failure is
        logged, never the request's. role: whole, prefill or decode; source: where its prompt's
        KV came from (remote, tiers)."""
        record = engine.tracer.pop(request.request_id)
        if record is None:
            return
        made = 0 if last is None else last.num_output_tokens - len(request.output_token_ids)
        side = ReplicaSide(
            self.replica,
            request.request_id,
            len(request.prompt_token_ids),
            max(made, 0),
            role,
            source,
        )
        try:
            record_replica(trace, side, record, time.time_ns())
        except Exception:
            logger.exception("request %s: its spans were not recorded", request.request_id)
