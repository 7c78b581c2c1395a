"""The KV CPU tier in the simulator: the production connector behind each replica's device prefix
cache, its copies timed over a link.

Set `SchedulerConfig.num_cpu_tier_blocks` and every simulated replica's production scheduler builds
its own `KVConnector` (scheduler/kv_connector.py), as an engine's does: cached blocks the device
pool evicts are saved to the tier (LRU, that many blocks), and a prompt whose next blocks the tier
holds waits in `LOADING_KV` while they load, instead of prefilling them. The simulator adds the
time: `TierSimReplica` (sim/kv_copy.py) charges each step's saves and loads at
`SimConfig.tier_link`'s bandwidth, and reports the tier's hashes to the router as a replica does.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.stats import MAX_REPORTED_PREFIX_HASHES, RoutingStats
from scheduler import RequestOutput, SchedulerConfig
from sim.cost import CostModel
from sim.kv_copy import KVCopyReplica, LinkConfig
from sim.metrics import SimResult
from sim.replica import StepPlan


class TierSimReplica(KVCopyReplica):
    """A replica with a CPU tier: its copies take time, and its routing report names the tier's
    blocks (router/stats.py `tier_hashes`), as cluster/replica.py reports them."""

    def __init__(
        self, name: str, config: SchedulerConfig, cost: CostModel, max_tokens: int, link: LinkConfig
    ):
        super().__init__(name, config, cost, max_tokens, link)
        # Prompt tokens loaded from the tier at requests' first admission (a request preempted
        # and loaded again counts once, as its prefix-cache lookup does).
        self.tier_hit_tokens = 0

    def finish_step(self) -> list[RequestOutput]:
        plan, connector = self.in_flight, self.scheduler.connector
        transfers = plan.output.kv_transfers if isinstance(plan, StepPlan) else None
        if transfers is not None and connector is not None:
            requests, bs = self.scheduler.requests, self.scheduler.config.block_size
            for rid in transfers.loading_req_ids:
                req, load = requests.get(rid), connector.plans.get(rid)
                if req is not None and load is not None and req.num_cached_tokens is None:
                    self.tier_hit_tokens += len(load.blocks) * bs
        return super().finish_step()

    def routing_stats(self, max_hashes: int = MAX_REPORTED_PREFIX_HASHES) -> RoutingStats:
        stats = super().routing_stats(max_hashes)
        connector = self.scheduler.connector
        if connector is None:
            return stats
        tier = connector.hashes(max_hashes)
        return RoutingStats(stats.scheduler, stats.state, stats.prefix, tier)


@dataclass(frozen=True, slots=True)
class TierFigures:
    """Prompt tokens found in the device cache and loaded from the tier, over those queried."""

    queried_tokens: int
    device_hit_tokens: int
    tier_hit_tokens: int
    saved_blocks: int
    loaded_blocks: int  # every load, a preempted request's again included
    copy_s: float  # time replicas spent copying KV, overlapped with their steps or not

    @property
    def device_hit_rate(self) -> float:
        return self.device_hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    @property
    def tier_hit_rate(self) -> float:
        return self.tier_hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def tier_figures(result: SimResult) -> TierFigures:
    """The run's hit rates by tier. A request's prefix-cache lookup counts once, at its first
    admission: its device hit plus the blocks it loaded (scheduler.Scheduler._land_loads)."""
    queried = hit = tier = loaded = saved = 0
    copy_s = 0.0
    for rep in result.replicas:
        kv = rep.scheduler.kv
        queried += kv.num_queried_tokens
        hit += kv.num_hit_tokens
        connector = rep.scheduler.connector
        if connector is not None:
            loaded += connector.stats.num_loaded_blocks
            saved += connector.stats.num_saved_blocks
        if isinstance(rep, TierSimReplica):
            tier += rep.tier_hit_tokens
            copy_s += rep.copy_s
    return TierFigures(queried, hit - tier, tier, saved, loaded, copy_s)
