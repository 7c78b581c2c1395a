"""KV events: what a replica's prefix cache stores and loses, tier by tier, for the fleet router.

The block pool (scheduler/block_manager.py) and the lower tiers' indexes (scheduler/kv_connector.py
`TierIndex`) call `KVEventLog.record` when a block hash becomes findable in a tier or stops being
findable there; nothing is recorded while no log is attached. Events are closed into numbered
batches at the end of each scheduled step (`end_step`), and the replica publishes the batches the
log still holds with its routing stats (cluster/kv_event_pub.py). The router (router/kv_events.py)
applies each batch once, in sequence order; a gap (a batch it never saw) makes it wait for the
batches that follow on, and one cut short by the per-batch cap for a snapshot, which the log
attaches to a report every `snapshot_every` reports (and to the first, and after an overflow).
Each request's last output carries the log's newest batches as well (`tail`, a `KVEventTail` of
at most MAX_OUTPUT_EVENTS events), which reach the router sooner; it applies a batch that both
bring once.

A move between tiers is a removal from one and a store in the other, in the same batch: a block
saved from the device pool to the CPU tier is (REMOVED, DEVICE) then (STORED, CPU); a CPU block
demoted to disk is (REMOVED, CPU) then (STORED, DISK). Events travel as plain ints.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler

# Tiers, as bits: a hash may be findable in several at once (a block loaded back from the CPU
# tier stays there too).
DEVICE = 1
CPU = 2
DISK = 4
TIERS = (DEVICE, CPU, DISK)
ALL_TIERS = DEVICE | CPU | DISK

STORED = 0
REMOVED = 1

# Events per batch: a step evicts and registers at most its batch's blocks; past this the batch is
# sent empty and marked overflowed, and routers repair from the next snapshot.
MAX_EVENTS_PER_BATCH = 8192
# Events the log keeps for reports (oldest batches dropped first): about one report period's worth
# at thousands of blocks a second.
MAX_WINDOW_EVENTS = 32768
# Reports whose batches a report repeats: a router that misses fewer reports in a row than this
# loses nothing (Serve hands each router the latest report it has when it routes), and an idle
# replica's reports shrink to nothing instead of repeating a full window every second.
WINDOW_REPORTS = 3
# Reports between two snapshots: the longest a router that lost a batch waits for its repair.
SNAPSHOT_EVERY = 10
# Events a request's last output carries back (the log's newest batches that fit): a router
# further behind than this waits for the next report, as it did without them.
MAX_OUTPUT_EVENTS = 4096

Event = tuple[int, int, int]  # (STORED or REMOVED, tier bit, block hash)


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """The events of one step, numbered from 1 by the replica's log, in the order they happened."""

    seq: int
    events: list[Event] = field(default_factory=list)
    overflowed: bool = False  # more than the cap happened: events dropped, a snapshot repairs it


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """Every hash each tier holds after batch seq (the state a router resets to)."""

    seq: int
    device: list[int]
    cpu: list[int] = field(default_factory=list)
    disk: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class KVEventReport:
    """What one routing-stats report carries: the batches the log holds, oldest first, and maybe a
    snapshot (a router applies the snapshot first when it needs one, then the later batches)."""

    batches: list[KVEventBatch]
    snapshot: KVSnapshot | None = None
    seq: int = 0  # the log's last batch when the report was taken: a router behind it has a gap


@dataclass(frozen=True, slots=True)
class KVEventTail:
    """The newest batches of one replica's log, oldest first, carried back with a request's last
    output: the ingress hands them to its router before the client can send its next request.

    `check` runs when one is made and where one is received (unpickling makes no call)."""

    replica: str  # the replica whose log it is (Serve's replica id)
    batches: list[KVEventBatch]
    seq: int  # the log's last batch when taken: a router at it knows the replica's holdings

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """ValueError naming the field when the tail is out of its bounds."""
        if type(self.replica) is not str or not 1 <= len(self.replica) <= 256:
            raise ValueError(f"kv_events.replica: expected 1-256 characters, got {self.replica!r}")
        if type(self.seq) is not int or not 0 <= self.seq < 1 << 63:
            raise ValueError(f"kv_events.seq: expected an integer in [0, 2**63), got {self.seq!r}")
        if type(self.batches) is not list:
            raise ValueError(f"kv_events.batches: expected a list, got {type(self.batches)}")
        cost, last = 0, 0
        for batch in self.batches:
            if type(batch.seq) is not int or not last < batch.seq <= self.seq:
                raise ValueError(
                    f"kv_events.batches: batch seq {batch.seq!r} not increasing up to {self.seq}"
                )
            if type(batch.events) is not list:
                raise ValueError(f"kv_events.batches: batch {batch.seq} events are not a list")
            last, cost = batch.seq, cost + _cost(batch)
        if cost > MAX_OUTPUT_EVENTS:
            raise ValueError(
                f"kv_events.batches: {cost} events (an empty batch counts one), at most "
                f"{MAX_OUTPUT_EVENTS}"
            )


def _cost(batch: KVEventBatch) -> int:
    """What a batch takes of a tail's budget: its events, one for an empty (overflowed) batch."""
    return len(batch.events) or 1


class KVEventLog:
    """A replica's event recorder: bounded batches, a window bounded in events and in reports,
    periodic snapshots.

    `snapshot_of` reads the tiers' current holdings (the engine side wires it: the pool's cached
    hashes, the connector's tier slots). Called on the engine's thread only.
    """

    def __init__(
        self,
        snapshot_of: Callable[[], tuple[list[int], list[int], list[int]]],
        max_events_per_batch: int = MAX_EVENTS_PER_BATCH,
        max_window_events: int = MAX_WINDOW_EVENTS,
        snapshot_every: int = SNAPSHOT_EVERY,
        window_reports: int = WINDOW_REPORTS,
    ) -> None:
        for name, value in (
            ("max_events_per_batch", max_events_per_batch),
            ("max_window_events", max_window_events),
            ("snapshot_every", snapshot_every),
            ("window_reports", window_reports),
        ):
            if type(value) is not int or not 1 <= value <= 1 << 32:
                raise ValueError(f"{name}: must be an integer in [1, 2**32], got {value!r}")
        self.snapshot_of = snapshot_of
        self.max_events_per_batch = max_events_per_batch
        self.max_window_events = max_window_events
        self.snapshot_every = snapshot_every
        self.seq = 0  # the last batch closed
        self._open: list[Event] = []
        self._overflowed = False
        self._snapshot_due = True  # the first report carries one
        self._window: deque[KVEventBatch] = deque()
        self._window_events = 0
        # The last batch of each of the latest window_reports reports, oldest first.
        self._report_ends: deque[int] = deque(maxlen=window_reports)
        self._reports = 0
        # The newest batches within MAX_OUTPUT_EVENTS, for tails, whatever reports have taken:
        # a router that missed reports catches up from the next output.
        self._recent: deque[KVEventBatch] = deque()
        self._recent_cost = 0

    def record(self, kind: int, tier: int, block_hash: int) -> None:
        if len(self._open) >= self.max_events_per_batch:
            self._overflowed = True
            return
        self._open.append((kind, tier, block_hash))

    def end_step(self) -> None:
        """Close the step's batch (none when nothing happened)."""
        if not self._open and not self._overflowed:
            return
        self.seq += 1
        events = [] if self._overflowed else self._open
        batch = KVEventBatch(self.seq, events, self._overflowed)
        self._snapshot_due |= self._overflowed  # every router needs it: do not wait the period
        self._open, self._overflowed = [], False
        self._window.append(batch)
        self._window_events += len(events)
        self._recent.append(batch)
        self._recent_cost += _cost(batch)
        while self._recent_cost > MAX_OUTPUT_EVENTS:
            self._recent_cost -= _cost(self._recent.popleft())
        while self._window_events > self.max_window_events and len(self._window) > 1:
            self._window_events -= len(self._window.popleft().events)

    def tail(self, replica: str, max_events: int = MAX_OUTPUT_EVENTS) -> KVEventTail:
        """The open batch closed, then the newest batches whose events total at most max_events
        (what a request's last output carries back)."""
        if type(max_events) is not int or not 0 <= max_events <= MAX_OUTPUT_EVENTS:
            raise ValueError(
                f"max_events: must be an integer in [0, {MAX_OUTPUT_EVENTS}], got {max_events!r}"
            )
        self.end_step()
        newest: list[KVEventBatch] = []
        for batch in reversed(self._recent):
            max_events -= _cost(batch)
            if max_events < 0:
                break
            newest.append(batch)
        return KVEventTail(replica, newest[::-1], self.seq)

    def request_snapshot(self) -> None:
        """Attach a snapshot to the next report (a router that cannot wait the period)."""
        self._snapshot_due = True

    def report(self) -> KVEventReport:
        """The batches held (the open one closed first), with a snapshot on the first report,
        after an overflowed batch, and every snapshot_every-th report."""
        self.end_step()
        if len(self._report_ends) == self._report_ends.maxlen:  # older batches leave the window
            oldest = self._report_ends[0]
            while self._window and self._window[0].seq <= oldest:
                self._window_events -= len(self._window.popleft().events)
        self._report_ends.append(self.seq)
        snapshot = None
        self._reports += 1
        if self._snapshot_due or self._reports % self.snapshot_every == 0:
            device, cpu, disk = self.snapshot_of()
            snapshot = KVSnapshot(self.seq, device, cpu, disk)
            self._snapshot_due = False
        return KVEventReport(list(self._window), snapshot, self.seq)


def attach_kv_log(scheduler: Scheduler) -> KVEventLog:
    """A KV event log fed by scheduler's device pool and lower tiers (call before its first step,
    or on the engine's thread): the production replica's (cluster/kv_event_pub.py) and the
    simulator's (sim/fleet_kv.py)."""
    pool, connector = scheduler.kv.pool, scheduler.connector

    def snapshot() -> tuple[list[int], list[int], list[int]]:
        # The connector is read each time: a disaggregated replica may swap it after start.
        tiers = scheduler.connector
        if tiers is None:
            return list(pool.cached), [], []
        disk = list(tiers.disk.slots) if tiers.disk is not None else []
        return list(pool.cached), list(tiers.cpu.slots), disk

    log = KVEventLog(snapshot)
    pool.events = log
    if connector is not None:
        connector.cpu.events = log
        if connector.disk is not None:
            connector.disk.events = log
    return log
