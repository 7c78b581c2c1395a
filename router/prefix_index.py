"""The router's prefix index: which replicas are believed to hold which prompt blocks."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from scheduler.block_manager import PrefixReport

Hashes = set[int] | frozenset[int]


def _in_listed_order(listed: list[int], wanted: Hashes) -> list[int]:
    """The members of wanted in listed's order (a report's list: no duplicates)."""
    # Blocks a report lists for the first time were mostly registered since the report before, so
    # they sit near the end of its oldest-first list: search ever longer tails, not the whole list.
    if not wanted:
        return []
    k = len(wanted)
    while k < len(listed):
        tail = listed[-k:]
        if wanted.issubset(tail):
            return [h for h in tail if h in wanted]
        k *= 4
    return [h for h in listed if h in wanted]


class PrefixIndex:
    """LRU-bounded map from prompt block hash to the replicas believed to hold that block."""

    def __init__(self, max_blocks: int):
        self.max_blocks = max_blocks
        # hash -> {replica: when routing last planted it there}, least recently used first
        self._owners: OrderedDict[int, dict[str, float]] = OrderedDict()
        self._by_replica: dict[str, set[int]] = {}
        # What each replica's last report listed, and the blocks planted by routing since then that
        # no report has confirmed yet: a report is applied as its difference from the previous one,
        # so a fleet of replicas holding thousands of blocks each costs the changes, not the
        # holdings.
        self._reported: dict[str, set[int]] = {}
        self._unreported: dict[str, set[int]] = {}
        self._report_ids: dict[str, int] = {}  # the number of the report applied last

    def __len__(self) -> int:
        return len(self._owners)

    def replicas_of(self, block_hash: int) -> set[str]:
        return set(self._owners.get(block_hash, ()))

    def blocks_of(self, replica: str) -> set[int]:
        return set(self._by_replica.get(replica, ()))

    def replicas(self) -> set[str]:
        return set(self._by_replica)

    def footprint(self, replica: str) -> int:
        """Blocks attributed to replica: how much of the fleet's cached prefixes it holds."""
        return len(self._by_replica.get(replica, ()))

    def insert(self, replica: str, block_hashes: Iterable[int], now: float) -> None:
        """Record that replica received these blocks: routing planted them at now.

        now is -inf for blocks only a report listed: a later report lacking them drops them at once,
        where a planted block is spared for the grace window. Inserted in reverse so the leading
        blocks end up most recent: they are the most shared, and evicting a tail block first keeps
        the leading run of every other prompt intact.
        """
        mine = self._by_replica.setdefault(replica, set())
        reported: Hashes = self._reported.get(replica, frozenset())
        unreported = self._unreported.setdefault(replica, set())
        for h in reversed(list(block_hashes)):
            owners = self._owners.get(h)
            if owners is None:
                owners = self._owners[h] = {}
            else:
                self._owners.move_to_end(h)
            owners[replica] = now
            mine.add(h)
            if h not in reported:
                unreported.add(h)
        while len(self._owners) > self.max_blocks:
            h, owners = self._owners.popitem(last=False)
            for r in owners:
                self._by_replica[r].discard(h)

    def match(self, block_hashes: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        """Length of the leading run of block_hashes held by each replica; a match is a use."""
        runs = dict.fromkeys(replicas, 0)
        alive = set(runs)
        matched = 0
        for i, h in enumerate(block_hashes):
            owners = self._owners.get(h)
            if not owners:
                break
            alive = alive.intersection(owners)
            if not alive:
                break
            for r in alive:
                runs[r] = i + 1
            matched = i + 1
        for h in reversed(block_hashes[:matched]):
            self._owners.move_to_end(h)
        return runs

    def remove_replica(self, replica: str) -> None:
        self._reported.pop(replica, None)
        self._unreported.pop(replica, None)
        self._report_ids.pop(replica, None)
        for h in self._by_replica.pop(replica, ()):
            self._drop(replica, h)

    def _drop(self, replica: str, block_hash: int) -> None:
        owners = self._owners.get(block_hash)
        if owners is not None:
            owners.pop(replica, None)
            if not owners:
                del self._owners[block_hash]

    def sync_replica(self, replica: str, report: PrefixReport, now: float, grace_s: float) -> None:
        """Correct the index from the replica's own list of resident block hashes (after evictions).

        Blocks new since the previous report are inserted (as insert() would); blocks it listed
        before and lists no more are dropped, and so are blocks routing planted that stayed
        unreported for grace_s. A block still resident keeps its place in the LRU order (a match
        refreshes it), and one the LRU bound evicted comes back only when routing plants it or a
        report lists it anew.
        """
        listed, dropped, ordered = self._relist(replica, report)
        mine = self._by_replica.setdefault(replica, set())
        unreported = self._unreported.setdefault(replica, set())
        # unreported never holds a block the previous report listed, so of the blocks listed now
        # only the newly listed can be in it.
        unreported -= listed
        unreported |= dropped  # no longer listed: dropped below unless planted within grace_s
        cutoff = now - grace_s
        owners = self._owners
        stale = [h for h in unreported if h not in mine or owners[h][replica] < cutoff]
        unreported.difference_update(stale)
        mine.difference_update(stale)
        for h in stale:
            self._drop(replica, h)
        new = listed - mine
        if new:
            self.insert(replica, _in_listed_order(ordered, new), -math.inf)

    def _relist(self, replica: str, report: PrefixReport) -> tuple[Hashes, Hashes, list[int]]:
        """Record the report as replica's listed blocks: (newly listed, no longer listed, the order
        to add them in).

        A report that names the report applied last as its base is applied by its own account of
        the change, if that adds up; otherwise the lists are compared.
        """
        reported = self._reported.get(replica)
        applied_last = self._report_ids.get(replica)
        self._report_ids[replica] = report.report_id
        if reported is not None and report.base_id is not None and report.base_id == applied_last:
            change = ReportChange.of(report)
            ordered = change.listed_in(report.hashes, reported)
            if ordered is not None:
                reported -= change.unlisted_set
                reported |= change.listed_set
                return change.listed_set, change.unlisted_set, ordered
        # C-level passes over the holdings, then work on the changes only: a report differs from
        # the one before by a few blocks out of about a thousand, and most drop none.
        keep = set(report.hashes)
        previous = reported or set()
        listed = keep - previous
        dropped = previous - keep if len(keep) - len(listed) < len(previous) else set()
        self._reported[replica] = keep
        return listed, dropped, report.hashes


@dataclass(frozen=True, slots=True)
class ReportChange:
    """A prefix report's account of how it differs from its base report, as sets."""

    listed_set: frozenset[int]  # listed now, not in report base_id
    unlisted_set: frozenset[int]  # listed in report base_id, not now
    num_listed: int  # as sent (a duplicate makes it differ from the set's size)
    num_unlisted: int

    @classmethod
    def of(cls, report: PrefixReport) -> ReportChange:
        return cls(
            frozenset(report.listed),
            frozenset(report.unlisted),
            len(report.listed),
            len(report.unlisted),
        )

    def listed_in(self, resident: list[int], previous: set[int]) -> list[int] | None:
        """The newly listed blocks in the report's order, if the change adds up: applied to the
        previous report's blocks it gives as many distinct blocks as the report lists, and the
        report lists every block it calls new. None otherwise (the lists are then compared)."""
        if not (
            len(self.listed_set) == self.num_listed
            and len(self.unlisted_set) == self.num_unlisted
            and self.listed_set.isdisjoint(previous)
            and self.unlisted_set <= previous
            and len(previous) - self.num_unlisted + self.num_listed == len(resident)
        ):
            return None
        # O(how far back the first new block lies)
        ordered = _in_listed_order(resident, self.listed_set)
        return ordered if len(ordered) == self.num_listed else None
