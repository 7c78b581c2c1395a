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


# How many reports a late one may trail the last applied by (Serve delivers a few late at most).
LATE_REPORTS = 64
# Entries kept for a replica that has not yet said how many KV blocks it has: as many as its
# prefix report may list.
DEFAULT_REPLICA_BLOCKS = 4096


class PrefixIndex:
    """Map from prompt block hash to the replicas believed to hold that block, bounded per replica.

    Each replica's entries are kept in LRU order up to its bound (the KV blocks it can hold, once
    its stats say so), so the index grows with the fleet instead of one global LRU squeezing every
    replica's share as replicas are added. An optional max_blocks caps all entries together,
    trimming the replica with the most entries first.
    """

    def __init__(
        self, blocks_per_replica: int = DEFAULT_REPLICA_BLOCKS, max_blocks: int | None = None
    ):
        self.blocks_per_replica = blocks_per_replica
        self.max_blocks = max_blocks
        # hash -> {replica: when routing last planted it there}
        self._owners: dict[int, dict[str, float]] = {}
        # replica -> its blocks, least recently planted or listed first
        self._by_replica: dict[str, OrderedDict[int, None]] = {}
        self._bounds: dict[str, int] = {}
        self.num_entries = 0  # (replica, block) pairs: the sum of every replica's entries
        # What each replica's last report listed, and the blocks planted by routing since then that
        # no report has confirmed yet: a report is applied as its difference from the previous one,
        # so a fleet of replicas holding thousands of blocks each costs the changes, not the
        # holdings.
        self._reported: dict[str, set[int]] = {}
        self._unreported: dict[str, set[int]] = {}
        self._report_ids: dict[str, int] = {}  # the number of the report applied last

    def __len__(self) -> int:
        """Distinct blocks held by any replica."""
        return len(self._owners)

    def replicas_of(self, block_hash: int) -> set[str]:
        return set(self._owners.get(block_hash, ()))

    def blocks_of(self, replica: str) -> set[int]:
        return set(self._by_replica.get(replica, ()))

    def lru_order(self, replica: str) -> list[int]:
        """replica's blocks, least recently used first."""
        return list(self._by_replica.get(replica, ()))

    def replicas(self) -> set[str]:
        return set(self._by_replica)

    def footprint(self, replica: str) -> int:
        """Blocks attributed to replica: how much of the fleet's cached prefixes it holds."""
        return len(self._by_replica.get(replica, ()))

    def bound(self, replica: str) -> int:
        """The most entries replica may have."""
        return self._bounds.get(replica, self.blocks_per_replica)

    def set_bound(self, replica: str, blocks: int) -> None:
        """Keep at most blocks entries for replica (its KV block count), trimming the least
        recently used at once."""
        if blocks < 1:
            raise ValueError(
                f"prefix index bound of replica {replica!r}: must be >= 1, got {blocks}"
            )
        self._bounds[replica] = blocks
        self._trim(replica)

    def insert(self, replica: str, block_hashes: Iterable[int], now: float) -> None:
        """Record that replica received these blocks: routing planted them at now.

        now is -inf for blocks only a report listed: a later report lacking them drops them at once,
        where a planted block is spared for the grace window. Inserted in reverse so the leading
        blocks end up most recent: they are the most shared, and evicting a tail block first keeps
        the leading run of every other prompt intact.
        """
        mine = self._by_replica.setdefault(replica, OrderedDict())
        reported: Hashes = self._reported.get(replica, frozenset())
        unreported = self._unreported.setdefault(replica, set())
        for h in reversed(list(block_hashes)):
            owners = self._owners.get(h)
            if owners is None:
                owners = self._owners[h] = {}
            owners[replica] = now
            if h in mine:
                mine.move_to_end(h)
            else:
                mine[h] = None
                self.num_entries += 1
            if h not in reported:
                unreported.add(h)
        self._trim(replica)

    def _trim(self, replica: str) -> None:
        mine = self._by_replica.get(replica)
        if mine is None:
            return
        bound = self.bound(replica)
        while len(mine) > bound:
            self._forget(replica, mine.popitem(last=False)[0])
        if self.max_blocks is not None and self.num_entries > self.max_blocks:
            self._trim_fleet(self.max_blocks)

    def _trim_fleet(self, max_blocks: int) -> None:
        """The global cap: the replica with the most entries gives up its least recently used."""
        while self.num_entries > max_blocks:
            fullest = max(self._by_replica.items(), key=lambda kv: (len(kv[1]), kv[0]))
            name, blocks = fullest
            self._forget(name, blocks.popitem(last=False)[0])

    def _forget(self, replica: str, block_hash: int) -> None:
        """Drop replica's entry for block_hash, already taken out of its LRU order."""
        self.num_entries -= 1
        self._drop(replica, block_hash)

    def match(self, block_hashes: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        """Length of the leading run of block_hashes held by each replica.

        A match is not a use: the replica routing then picks is charged with the blocks (insert()),
        which refreshes them there, as that replica's own cache is refreshed by the request.
        """
        runs = dict.fromkeys(replicas, 0)
        alive = set(runs)
        for i, h in enumerate(block_hashes):
            owners = self._owners.get(h)
            if not owners:
                break
            alive = alive.intersection(owners)
            if not alive:
                break
            for r in alive:
                runs[r] = i + 1
        return runs

    def planted_run(self, block_hashes: Sequence[int], replica: str, since: float) -> int:
        """Length of the leading run of block_hashes that routing planted on replica after since:
        requests sent there whose blocks the replica's KV events cannot show yet."""
        n = 0
        for h in block_hashes:
            owners = self._owners.get(h)
            if owners is None or owners.get(replica, -math.inf) <= since:
                break
            n += 1
        return n

    def remove_replica(self, replica: str) -> None:
        self._reported.pop(replica, None)
        self._unreported.pop(replica, None)
        self._report_ids.pop(replica, None)
        self._bounds.pop(replica, None)
        mine = self._by_replica.pop(replica, OrderedDict())
        self.num_entries -= len(mine)
        for h in mine:
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
        unreported for grace_s. A block still resident keeps its place in the LRU order (routing a
        request there refreshes it), and one the bound evicted comes back only when routing plants
        it or a report lists it anew.
        """
        if self._is_late(replica, report.report_id):
            return
        listed, dropped, ordered = self._relist(replica, report)
        mine = self._by_replica.setdefault(replica, OrderedDict())
        self._settle_unreported(replica, listed, dropped, now - grace_s)
        new = listed.difference(mine)
        if new:
            self.insert(replica, _in_listed_order(ordered, new), -math.inf)

    def _is_late(self, replica: str, report_id: int) -> bool:
        """Older than a report applied: Serve hands a router reports late, and this one would list
        again blocks the replica evicted since (a hit predicted where it computes). One far older
        is not late but a renumbering (a hostile number before it): applied."""
        last = self._report_ids.get(replica)
        return last is not None and last - LATE_REPORTS <= report_id < last

    def _settle_unreported(
        self, replica: str, listed: Hashes, dropped: Hashes, cutoff: float
    ) -> None:
        """The blocks a report lists are confirmed; those it no longer lists join the unreported,
        and an unreported block routing planted before cutoff is dropped."""
        mine = self._by_replica[replica]
        unreported = self._unreported.setdefault(replica, set())
        # unreported never holds a block the previous report listed, so of the blocks listed now
        # only the newly listed can be in it.
        unreported -= listed
        unreported |= dropped
        owners = self._owners
        stale = [h for h in unreported if h not in mine or owners[h][replica] < cutoff]
        unreported.difference_update(stale)
        for h in stale:
            if mine.pop(h, 0) is None:  # an entry (its value is None); 0: the bound evicted it
                self._forget(replica, h)

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
            changed = _apply_change(report, reported)
            if changed is not None:
                return changed
        # C-level passes over the holdings, then work on the changes only: a report differs from
        # the one before by a few blocks out of about a thousand, and most drop none.
        keep = set(report.hashes)
        previous = reported or set()
        listed = keep - previous
        dropped = previous - keep if len(keep) - len(listed) < len(previous) else set()
        self._reported[replica] = keep
        return listed, dropped, report.hashes


def _apply_change(
    report: PrefixReport, reported: set[int]
) -> tuple[Hashes, Hashes, list[int]] | None:
    """A report's own account of its change since its base, applied to the blocks listed
    (reported, changed in place); None, and nothing changed, if the account does not add up."""
    change = ReportChange.of(report)
    ordered = change.listed_in(report.hashes, reported)
    if ordered is None:
        return None
    reported -= change.unlisted_set
    reported |= change.listed_set
    return change.listed_set, change.unlisted_set, ordered


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
