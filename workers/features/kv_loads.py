"""KV moving into and out of the device pool as a runner feature: the prefix cache's lower tiers
(workers/kv_tiers.py) and KV arriving from another engine (workers/kv_transfer.py, set by
engine/disagg.py). Always in the list: a step whose SchedulerOutput carries copies this runner
cannot make is an error, not a silent recompute.

Under tensor parallelism each rank copies its own KV heads; a block that failed on any rank is
recomputed on all of them (one all_reduce of the step's flags), so the ranks never hold
different KV.
"""

from __future__ import annotations

import torch

from scheduler.kv_connector import KVTransfers
from scheduler.outputs import SchedulerOutput
from workers.features.base import RunnerContext, RunnerFeature
from workers.kv_cache import KVCache
from workers.kv_tiers import KVTiers
from workers.kv_transfer import KVReceiver
from workers.parallel import all_reduce, get_tp_rank, get_tp_world_size


class KVLoadsFeature(RunnerFeature):
    def __init__(self, ctx: RunnerContext) -> None:
        self.ctx = ctx
        self.cache: KVCache | None = None
        self.tiers: KVTiers | None = None
        self.receiver: KVReceiver | None = None  # a decode engine's (kv_ranks.start_receiver)

    def init_kv_cache(self, cache: KVCache, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.cache = cache
        if self.ctx.config.kv_tiers is not None:
            self.tiers = KVTiers(cache, self.ctx.config.kv_tiers, get_tp_rank())

    def before_copies(self, out: SchedulerOutput) -> None:
        if self.tiers is not None:
            self.tiers.wait_for_loads()
            if out.kv_transfers is not None:
                self.tiers.save(out.kv_transfers)  # reads blocks the swaps and forward overwrite

    def after_copies(self, out: SchedulerOutput) -> list[int]:
        """The step's loads: from the lower tiers, then from other engines' transfers."""
        transfers = out.kv_transfers
        if transfers is None:
            return []
        failed = []
        if self.tiers is not None or transfers.has_tier_copies:
            failed = self._load_tiers(transfers)
        if transfers.load_remote:
            failed += self._load_remote(transfers)
        return failed

    def _load_tiers(self, transfers: KVTransfers) -> list[int]:
        if self.tiers is None:
            raise RuntimeError("kv_transfers: this runner has no KV tiers (kv_tiers is unset)")
        failed = self.tiers.load(transfers)
        blocks = [b for _, b, _ in transfers.load_cpu] + [b for _, b in transfers.load_disk]
        return self._agreed(blocks, failed)

    def _load_remote(self, transfers: KVTransfers) -> list[int]:
        if self.receiver is None:
            raise RuntimeError("kv_transfers: this runner receives no KV transfers")
        assert self.cache is not None
        failed = self.receiver.load(self.cache, transfers.load_remote)
        return self._agreed([b for _, _, b in transfers.load_remote], failed)

    def _agreed(self, blocks: list[int], failed: list[int]) -> list[int]:
        """The blocks that failed on any rank (every rank recomputes the same blocks)."""
        if get_tp_world_size() == 1 or not blocks:
            return failed
        mine = torch.tensor([b in failed for b in blocks], dtype=torch.int32)
        anywhere = all_reduce(mine.to(self.ctx.device)).cpu().tolist()
        return [b for b, flag in zip(blocks, anywhere) if flag]
