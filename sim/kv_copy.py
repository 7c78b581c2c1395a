"""KV copies in the simulator: what a step's block copies to and from its replica's device pool
cost, for the CPU tier (sim/tiers.py) and for KV landing from a prefill replica (sim/disagg.py).

A copy moves `block_size * kv_bytes_per_token` bytes a block at a link's bandwidth, after the
link's latency. The production scheduler decides the copies (its `KVConnector` lists them in
`SchedulerOutput.kv_transfers`); the simulator only times them.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler import SchedulerConfig, SchedulerOutput
from settings import check_settings, setting
from sim.cost import CostModel
from sim.replica import Cruise, SimReplica

# A link slower than this (bytes/s) or a latency longer than this is a typo, not a setting.
MIN_BANDWIDTH = 1.0
MAX_LATENCY_S = 60.0
# 10 TB/s: past any link, and past the HBM the blocks are copied from.
MAX_BANDWIDTH = 1e13
# A GiB of KV a token: past the largest model's (a few MB) by far.
MAX_KV_BYTES_PER_TOKEN = float(1 << 30)


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """One link KV blocks cross: bandwidth, a fixed latency per transfer, and the KV bytes per
    token (0: the profile's `kv_bytes_per_token`)."""

    bandwidth_bytes_per_s: float = setting(
        25e9,
        "the link's bandwidth (~200 Gb/s, one RDMA NIC; PCIe 4 x16 host copies: ~25 GB/s)",
        ge=MIN_BANDWIDTH,
        le=MAX_BANDWIDTH,
    )
    latency_s: float = setting(0.0, "fixed latency of each transfer", ge=0, le=MAX_LATENCY_S)
    kv_bytes_per_token: float = setting(
        0.0,
        "KV bytes per token (0: the profile's kv_bytes_per_token)",
        ge=0,
        le=MAX_KV_BYTES_PER_TOKEN,
    )

    def __post_init__(self) -> None:
        check_settings(self)

    def token_bytes(self, cost: CostModel) -> float:
        return self.kv_bytes_per_token or cost.kv_bytes_per_token

    def seconds(self, num_tokens: int, cost: CostModel) -> float:
        """Time to move num_tokens tokens' KV over the link (0 for none)."""
        if num_tokens <= 0:
            return 0.0
        return self.latency_s + num_tokens * self.token_bytes(cost) / self.bandwidth_bytes_per_s


def num_copied_blocks(out: SchedulerOutput) -> tuple[int, int]:
    """(blocks saved to a lower tier, blocks loaded from one) in a scheduled step."""
    t = out.kv_transfers
    if t is None:
        return 0, 0
    return len(t.save) + len(t.save_disk) + len(t.demote), len(t.load_cpu) + len(t.load_disk)


class KVCopyReplica(SimReplica):
    """A replica whose steps also pay for their KV copies over `link`.

    The saves run before the forward (the forward may overwrite the blocks they read); the loads
    run beside it (the loading request is not in the batch), so a step takes
    max(forward + saves, saves + loads): as the engine overlaps them on CUDA (docs/kv-tiers.md).
    A step that only loads (nothing else to run) takes the loads' time. With a lower tier fed by
    evictions, the replica takes no k-step jumps: a jump's block allocations may evict cached
    blocks, whose saves it would not time.
    """

    def __init__(
        self, name: str, config: SchedulerConfig, cost: CostModel, max_tokens: int, link: LinkConfig
    ):
        super().__init__(name, config, cost, max_tokens)
        self.link = link
        self.saved_blocks = 0
        self.loaded_blocks = 0
        self.copy_s = 0.0  # time spent copying, overlapped or not

    def plan_cruise(self, now: float, horizon_s: float, min_steps: int = 2) -> Cruise | None:
        if self.scheduler.kv.pool.on_evict is not None:
            return None
        return super().plan_cruise(now, horizon_s, min_steps)

    def step_seconds(self, out: SchedulerOutput) -> float:
        forward = super().step_seconds(out)
        saves, loads = num_copied_blocks(out)
        if not saves and not loads:
            return forward
        bs = self.scheduler.config.block_size
        save_s = self.link.seconds(saves * bs, self.cost)
        load_s = self.link.seconds(loads * bs, self.cost)
        self.saved_blocks += saves
        self.loaded_blocks += loads
        self.copy_s += save_s + load_s
        return max(forward + save_s, save_s + load_s)
