"""The router's exact KV index (router/kv_events.py) from a replica's KV event log
(scheduler/kv_events.py): sequence numbers, snapshots, loss, reordering, overflow and bounds."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.kv_events import KVIndex, TierRun
from router.stats import RoutingStats
from scheduler.kv_events import (
    CPU,
    DEVICE,
    DISK,
    REMOVED,
    STORED,
    KVEventBatch,
    KVEventLog,
    KVEventReport,
    KVSnapshot,
)
from tests.router.scaffold import report


class Replica:
    """A replica's tiers as a plain dict (hash -> tier bits) feeding a real KVEventLog, with the
    truth after every batch kept for the checks."""

    def __init__(self, **log_kwargs: int) -> None:
        self.held: dict[int, int] = {}
        self.log = KVEventLog(self.snapshot, **log_kwargs)
        self.truth: dict[int, dict[int, int]] = {0: {}}

    def snapshot(self) -> tuple[list[int], list[int], list[int]]:
        return tuple([h for h, b in self.held.items() if b & t] for t in (DEVICE, CPU, DISK))  # type: ignore[return-value]

    def change(self, kind: int, tier: int, h: int) -> None:
        bits = self.held.get(h, 0)
        new = bits | tier if kind == STORED else bits & ~tier
        if new == bits:
            return  # the pool and the tiers record only real changes
        if new:
            self.held[h] = new
        else:
            del self.held[h]
        self.log.record(kind, tier, h)

    def end_step(self) -> None:
        self.log.end_step()
        self.truth[self.log.seq] = dict(self.held)

    def report(self) -> KVEventReport:
        r = self.log.report()
        self.truth[self.log.seq] = dict(self.held)
        return r


def through_serve(r: KVEventReport) -> KVEventReport:
    """The report as a router receives it: inside RoutingStats, through its dict."""
    sent = RoutingStats(report().scheduler, kv_events=r).to_dict()
    parsed = RoutingStats.from_dict(sent).kv_events
    assert parsed is not None
    return parsed


def test_a_snapshot_then_batches_give_the_replicas_holdings_by_tier():
    replica, index = Replica(), KVIndex()
    for h in (1, 2, 3):
        replica.change(STORED, DEVICE, h)
    index.apply("a", through_serve(replica.report()))  # the first report carries a snapshot
    assert index.in_sync("a") and index.holdings("a") == {1: DEVICE, 2: DEVICE, 3: DEVICE}
    replica.change(REMOVED, DEVICE, 3)
    replica.change(STORED, CPU, 3)  # saved to the CPU tier as the device pool evicts it
    replica.end_step()
    replica.change(REMOVED, CPU, 3)
    replica.change(STORED, DISK, 3)  # demoted
    replica.change(STORED, DEVICE, 4)
    index.apply("a", through_serve(replica.report()))
    assert index.holdings("a") == {1: DEVICE, 2: DEVICE, 3: DISK, 4: DEVICE}
    assert index.applied_seq("a") == replica.log.seq == 3


def test_a_prompts_run_is_its_device_run_then_its_lower_tiers_run():
    index = KVIndex()
    index.apply("a", KVEventReport([], KVSnapshot(0, [1, 2, 5], [3], [4])))
    index.apply("b", KVEventReport([], KVSnapshot(0, [1], [2, 3], [])))
    runs = index.match([1, 2, 3, 4, 5], ["a", "b", "c"])
    # a: 1, 2 on the device; 3 in CPU, 4 on disk; 5 is on the device, but the scheduler's tier
    # lookup past the device run reads only the lower tiers, so the run stops there.
    assert runs == {"a": TierRun(2, 1, 1), "b": TierRun(1, 2, 0), "c": TierRun()}
    assert runs["a"].capped(3) == TierRun(2, 1, 0)
    assert index.longest_holder([1, 2, 3, 4, 5]) == ("a", TierRun(2, 1, 1))
    assert index.longest_holder([9]) is None


def test_a_block_in_the_device_pool_and_the_cpu_tier_counts_on_the_device_first():
    index = KVIndex()
    index.apply("a", KVEventReport([], KVSnapshot(0, [1, 2], [2, 3], [3])))
    assert index.match([1, 2, 3], ["a"])["a"] == TierRun(2, 1, 0)  # 3 read from CPU, not disk


def test_a_lost_batch_puts_the_replica_out_of_sync_until_a_snapshot():
    replica, index = Replica(snapshot_every=3, max_window_events=1), KVIndex()
    index.apply("a", replica.report())  # report 1: snapshot
    replica.change(STORED, DEVICE, 7)
    replica.report()  # report 2: lost, and its batch leaves the window with the next one
    replica.change(STORED, DEVICE, 8)
    index.apply("a", replica.report())  # report 3: snapshot due (every 3rd)
    assert index.in_sync("a") and index.holdings("a") == {7: DEVICE, 8: DEVICE}


def test_a_gap_without_a_snapshot_leaves_the_entries_marked_stale():
    replica, index = Replica(snapshot_every=100, max_window_events=1), KVIndex()
    index.apply("a", replica.report())
    replica.change(STORED, DEVICE, 7)
    replica.end_step()  # batch 1, which the window drops when batch 2 closes
    replica.change(STORED, DEVICE, 8)
    index.apply("a", replica.report())
    assert not index.in_sync("a")
    assert index.holdings("a") == {}  # nothing guessed


def test_an_overflowed_batch_is_repaired_by_the_next_report():
    replica, index = Replica(max_events_per_batch=2, snapshot_every=100), KVIndex()
    index.apply("a", replica.report())
    for h in range(5):
        replica.change(STORED, DEVICE, h)
    r = replica.report()
    assert r.batches[-1].overflowed and r.batches[-1].events == []
    assert r.snapshot is not None  # an overflow makes the next snapshot due at once
    index.apply("a", r)
    assert index.in_sync("a") and index.holdings("a") == dict.fromkeys(range(5), DEVICE)
    index.apply("a", KVEventReport([KVEventBatch(r.batches[-1].seq, [], True)]))  # resent: seen
    assert index.in_sync("a")
    index.apply("a", KVEventReport([KVEventBatch(r.batches[-1].seq + 1, [], True)]))
    assert not index.in_sync("a")


def test_the_entries_of_a_replica_are_bounded():
    index = KVIndex(max_entries_per_replica=3)
    index.apply("a", KVEventReport([], KVSnapshot(0, [1, 2, 3, 4])))
    assert not index.in_sync("a") and index.num_entries == 0
    index.apply("b", KVEventReport([], KVSnapshot(0, [1, 2])))
    index.apply("b", KVEventReport([KVEventBatch(1, [(STORED, CPU, 1), (STORED, DEVICE, 3)])]))
    assert index.in_sync("b") and index.num_entries == 3
    index.apply("b", KVEventReport([KVEventBatch(2, [(STORED, DEVICE, 4)])]))
    assert not index.in_sync("b") and index.num_entries == 3


def test_a_report_repeats_the_batches_of_the_reports_before_it_within_the_window():
    replica = Replica(window_reports=2, snapshot_every=100)
    seqs = []
    for h in range(4):
        replica.change(STORED, DEVICE, h)
        seqs.append([b.seq for b in replica.report().batches])
    assert seqs == [[1], [1, 2], [2, 3], [3, 4]]
    index = KVIndex()
    index.apply("a", KVEventReport([], KVSnapshot(1, [0])))
    index.apply("a", replica.report())  # missed reports 3 and 4: batch 2 is gone, out of sync
    assert not index.in_sync("a")
    index.apply("b", KVEventReport([], KVSnapshot(2, [0, 1])))  # saw report 2: catches up
    index.apply("b", KVEventReport([KVEventBatch(3, [(STORED, DEVICE, 2)])]))
    assert index.in_sync("b") and index.holdings("b") == dict.fromkeys([0, 1, 2], DEVICE)


def test_removing_a_replica_forgets_its_entries():
    index = KVIndex()
    index.apply("a", KVEventReport([], KVSnapshot(0, [1, 2])))
    index.apply("b", KVEventReport([], KVSnapshot(0, [2])))
    index.remove_replica("a")
    assert index.replicas() == {"b"} and index.match([2], ["a", "b"])["b"] == TierRun(1)
    assert index.longest_holder([1]) is None


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("change"),
            st.sampled_from([STORED, REMOVED]),
            st.sampled_from([DEVICE, CPU, DISK]),
            st.integers(0, 12),
        ),
        st.tuples(st.just("step")),
        st.tuples(st.just("report")),
    ),
    max_size=80,
)


@given(
    ops,
    st.lists(st.sampled_from(["deliver", "lose", "hold", "late"]), min_size=80, max_size=80),
    st.integers(1, 4),
    st.integers(1, 6),
    st.integers(2, 40),
    st.integers(1, 4),
)
def test_under_loss_and_reordering_the_index_is_never_wrong_and_a_snapshot_repairs_it(
    script, fates, snapshot_every, per_batch, window, window_reports
):
    """Whatever reports are lost, held back or delivered out of order: while the index says a
    replica is in sync, its entries are exactly the replica's holdings as of the batch it applied
    last; and one report carrying a snapshot, delivered after all of them, brings it back to
    the replica's present."""
    replica = Replica(
        snapshot_every=snapshot_every,
        max_events_per_batch=per_batch,
        max_window_events=window,
        window_reports=window_reports,
    )
    index, held_back = KVIndex(), []
    for op, fate in zip(script, fates):
        if op[0] == "change":
            replica.change(*op[1:])
        elif op[0] == "step":
            replica.end_step()
        else:
            r = replica.report()
            if fate == "deliver":
                index.apply("a", through_serve(r))
            elif fate in ("hold", "late"):
                held_back.append(r)
            if fate == "late" and held_back:
                index.apply("a", held_back.pop(0))  # an older report arrives after newer ones
        check_never_wrong(index, replica)
    for r in held_back:
        index.apply("a", r)
        check_never_wrong(index, replica)
    replica.log.request_snapshot()  # as the next periodic snapshot would
    index.apply("a", replica.report())
    assert index.in_sync("a") and index.holdings("a") == replica.held


def check_never_wrong(index: KVIndex, replica: Replica) -> None:
    if index.in_sync("a"):
        seq = index.applied_seq("a")
        assert seq is not None and index.holdings("a") == replica.truth[seq]


@pytest.mark.parametrize("bad", [2**64, -1, math.nan, 10**30, "8", True])
def test_the_logs_and_the_indexs_bounds_refuse_bad_values(bad):
    for name in ("max_events_per_batch", "max_window_events", "snapshot_every", "window_reports"):
        with pytest.raises(ValueError, match=f"^{name}"):
            KVEventLog(lambda: ([], [], []), **{name: bad})
    with pytest.raises(ValueError, match="^max_entries_per_replica"):
        KVIndex(bad)


def sent(**fields) -> dict:
    return {**RoutingStats(report().scheduler).to_dict(), "kv_seq": 0, **fields}


@pytest.mark.parametrize(
    "fields",
    [
        {"kv_batches": "x"},
        {"kv_batches": [[1, False, [1], [2, 3]]]},  # codes and hashes differ in length
        {"kv_batches": [[1, False, [3], [2]]]},  # 3 = STORED in tiers 1|2: not one tier
        {"kv_batches": [[1, False, [17], [2]]]},  # kind 2
        {"kv_batches": [[1, False, [1], [2**128]]]},
        {"kv_batches": [[1, False, [1], [-1]]]},
        {"kv_batches": [[1, False, [1], [math.nan]]]},
        {"kv_batches": [[1, False, [math.nan], [1]]]},
        {"kv_batches": [[2**64, False, [], []]]},
        {"kv_batches": [[0, False, [], []]]},
        {"kv_batches": [[-1, False, [], []]]},
        {"kv_batches": [[1, 0, [], []]]},
        {"kv_batches": [[1, False, [1] * (8192 + 1), [1] * (8192 + 1)]]},
        {"kv_batches": [[i + 1, False, [], []] for i in range(32770)]},
        {"kv_batches": [], "kv_snapshot": [2**64, [], [], []]},
        {"kv_batches": [], "kv_snapshot": [-1, [], [], []]},
        {"kv_batches": [], "kv_snapshot": [0, [math.nan], [], []]},
        {"kv_batches": [], "kv_snapshot": [0, [], []]},
        {"kv_batches": [], "kv_snapshot": [0, list(range((1 << 22) + 1)), [], []]},
        {"kv_batches": [], "kv_seq": 2**64},
        {"kv_batches": [], "kv_seq": 2**63},
        {"kv_batches": [], "kv_seq": -1},
        {"kv_batches": [], "kv_seq": math.nan},
        {"kv_batches": [], "kv_seq": None},
    ],
)
def test_a_malformed_kv_event_report_is_refused_naming_its_field(fields):
    with pytest.raises(ValueError, match="^routing stats field 'kv_"):
        RoutingStats.from_dict(sent(**fields))
