"""The router's prefix index: which replicas are believed to hold which prompt blocks."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from router.loads import _Aligned


def _in_listed_order(listed: list[int], wanted: set[int]) -> list[int]:
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
        self._owners: OrderedDict[int, dict[str, float]] = (
            OrderedDict()
        )  # hash -> {replica: last planted}
        self._by_replica: dict[str, set[int]] = {}
        # What each replica's last report listed, and the blocks planted by routing since then that
        # no report has confirmed yet: a report is applied as its difference from the previous one,
        # so a fleet of replicas holding thousands of blocks each costs the changes, not the
        # holdings.
        self._reported: dict[str, set[int]] = {}
        self._unreported: dict[str, set[int]] = {}
        self._report_ids: dict[str, int | None] = {}  # the number of the report applied last
        self._footprints = _Aligned(self.footprint, self._footprints_of, "q")
        # Every change of the index bumps this, so that an insert repeating the last one with none
        # in between (a router charging a request at its pick, then at its confirmation at the same
        # instant) is known to change nothing and skipped.
        self._changes = 0
        self._last_insert: tuple[str, float, int, tuple[int, ...]] | None = None

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

    def least_footprint(self, replicas: Sequence[str]) -> str:
        """The replica of replicas with the smallest footprint (the first of equals); replicas
        non-empty."""
        sizes = self._footprints_of(replicas)  # a list made per request: not worth keeping
        return replicas[sizes.index(min(sizes))]

    def _footprints_of(self, replicas: Sequence[str]) -> list[int]:
        return list(
            map(len, map(self._by_replica.get, replicas, repeat(())))
        )  # no Python call per replica

    def footprints(self, replicas: Sequence[str]) -> Sequence[int]:
        """The footprint of each of replicas, in order; read only (it is kept for the next call with
        this list)."""
        return self._footprints.values(replicas)

    def smallest_footprint(self, replicas: Sequence[str]) -> int:
        """min(footprints(replicas)); replicas non-empty."""
        return self._footprints.least(replicas)

    def insert(self, replica: str, block_hashes: Iterable[int], now: float) -> None:
        """Record that replica received these blocks (routing planted them at now)."""
        hashes = tuple(block_hashes)
        last = self._last_insert
        if (
            last is not None
            and last[2] == self._changes
            and last[:2] == (replica, now)
            and last[3] == hashes
        ):
            return
        self._add(replica, hashes, now)
        # Its blocks are now the newest entries, in its order (those past the bound evicted): a
        # repeat would move them into that order again and evict the same ones.
        self._last_insert = (replica, now, self._changes, hashes)

    def _add(self, replica: str, block_hashes: Iterable[int], planted: float) -> None:
        # planted: when routing last sent the block there (-inf: only a report listed it), so that a
        # report lacking it spares it for the grace window. Reversed so the leading blocks end up
        # most recent: they are the most shared, and evicting a tail block first keeps the leading
        # run of every other prompt intact.
        self._changes += 1
        mine = self._by_replica.setdefault(replica, set())
        reported = self._reported.get(replica, frozenset())
        unreported = self._unreported.setdefault(replica, set())
        for h in reversed(list(block_hashes)):
            owners = self._owners.get(h)
            if owners is None:
                owners = self._owners[h] = {}
            else:
                self._owners.move_to_end(h)
            owners[replica] = planted
            mine.add(h)
            if h not in reported:
                unreported.add(h)
        self._footprints.update(replica)
        while len(self._owners) > self.max_blocks:
            h, owners = self._owners.popitem(last=False)
            for r in owners:
                self._by_replica[r].discard(h)
                self._footprints.update(r)

    def match(self, block_hashes: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        """Length of the leading run of block_hashes held by each replica."""
        runs = dict.fromkeys(replicas, 0)
        runs.update(self.holder_runs(block_hashes, set(runs)))
        return runs

    def holder_runs(self, block_hashes: Sequence[int], replicas: set[str]) -> dict[str, int]:
        """match() restricted to the replicas holding at least the first block: O(holders), not
        O(replicas)."""
        runs: dict[str, int] = {}
        alive = replicas
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
        if matched:
            self._changes += 1
        for h in reversed(block_hashes[:matched]):
            self._owners.move_to_end(h)
        return runs

    def remove_replica(self, replica: str) -> None:
        self._changes += 1
        self._reported.pop(replica, None)
        self._unreported.pop(replica, None)
        self._report_ids.pop(replica, None)
        for h in self._by_replica.pop(replica, ()):
            self._drop(replica, h)
        self._footprints.update(replica)

    def _drop(self, replica: str, block_hash: int) -> None:
        owners = self._owners.get(block_hash)
        if owners is not None:
            owners.pop(replica, None)
            if not owners:
                del self._owners[block_hash]

    def sync_replica(
        self,
        replica: str,
        resident: Iterable[int],
        now: float,
        grace_s: float,
        change: ReportChange | None = None,
    ) -> None:
        """Correct the index from the replica's own list of resident block hashes (after evictions).

        Blocks new since the previous report are inserted (as insert() would); blocks it listed
        before
        and lists no more are dropped, and so are blocks routing planted that stayed unreported for
        grace_s. A block still resident keeps its place in the LRU order (a match refreshes it), and
        one the LRU bound evicted comes back only when routing plants it or a report lists it anew.
        change: the report's own account of how it differs from the replica's report it names; used
        when that is the report applied last and the account adds up, instead of comparing the
        lists.
        """
        self._changes += 1
        resident = resident if isinstance(resident, list) else list(resident)
        listed, dropped, ordered = self._relist(replica, resident, change)
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
        self._footprints.update(replica)
        new = listed - mine
        if new:
            self._add(replica, _in_listed_order(ordered, new), -math.inf)

    def _relist(
        self, replica: str, resident: list[int], change: ReportChange | None
    ) -> tuple[Set[int], Set[int], list[int]]:
        """Record the report as replica's listed blocks: (newly listed, no longer listed, the order
        to add them in)."""
        reported = self._reported.get(replica)
        ordered = None
        if (
            change is not None
            and change.base_id is not None
            and reported is not None
            and self._report_ids.get(replica) == change.base_id
        ):
            ordered = change.listed_in(resident, reported)
        self._report_ids[replica] = change.report_id if change is not None else None
        if ordered is not None:
            reported -= change.unlisted_set
            reported |= change.listed_set
            return change.listed_set, change.unlisted_set, ordered
        # C-level passes over the holdings, then work on the changes only: a report differs from
        # the one before by a few blocks out of about a thousand, and most drop none.
        keep = set(resident)
        previous = reported or set()
        listed = keep - previous
        dropped = previous - keep if len(keep) - len(listed) < len(previous) else set()
        self._reported[replica] = keep
        return listed, dropped, resident


@dataclass(frozen=True, slots=True)
class ReportChange:
    """A prefix report's account of how it differs from an earlier report of the same replica."""

    report_id: int
    base_id: int | None
    listed_set: frozenset[int]  # listed now, not in report base_id
    unlisted_set: frozenset[int]  # listed in report base_id, not now
    num_listed: int  # as sent (a duplicate makes it differ from the set's size)
    num_unlisted: int

    @classmethod
    def of(cls, stats: Mapping[str, Any]) -> ReportChange | None:
        """From a stats dict's prefix_* fields; None where absent or malformed (the lists are then
        compared)."""
        report_id, base_id = stats.get("prefix_report_id"), stats.get("prefix_base_id")
        if type(report_id) is not int:
            return None
        listed, unlisted = stats.get("prefix_listed"), stats.get("prefix_unlisted")
        if type(base_id) is not int or not _block_hashes(listed) or not _block_hashes(unlisted):
            return cls(report_id, None, frozenset(), frozenset(), 0, 0)
        return cls(
            report_id, base_id, frozenset(listed), frozenset(unlisted), len(listed), len(unlisted)
        )

    def listed_in(self, resident: list[int], previous: set[int]) -> list[int] | None:
        """The newly listed blocks in the report's order, if the change adds up: applied to the
        previous
        report's blocks it gives as many distinct blocks as the report lists, and the report lists
        every block it calls new. None otherwise (the lists are then compared)."""
        if not (
            len(self.listed_set) == self.num_listed
            and len(self.unlisted_set) == self.num_unlisted
            and self.listed_set.isdisjoint(previous)
            and self.unlisted_set <= previous
            and len(previous) - self.num_unlisted + self.num_listed == len(resident)
        ):
            return None
        ordered = _in_listed_order(
            resident, self.listed_set
        )  # O(how far back the first new block lies)
        return ordered if len(ordered) == self.num_listed else None


def _block_hashes(value: Any) -> bool:
    """Whether value is a list of block hashes (ints of 128 bits at most)."""
    # C-level passes: a report's change is checked on every report of every replica.
    return type(value) is list and (
        not value or (set(map(type, value)) == {int} and min(value) >= 0 and max(value) < 1 << 128)
    )
