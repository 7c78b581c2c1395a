"""The KV connector, scheduler side: which prefix blocks the lower tiers hold, and the copies a step
carries to save evicted blocks there and to load them back into device slots.

The scheduler is the one authority on what every tier holds: it assigns CPU-tier slots and disk
entries here, and the workers (workers/kv_tiers.py) only carry out the copies a `SchedulerOutput`
lists, so every tensor-parallel rank makes the same copies in the same step.

- Save: a cached prefix block that the device pool evicts (BlockPool.on_evict) is copied to the CPU
  tier, a bounded LRU of slots. The CPU tier's least recently used block is demoted to the disk
  tier (bounded, LRU, one file per block) when that is on, else dropped.
- Look up: a prompt's block hashes past its device hit, found in a lower tier.
- Load: the request reserves device blocks for its whole prompt and waits in the `LOADING_KV`
  state (neither waiting nor running) while the step's workers copy the blocks in; when the step
  is back, `land` says how many leading blocks arrived intact (a failed check means recompute
  from there) and the request is admitted with them as computed tokens.

Everything is keyed by the block hash, so a transport that brings KV from another replica
(prefill/decode disaggregation) fits the same calls: look up, reserve, load, land.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler.kv_events import CPU, DISK, REMOVED, STORED, KVEventLog


@dataclass(slots=True)
class KVTransfers:
    """One step's copies between the device pool and the lower tiers (plain ints: crosses to the
    workers inside SchedulerOutput). Workers run them in this order, around the swap copies:
    demote, save and save_disk, (swap out, swap in), load_cpu, load_disk, drop_disk. A slot that
    this step saves into or loads from is not reused in the same step, so no copy reads what
    another copy of the step has overwritten."""

    demote: list[tuple[int, int]] = field(default_factory=list)  # (cpu slot, hash) -> disk
    save: list[tuple[int, int, int]] = field(default_factory=list)  # (device block, cpu slot, hash)
    # (device block, hash) straight to disk: the CPU tier is full of blocks this step moves
    save_disk: list[tuple[int, int]] = field(default_factory=list)
    load_cpu: list[tuple[int, int, int]] = field(default_factory=list)  # (cpu slot, block, hash)
    load_disk: list[tuple[int, int]] = field(default_factory=list)  # (hash, device block)
    drop_disk: list[int] = field(default_factory=list)  # hashes whose files are deleted
    # (transfer key, hash, device block): KV arriving from another engine (prefill/decode
    # disaggregation, scheduler/kv_remote.py), run after the tier loads.
    load_remote: list[tuple[str, int, int]] = field(default_factory=list)
    # The requests whose loads are in this step (the scheduler's own bookkeeping on update).
    loading_req_ids: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.has_tier_copies or bool(self.load_remote)

    @property
    def has_tier_copies(self) -> bool:
        """Whether the step copies to or from the lower tiers (the runner's KVTiers)."""
        return bool(
            self.demote
            or self.save
            or self.save_disk
            or self.load_cpu
            or self.load_disk
            or self.drop_disk
        )


class TierIndex:
    """hash -> slot of one tier: bounded, least recently used first, with slots pinned for the
    step being scheduled (a slot read this step is not reused this step)."""

    def __init__(self, capacity: int, tier: int = CPU) -> None:
        self.capacity = capacity
        self.tier = tier  # its bit in KV events (scheduler/kv_events.py)
        self.events: KVEventLog | None = None  # None: nobody listens
        self.slots: OrderedDict[int, int] = OrderedDict()  # head: least recently used
        self.free = list(range(capacity - 1, -1, -1))
        self.pinned: set[int] = set()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def touch(self, block_hash: int) -> int:
        self.slots.move_to_end(block_hash)
        return self.slots[block_hash]

    def insert(self, block_hash: int) -> tuple[int, int | None] | None:
        """A slot for block_hash, and the hash it displaced (None when a slot was free); None when
        the tier is full of pinned blocks (or has no room at all)."""
        victim = None
        if not self.free:
            victim = next((h for h in self.slots if h not in self.pinned), None)
            if victim is None:
                return None
            self.free.append(self.slots.pop(victim))
        slot = self.free.pop()
        self.slots[block_hash] = slot
        if self.events is not None:
            if victim is not None:
                self.events.record(REMOVED, self.tier, victim)
            self.events.record(STORED, self.tier, block_hash)
        return slot, victim

    def remove(self, block_hash: int) -> None:
        self.free.append(self.slots.pop(block_hash))
        if self.events is not None:
            self.events.record(REMOVED, self.tier, block_hash)


@dataclass(slots=True)
class LoadPlan:
    """A request's blocks on their way in: hashes[i] goes into device block blocks[i], which is
    block first + i of its table."""

    first: int
    hashes: list[int]
    blocks: list[int]


@dataclass(slots=True)
class TierStats:
    """Cumulative figures of the lower tiers."""

    num_saved_blocks: int = 0  # device -> CPU tier
    num_demoted_blocks: int = 0  # CPU tier -> disk tier
    num_loaded_blocks: int = 0  # landed intact
    num_failed_loads: int = 0  # failed a check: recomputed


class KVConnector:
    """The lower tiers' index and the transfers of the step being scheduled."""

    def __init__(self, num_cpu_blocks: int, num_disk_blocks: int = 0) -> None:
        if num_cpu_blocks < 1:
            raise ValueError(f"num_cpu_tier_blocks: must be >= 1, got {num_cpu_blocks}")
        self.cpu = TierIndex(num_cpu_blocks)
        self.disk = TierIndex(num_disk_blocks, DISK) if num_disk_blocks > 0 else None
        self.plans: dict[str, LoadPlan] = {}
        self.stats = TierStats()
        self._step = KVTransfers()

    # ---- save (the device pool's eviction hook) ------------------------------------------------
    def on_evict(self, block_id: int, block_hash: int) -> None:
        """A cached block is being reused: copy it to the CPU tier first (unless it is there)."""
        cpu, disk = self.cpu, self.disk
        if block_hash in cpu:
            cpu.touch(block_hash)
            return
        placed = cpu.insert(block_hash)
        if placed is None:  # every CPU slot is busy this step: down to disk, or dropped
            if disk is not None and block_hash not in disk and self._to_disk(block_hash, disk):
                self._step.save_disk.append((block_id, block_hash))
                self.stats.num_saved_blocks += 1
            return
        slot, victim = placed
        if victim is not None and disk is not None and self._to_disk(victim, disk):
            self._step.demote.append((slot, victim))
            self.stats.num_demoted_blocks += 1
        if disk is not None and block_hash in disk:  # hot again: it lives in the CPU tier now
            if block_hash in disk.pinned:  # looked up this step: keep it for the load
                cpu.pinned.add(block_hash)
            disk.remove(block_hash)
            self._step.drop_disk.append(block_hash)
        self._step.save.append((block_id, slot, block_hash))
        cpu.pinned.add(block_hash)  # filled after this step's demotions: not one of them
        self.stats.num_saved_blocks += 1

    def _to_disk(self, block_hash: int, disk: TierIndex) -> bool:
        """Make room for block_hash in the disk tier; False when there is none this step."""
        placed = disk.insert(block_hash)
        if placed is None:
            return False
        _, gone = placed
        drops = self._step.drop_disk
        if gone is not None:
            drops.append(gone)
        if block_hash in drops:  # dropped earlier this step, written again now: keep the file
            drops.remove(block_hash)
        disk.pinned.add(block_hash)  # written this step: not dropped again in it
        return True

    # ---- look up, load, land -------------------------------------------------------------------
    def lookup(self, hashes: Sequence[int]) -> int:
        """How many of these leading hashes a lower tier holds, in a row. They stay pinned for the
        rest of the step, so the evictions that reserving their device blocks causes cannot push
        them out before `load`."""
        n = 0
        cpu, disk = self.cpu, self.disk
        for h in hashes:
            if h in cpu:
                cpu.pinned.add(h)
            elif disk is not None and h in disk:
                disk.pinned.add(h)
            else:
                break
            n += 1
        return n

    def load(self, req_id: str, first: int, hashes: Sequence[int], blocks: Sequence[int]) -> None:
        """Copy these blocks (found by lookup) into the reserved device blocks this step."""
        step = self._step
        for h, block in zip(hashes, blocks, strict=True):
            if h in self.cpu:
                step.load_cpu.append((self.cpu.touch(h), block, h))
            elif self.disk is not None and h in self.disk:
                self.disk.touch(h)
                step.load_disk.append((h, block))
            else:
                raise ValueError(f"block_hashes: {h:032x} is in no lower tier (look it up first)")
        step.loading_req_ids.append(req_id)
        self.plans[req_id] = LoadPlan(first, list(hashes), list(blocks))

    def land(self, req_id: str, failed_blocks: set[int]) -> LoadPlan | None:
        """The request's loads ran: the plan cut to its leading blocks that arrived intact (None
        for a request not loading). Blocks that failed their check leave the tiers."""
        plan = self.plans.pop(req_id, None)
        if plan is None:
            return None
        ok = len(plan.blocks)
        for i, block in enumerate(plan.blocks):
            if block in failed_blocks:
                ok = min(ok, i)
                self._forget(plan.hashes[i])
        self.stats.num_loaded_blocks += ok
        self.stats.num_failed_loads += len(plan.blocks) - ok
        return LoadPlan(plan.first, plan.hashes[:ok], plan.blocks[:ok])

    def cancel(self, req_id: str) -> None:
        """A loading request was aborted: its copies still run, into blocks it gave back."""
        self.plans.pop(req_id, None)

    def release(self, req_id: str) -> None:
        """The request finished: nothing is kept for it here (a subclass that brings KV from
        elsewhere drops what it expected for it: scheduler/kv_remote.py)."""

    def reset(self) -> int:
        """Forget every block the tiers hold (their KV belongs to weights that have changed; the
        disk tier's files are dropped with the next step); returns how many."""
        hashes = list(self.cpu.slots) + (list(self.disk.slots) if self.disk is not None else [])
        for block_hash in hashes:
            self._forget(block_hash)
        return len(hashes)

    def _forget(self, block_hash: int) -> None:
        if block_hash in self.cpu:
            self.cpu.remove(block_hash)
        elif self.disk is not None and block_hash in self.disk:
            self.disk.remove(block_hash)
            self._step.drop_disk.append(block_hash)

    # ---- the step ------------------------------------------------------------------------------
    def take_transfers(self) -> KVTransfers | None:
        """The copies of the step just scheduled (None: none); the tiers' pins end with it."""
        step, self._step = self._step, KVTransfers()
        self.cpu.pinned.clear()
        if self.disk is not None:
            self.disk.pinned.clear()
        return step if step or step.loading_req_ids else None

    def hashes(self, limit: int) -> list[int]:
        """Up to `limit` hashes the lower tiers hold, most recently used last (the router's
        report)."""
        out = list(self.cpu.slots)
        if self.disk is not None:
            out = list(self.disk.slots) + out
        return out[-limit:] if limit > 0 else []
