"""KV events carried back with each request's last output (scheduler/kv_events.py `tail`,
router/kv_events.py `apply_tail`): the same batches the routing-stats reports bring, sooner. Both
channels, in any order, duplicated or late, keep the index exactly the replica's holdings as of
the last batch applied; a gap in a tail waits for a report instead of putting the replica out of
sync."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.config import RoutingConfig
from router.fleet import FleetState
from router.kv_events import KVIndex
from router.stats import RoutingStats
from scheduler.kv_events import (
    CPU,
    DEVICE,
    MAX_OUTPUT_EVENTS,
    REMOVED,
    STORED,
    TIERS,
    KVEventBatch,
    KVEventLog,
    KVEventReport,
    KVEventTail,
)
from scheduler.outputs import SchedulerStats


class Replica:
    """A replica's tiers as a dict (hash -> tier bits) with the log that records their changes."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}
        self.log = KVEventLog(self.snapshot, window_reports=2)
        self.at: dict[int, dict[int, int]] = {0: {}}  # batch seq -> holdings after it

    def snapshot(self) -> tuple[list[int], list[int], list[int]]:
        device, cpu, disk = ([h for h, bits in self.held.items() if bits & t] for t in TIERS)
        return device, cpu, disk

    def toggle(self, block_hash: int, tier: int) -> None:
        bits = self.held.get(block_hash, 0)
        kind = REMOVED if bits & tier else STORED
        self.log.record(kind, tier, block_hash)
        bits ^= tier
        if bits:
            self.held[block_hash] = bits
        else:
            del self.held[block_hash]

    def end_step(self) -> None:
        self.log.end_step()
        self.at[self.log.seq] = dict(self.held)

    def tail(self) -> KVEventTail:
        tail = self.log.tail("r")
        self.at[self.log.seq] = dict(self.held)
        return tail


def assert_exact(index: KVIndex, replica: Replica) -> None:
    """In sync means: the entries are the holdings after the last batch applied."""
    if index.in_sync("r"):
        seq = index.applied_seq("r")
        assert seq is not None
        assert index.holdings("r") == replica.at[seq]


steps = st.lists(
    st.tuples(
        st.lists(st.tuples(st.integers(0, 11), st.sampled_from(TIERS)), max_size=6),
        st.sampled_from(["none", "report", "tail", "both"]),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(steps=steps, order=st.randoms(use_true_random=False), dup=st.booleans())
def test_outputs_and_reports_in_any_order_keep_the_index_exact_and_end_equal(steps, order, dup):
    replica = Replica()
    messages: list[object] = []
    for toggles, sent in steps:
        for block_hash, tier in toggles:
            replica.toggle(block_hash, tier)
        replica.end_step()
        if sent in ("report", "both"):
            messages.append(replica.log.report())
        if sent in ("tail", "both"):
            messages.append(replica.tail())
    if dup:
        messages += messages[: len(messages) // 2]  # both channels bring a batch twice, or more
    order.shuffle(messages)
    index = KVIndex()
    for message in messages:
        if isinstance(message, KVEventTail):
            index.apply_tail(message)
        else:
            assert isinstance(message, KVEventReport)
            index.apply("r", message)
        assert_exact(index, replica)
    replica.log.request_snapshot()  # whatever was missed, the next snapshot repairs it
    index.apply("r", replica.log.report())
    assert index.in_sync("r") and index.holdings("r") == replica.held


def test_tails_alone_keep_a_synced_index_exact_without_another_snapshot():
    replica, index = Replica(), KVIndex()
    index.apply("r", replica.log.report())  # the first report syncs it
    for i in range(40):
        replica.toggle(i % 7, TIERS[i % 3])
        replica.toggle(100 + i, DEVICE)  # still open when the tail is taken: closed by it
        tail = replica.tail()
        assert index.apply_tail(tail) and index.applied_seq("r") == tail.seq
        assert index.holdings("r") == replica.held
    assert index.num_snapshots == 1


def test_a_tail_past_a_gap_applies_what_follows_and_waits_without_going_out_of_sync():
    replica, index = Replica(), KVIndex()
    index.apply("r", replica.log.report())
    replica.toggle(1, DEVICE)
    replica.end_step()
    kept = replica.tail()  # batch 1
    replica.toggle(2, DEVICE)
    replica.end_step()
    replica.toggle(3, CPU)
    late = KVEventTail("r", replica.tail().batches[-1:], replica.log.seq)  # batch 3 only
    assert not index.apply_tail(late)  # batch 2 is missing: nothing applied
    assert index.in_sync("r") and index.applied_seq("r") == 0 and index.holdings("r") == {}
    assert index.apply_tail(kept) is True and index.holdings("r") == {1: DEVICE}
    index.apply("r", replica.log.report())  # the report brings batches 2 and 3
    assert index.in_sync("r") and index.holdings("r") == {1: DEVICE, 2: DEVICE, 3: CPU}


def test_a_replica_out_of_sync_by_a_gap_is_back_in_sync_with_the_next_tail():
    """Served, Serve hands a router only the latest report: one that missed more reports than
    the window repeats has a gap. The next output's tail (the newest batches, whatever the
    reports dropped) repairs it without waiting for a snapshot."""
    replica, index = Replica(), KVIndex()
    index.apply("r", replica.log.report())
    for i in range(4):  # reports this router never sees: the window (2 reports) drops batch 1
        replica.toggle(i, DEVICE)
        replica.end_step()
        replica.log.report()
    index.apply("r", replica.log.report())
    assert not index.in_sync("r")
    assert index.apply_tail(replica.tail()) and index.in_sync("r")
    assert index.holdings("r") == replica.held and index.num_snapshots == 1


def test_an_overflowed_batch_in_a_tail_waits_for_a_snapshot():
    replica, index = Replica(), KVIndex()
    index.apply("r", replica.log.report())
    replica.log.max_events_per_batch = 1
    replica.toggle(1, DEVICE)
    replica.toggle(2, DEVICE)  # past the cap: the batch goes empty, overflowed
    assert not index.apply_tail(replica.tail()) and not index.in_sync("r")
    replica.toggle(3, DEVICE)
    assert not index.apply_tail(replica.tail())  # batches cannot repair it
    index.apply("r", replica.log.report())  # the overflow asked for a snapshot
    assert index.in_sync("r") and index.holdings("r") == replica.held


def test_a_tail_is_ignored_for_a_replica_never_synced_or_forgotten():
    replica, index = Replica(), KVIndex()
    replica.toggle(5, DEVICE)
    assert not index.apply_tail(replica.tail())
    assert not index.in_sync("r") and index.replicas() == set()


def test_a_tail_holds_the_newest_batches_that_fit_its_budget():
    replica = Replica()
    for i in range(10):
        for j in range(3):
            replica.toggle(10 * i + j, DEVICE)
        replica.end_step()
    tail = replica.log.tail("r", max_events=7)
    assert [b.seq for b in tail.batches] == [9, 10] and tail.seq == 10
    assert replica.log.tail("r", max_events=0).batches == []


def test_the_fleet_marks_events_seen_only_when_a_tail_brings_it_up_to_date():
    replica, fleet = Replica(), FleetState(RoutingConfig())
    fleet.kv.apply("r", replica.log.report())
    replica.toggle(1, DEVICE)
    replica.end_step()
    replica.toggle(2, DEVICE)
    replica.end_step()
    fleet.on_kv_tail(KVEventTail("r", replica.log.tail("r").batches[1:], 2), now=5.0)
    assert "r" not in fleet.kv_seen_at  # a gap: routing's plants since the last report still count
    fleet.on_kv_tail(replica.log.tail("r"), now=6.0)
    assert fleet.kv_seen_at["r"] == 6.0 and fleet.kv.holdings("r") == {1: DEVICE, 2: DEVICE}


@pytest.mark.parametrize("bad", [2**64, -1, math.nan, 10**30, "1", None])
def test_tail_bounds_are_checked_naming_the_field(bad):
    with pytest.raises(ValueError, match="kv_events.seq"):
        KVEventTail("r", [], bad)
    with pytest.raises(ValueError, match="kv_events.batches"):
        KVEventTail("r", [KVEventBatch(bad, [])], 2**62)
    with pytest.raises(ValueError, match="max_events"):
        KVEventLog(lambda: ([], [], [])).tail("r", max_events=bad)


@pytest.mark.parametrize("replica", ["", "x" * 257, 7, None])
def test_tail_replica_names_are_bounded(replica):
    with pytest.raises(ValueError, match="kv_events.replica"):
        KVEventTail(replica, [], 0)


def test_tail_events_are_bounded_in_total_and_batches_must_increase():
    big = [(STORED, DEVICE, h) for h in range(MAX_OUTPUT_EVENTS)]
    KVEventTail("r", [KVEventBatch(1, big)], 1)  # exactly the budget
    with pytest.raises(ValueError, match="at most"):
        KVEventTail("r", [KVEventBatch(1, big), KVEventBatch(2, [], overflowed=True)], 2)
    with pytest.raises(ValueError, match="not increasing"):
        KVEventTail("r", [KVEventBatch(2, []), KVEventBatch(2, [])], 2)
    with pytest.raises(ValueError, match="not increasing"):
        KVEventTail("r", [KVEventBatch(3, [])], 2)  # past the tail's own number


def test_a_report_older_than_a_tail_applied_leaves_the_plants_since_that_tail_counting():
    """Serve delivers a report late, after the tail of a request that ended later: it brings
    nothing new, so what routing planted since the tail still counts."""
    replica, fleet = Replica(), FleetState(RoutingConfig())
    fleet.on_stats("r", stats_with(replica.log.report()), now=1.0)
    assert fleet.kv_seen_at["r"] == 1.0
    replica.toggle(1, DEVICE)
    late = replica.log.report()  # taken now, delivered after the tail below
    replica.toggle(2, DEVICE)
    fleet.on_kv_tail(replica.tail(), now=2.0)
    fleet.on_stats("r", stats_with(late), now=3.0)
    assert fleet.kv_seen_at["r"] == 2.0 and fleet.kv.holdings("r") == {1: DEVICE, 2: DEVICE}
    replica.toggle(3, DEVICE)
    fleet.on_stats("r", stats_with(replica.log.report()), now=4.0)  # news: it moves
    assert fleet.kv_seen_at["r"] == 4.0


def stats_with(report: KVEventReport) -> RoutingStats:
    return RoutingStats(SchedulerStats(0, 0, 0, 0.0, 0.0, 0), kv_events=report)
