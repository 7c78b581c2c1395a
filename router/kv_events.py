"""The router's exact KV index: which block hashes each replica holds, in which tier, kept from the
replicas' KV events (scheduler/kv_events.py), as their routing-stats reports bring them and, sooner,
as each request's last output does (`apply_tail`); a batch both bring is applied once.

Per replica, the hashes it holds and a bit per tier (DEVICE, CPU, DISK); per hash, its holders, so
a prompt's blocks are matched against the whole fleet in one walk along the prompt. A replica's
batches are applied once each, in sequence order. A batch that does not follow the last one
applied (one lost, or cut short by the replica's per-batch cap) puts the replica out of sync: its
entries stay as they were, and `in_sync` is False, until a report brings a snapshot, which replaces
them. Nothing here guesses: a replica out of sync is scored by the approximate index instead
(router/fleet.py).

Memory: an entry per (replica, hash) held, bounded by the blocks each tier of each replica can
hold (its reported pool sizes), and by `max_entries_per_replica` whatever a replica sends
(bench/router_index_memory.py measures it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from scheduler.kv_events import (
    CPU,
    DEVICE,
    DISK,
    STORED,
    KVEventBatch,
    KVEventReport,
    KVEventTail,
    KVSnapshot,
)

# Entries one replica may hold in the index (all tiers together), whatever it reports: a device
# pool of 1M blocks with its tiers. Events past it are ignored and the replica is out of sync.
MAX_ENTRIES_PER_REPLICA = 1 << 22


@dataclass(frozen=True, slots=True)
class TierRun:
    """How much of a prompt's leading blocks a replica holds, by the tier it would read them from:
    its device pool first, then, past the device run, blocks its CPU or disk tier holds (the CPU
    copy when both do), as the scheduler admits a request (scheduler/admit.py)."""

    device: int = 0
    cpu: int = 0
    disk: int = 0

    @property
    def blocks(self) -> int:
        return self.device + self.cpu + self.disk

    def capped(self, n: int) -> TierRun:
        """The run cut to its first n blocks."""
        device = min(self.device, n)
        cpu = min(self.cpu, n - device)
        return TierRun(device, cpu, min(self.disk, n - device - cpu))


class KVIndex:
    """Exact per-replica, per-tier holdings from KV events."""

    def __init__(self, max_entries_per_replica: int = MAX_ENTRIES_PER_REPLICA) -> None:
        if type(max_entries_per_replica) is not int or not 1 <= max_entries_per_replica <= 1 << 40:
            raise ValueError(
                "max_entries_per_replica: must be an integer in [1, 2**40], got "
                f"{max_entries_per_replica!r}"
            )
        self.max_entries_per_replica = max_entries_per_replica
        self._owners: dict[int, dict[str, int]] = {}  # hash -> {replica: tier bits}
        self._held: dict[str, dict[int, int]] = {}  # replica -> {hash: tier bits}
        self._seq: dict[str, int] = {}  # the last batch applied
        self._out_of_sync: set[str] = set()
        # Out of sync past what batches can repair (an overflowed batch, the entry bound): until
        # a snapshot. The others are out of sync by a gap: exact as of their last batch applied.
        self._broken: set[str] = set()
        self.num_snapshots = 0  # snapshots applied (repairs and first syncs)

    # ---- queries -------------------------------------------------------------------------------
    def replicas(self) -> set[str]:
        return set(self._held)

    def in_sync(self, replica: str) -> bool:
        """Whether replica's entries are its holdings as of its last batch applied."""
        return replica in self._held and replica not in self._out_of_sync

    def applied_seq(self, replica: str) -> int | None:
        """The last batch applied to replica's entries (a snapshot's counts as applied)."""
        return self._seq.get(replica)

    def holdings(self, replica: str) -> dict[int, int]:
        """hash -> tier bits of what replica holds (a copy)."""
        return dict(self._held.get(replica, {}))

    def __len__(self) -> int:
        """Distinct hashes held by any replica."""
        return len(self._owners)

    @property
    def num_entries(self) -> int:
        return sum(len(h) for h in self._held.values())

    def match(self, block_hashes: Sequence[int], replicas: Iterable[str]) -> dict[str, TierRun]:
        """Each replica's run of the prompt's leading blocks, by tier (zero for one not indexed)."""
        wanted = list(replicas)
        runs = {r: TierRun() for r in wanted}
        device = dict.fromkeys(wanted, 0)
        lower: dict[str, list[int]] = {}  # replicas past their device run: [cpu, disk]
        alive = set(wanted)
        for i, h in enumerate(block_hashes):
            owners = self._owners.get(h)
            if not owners or not alive:
                break
            for r in list(alive):
                bits = owners.get(r, 0)
                if r in lower:
                    if not bits & (CPU | DISK):
                        alive.discard(r)
                    else:
                        lower[r][0 if bits & CPU else 1] += 1
                elif bits & DEVICE:
                    device[r] = i + 1
                elif bits & (CPU | DISK):
                    lower[r] = [1, 0] if bits & CPU else [0, 1]
                else:
                    alive.discard(r)
        for r in wanted:
            cpu, disk = lower.get(r, (0, 0))
            runs[r] = TierRun(device[r], cpu, disk)
        return runs

    def longest_holder(self, block_hashes: Sequence[int]) -> tuple[str, TierRun] | None:
        """The replica holding the longest run of the prompt's leading blocks (a peer to pull
        them from), with its run by tier; None when no replica holds the first block."""
        first = self._owners.get(block_hashes[0]) if block_hashes else None
        if not first:
            return None
        runs = self.match(block_hashes, sorted(first))
        return max(runs.items(), key=lambda kv: (kv[1].blocks, kv[1].device, kv[0]))

    # ---- updates -------------------------------------------------------------------------------
    def apply(self, replica: str, report: KVEventReport) -> None:
        """Apply a report: every batch newer than the last applied, in order. Where that fails (a
        replica never synced or past repair, a batch missing, overflowed or past the bound), the
        report's snapshot replaces the replica's entries and the batches after it follow; without
        a snapshot the replica is out of sync."""
        last = self._seq.get(replica)
        if (
            last is not None
            and replica not in self._broken
            and self._caught_up(replica, report.batches, report.seq)
        ):
            return
        snapshot = report.snapshot
        if snapshot is None:
            if last is not None:
                self._out_of_sync.add(replica)
            return
        reset = self._reset(replica, snapshot)
        if reset and not self._caught_up(replica, report.batches, report.seq):
            self._out_of_sync.add(replica)

    def apply_tail(self, tail: KVEventTail) -> bool:
        """Apply the batches a request's last output carried that follow the last applied, in
        order, up to the first that does not. A gap waits for a report or a later tail without
        putting the replica out of sync (the tail is only the log's newest batches: a gap is no
        loss); a replica out of sync by a gap alone is back in sync once a tail follows on. Whether
        the replica's entries are now its holdings as of the tail's own number."""
        replica = tail.replica
        return (
            replica in self._seq
            and replica not in self._broken
            and self._caught_up(replica, tail.batches, tail.seq)
        )

    def _caught_up(self, replica: str, batches: list[KVEventBatch], seq: int) -> bool:
        """Follow the batches; whether the entries are now exact as of seq (then in sync)."""
        if self._follow(replica, batches) < seq or replica in self._broken:
            return False
        self._out_of_sync.discard(replica)
        return True

    def _follow(self, replica: str, batches: list[KVEventBatch]) -> int:
        """Apply the batches after the last applied, in order, up to the first that does not
        follow it; the last applied after them. An overflowed batch, or one past the entry bound,
        leaves the replica broken: only a snapshot repairs it."""
        last = self._seq[replica]
        for batch in batches:
            if batch.seq <= last:
                continue  # applied already, from a report or an output
            if batch.seq != last + 1:
                break  # a gap: the entries stay exact as of last
            if batch.overflowed or not self._apply_batch(replica, batch):
                self._broken.add(replica)
                self._out_of_sync.add(replica)
                break
            last = self._seq[replica] = batch.seq
        return last

    def remove_replica(self, replica: str) -> None:
        for h in self._held.pop(replica, {}):
            self._drop_owner(h, replica)
        self._seq.pop(replica, None)
        self._out_of_sync.discard(replica)
        self._broken.discard(replica)

    def _reset(self, replica: str, snapshot: KVSnapshot) -> bool:
        """replica's entries replaced by the snapshot's; False (out of sync) past its bound."""
        self.remove_replica(replica)
        held = _tier_bits(snapshot)
        if len(held) > self.max_entries_per_replica:
            self._out_of_sync.add(replica)
            self._broken.add(replica)
            self._seq[replica] = snapshot.seq
            return False
        self._held[replica] = held
        owners = self._owners
        for h, bits in held.items():
            owners.setdefault(h, {})[replica] = bits
        self._seq[replica] = snapshot.seq
        self._out_of_sync.discard(replica)
        self._broken.discard(replica)
        self.num_snapshots += 1
        return True

    def _apply_batch(self, replica: str, batch: KVEventBatch) -> bool:
        """False when the batch would take replica past its entry bound (nothing is lost that a
        snapshot will not bring back)."""
        held = self._held.setdefault(replica, {})
        owners = self._owners
        for kind, tier, h in batch.events:
            bits = held.get(h, 0)
            bits = bits | tier if kind == STORED else bits & ~tier
            if bits:
                if h not in held and len(held) >= self.max_entries_per_replica:
                    return False
                held[h] = bits
                owners.setdefault(h, {})[replica] = bits
            elif h in held:
                del held[h]
                self._drop_owner(h, replica)
        return True

    def _drop_owner(self, block_hash: int, replica: str) -> None:
        owners = self._owners.get(block_hash)
        if owners is not None:
            owners.pop(replica, None)
            if not owners:
                del self._owners[block_hash]


class InFlightPrompts:
    """The prompt blocks of the requests this router sent that have not completed, per replica.

    A running request's blocks are referenced in its replica's pool, so nothing evicts them:
    while it is in flight its prompt is (or, once its prefill runs, will be) on that device,
    whatever older events say. Events taken before the replica computed the prompt may reach the
    router after it routed the request; without this, the prompt's next request saw no holder.
    Only requests Serve confirmed sending are pinned (it reports each one's completion); as the
    load tracker's confirmed requests, bounded by the replicas' max_ongoing_requests.
    """

    def __init__(self) -> None:
        self._requests: dict[str, tuple[str, tuple[int, ...]]] = {}  # id -> (replica, hashes)
        self._pinned: dict[str, Counter[int]] = {}  # replica -> hash -> requests holding it

    def __len__(self) -> int:
        return len(self._requests)

    def start(self, request_id: str, replica: str, block_hashes: Sequence[int]) -> None:
        """request_id's prompt is in flight on replica (moved there if it was elsewhere)."""
        self.finish(request_id)
        if not block_hashes:
            return
        hashes = tuple(block_hashes)
        self._requests[request_id] = (replica, hashes)
        self._pinned.setdefault(replica, Counter()).update(hashes)

    def finish(self, request_id: str) -> tuple[str, tuple[int, ...]] | None:
        """Unpin request_id's prompt; its (replica, hashes), None if it was not in flight."""
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return None
        replica, hashes = entry
        pinned = self._pinned[replica]
        pinned.subtract(hashes)
        for h in hashes:
            if pinned[h] <= 0:
                del pinned[h]
        if not pinned:
            del self._pinned[replica]
        return entry

    def run(self, block_hashes: Sequence[int], replica: str) -> int:
        """Leading blocks of block_hashes that requests in flight on replica hold."""
        pinned = self._pinned.get(replica)
        if not pinned:
            return 0
        n = 0
        for h in block_hashes:
            if h not in pinned:
                break
            n += 1
        return n

    def remove_replica(self, replica: str) -> None:
        for rid in [rid for rid, (r, _) in self._requests.items() if r == replica]:
            del self._requests[rid]
        self._pinned.pop(replica, None)


def _tier_bits(snapshot: KVSnapshot) -> dict[int, int]:
    """Each hash a snapshot lists -> the tiers (bits) that hold it."""
    held: dict[int, int] = {}
    for tier, hashes in ((DEVICE, snapshot.device), (CPU, snapshot.cpu), (DISK, snapshot.disk)):
        for h in hashes:
            held[h] = held.get(h, 0) | tier
    return held
