"""The router's prefix index: leading runs, the per-replica and fleet bounds, removal, and
replicas' prefix reports applied by their change or as whole lists."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.prefix_index import PrefixIndex, _in_listed_order
from scheduler.block_manager import BlockPool, PrefixReport

A, B, C = "a", "b", "c"


def listing(hashes: list[int], report_id: int = 0) -> PrefixReport:
    """A report that names no base: the index compares it with the list before."""
    return PrefixReport(hashes, report_id)


def test_match_counts_only_the_leading_run():
    index = PrefixIndex(max_blocks=100)
    index.insert(A, [1, 2, 3], now=0)
    index.insert(B, [1, 9, 3], now=0)  # holds block 3's hash but not the run 1-2-3
    assert index.match([1, 2, 3, 4], [A, B, C]) == {A: 3, B: 1, C: 0}
    assert index.match([7, 1, 2], [A, B]) == {A: 0, B: 0}
    assert index.match([], [A]) == {A: 0}


def test_each_replica_keeps_its_own_lru_bound_and_evicts_tail_blocks_first():
    index = PrefixIndex(blocks_per_replica=3)
    index.insert(A, [1, 2, 3], now=0)
    index.insert(B, [7, 8], now=1)
    index.insert(A, [4, 5], now=2)  # A is at its bound: its oldest entries go, B keeps its own
    # Block 3, then 2, the tail of A's oldest prompt, go first: A keeps the leading block 1.
    assert index.blocks_of(A) == {1, 4, 5} and index.blocks_of(B) == {7, 8}
    assert index.match([1, 2, 3], [A]) == {A: 1}
    index.insert(A, [1], now=3)  # routing there again refreshes the block
    index.insert(A, [6], now=4)
    assert index.blocks_of(A) == {1, 4, 6}  # 5, the tail of [4, 5], was older
    index.set_bound(B, 1)  # a replica reporting fewer KV blocks is trimmed at once
    assert index.blocks_of(B) == {7} and index.num_entries == 4


def test_the_fleet_cap_trims_the_replica_with_the_most_entries():
    index = PrefixIndex(blocks_per_replica=10, max_blocks=4)
    index.insert(A, [1, 2, 3], now=0)
    index.insert(B, [7, 8], now=1)
    assert index.num_entries == 4 and index.blocks_of(A) == {1, 2}
    index.insert(C, [5], now=2)  # A and B hold two each: the name breaks the tie
    assert index.blocks_of(B) == {7} and index.blocks_of(A) == {1, 2}


def test_a_bound_below_one_is_refused():
    with pytest.raises(ValueError, match="bound"):
        PrefixIndex().set_bound(A, 0)


def test_the_footprint_counts_the_blocks_attributed_to_a_replica():
    index = PrefixIndex(max_blocks=100)
    index.insert(A, [1, 2, 3], now=0)
    index.insert(B, [1], now=0)
    assert (index.footprint(A), index.footprint(B), index.footprint(C)) == (3, 1, 0)
    index.sync_replica(A, listing([1]), now=10, grace_s=5)
    assert index.footprint(A) == 1


def test_removed_replica_leaves_no_trace_in_the_index():
    index = PrefixIndex(max_blocks=100)
    index.insert(A, [1, 2], now=0)
    index.insert(B, [1], now=0)
    index.remove_replica(A)
    assert index.replicas_of(1) == {B}
    assert index.replicas_of(2) == set()
    assert len(index) == 1
    assert index.match([1, 2], [A, B]) == {A: 0, B: 1}


def test_replica_prefix_report_corrects_the_index_after_evictions():
    index = PrefixIndex(max_blocks=100)
    index.insert(A, [1, 2], now=0)
    index.insert(A, [5], now=9)
    # At t=10 the replica reports blocks 1 and 4 resident: 2 was evicted, 4 arrived from another
    # router, 5 is younger than the grace window and may postdate the report, so it stays.
    index.sync_replica(A, listing([1, 4]), now=10, grace_s=5)
    assert index.blocks_of(A) == {1, 4, 5}
    assert index.replicas_of(2) == set()


def test_a_report_older_than_one_applied_changes_nothing():
    """Serve hands a router reports late: report 1, delivered after report 2, would list again the
    block the replica evicted between them."""
    index = PrefixIndex(max_blocks=100)
    index.sync_replica(A, PrefixReport([1, 2], 1), now=10, grace_s=5)
    index.sync_replica(A, PrefixReport([1], 2), now=20, grace_s=5)
    assert index.blocks_of(A) == {1}
    index.sync_replica(A, PrefixReport([1, 2], 1), now=21, grace_s=5)
    assert index.blocks_of(A) == {1}
    index.sync_replica(A, PrefixReport([1, 3], 3), now=22, grace_s=5)  # news still counts
    assert index.blocks_of(A) == {1, 3}


def test_a_report_whose_change_does_not_add_up_is_applied_as_a_whole_list():
    index = PrefixIndex(max_blocks=100)
    index.sync_replica(A, PrefixReport([1, 2, 3], 1), now=0, grace_s=5)
    # Claims 9 is new and 1 gone, but the list says otherwise: the list wins.
    index.sync_replica(A, PrefixReport([1, 2, 3, 4], 2, 1, [9], [1]), now=1, grace_s=5)
    assert index.blocks_of(A) == {1, 2, 3, 4}
    index.sync_replica(A, PrefixReport([2, 3, 4, 5], 3, 2, [5], [1]), now=2, grace_s=5)
    assert index.blocks_of(A) == {2, 3, 4, 5}
    # Its base is not the report applied last (report 4 never came): the lists are compared.
    index.sync_replica(A, PrefixReport([3, 4, 5, 6], 5, 4, [6], [2]), now=3, grace_s=5)
    assert index.blocks_of(A) == {3, 4, 5, 6}


# ---------------------------------------------------------------- properties

hashes = st.lists(st.integers(0, 30), max_size=8)


@settings(max_examples=200, deadline=None)
@given(
    bounds=st.tuples(st.integers(1, 12), st.integers(1, 12), st.integers(1, 12)),
    cap=st.one_of(st.none(), st.integers(1, 30)),
    ops=st.lists(
        st.one_of(
            st.tuples(st.sampled_from([A, B, C]), hashes),
            st.tuples(st.sampled_from([A, B, C]), st.integers(1, 12)),  # a new bound
        ),
        max_size=40,
    ),
)
def test_no_replica_exceeds_its_bound_and_the_index_is_at_most_their_sum(bounds, cap, ops):
    index = PrefixIndex(blocks_per_replica=5, max_blocks=cap)
    bound = dict(zip((A, B, C), bounds))
    for replica, b in bound.items():
        index.set_bound(replica, b)
    for t, (replica, arg) in enumerate(ops):
        if isinstance(arg, int):
            bound[replica] = arg
            index.set_bound(replica, arg)
        else:
            index.insert(replica, arg, now=t)
        for r in (A, B, C):
            assert index.footprint(r) <= bound[r] == index.bound(r)
        assert index.num_entries == sum(index.footprint(r) for r in (A, B, C))
        assert len(index) <= index.num_entries <= min(sum(bound.values()), cap or 10**9)
    for replica in (A, B, C):
        assert index.footprint(replica) == len(index.blocks_of(replica))
        for h in index.blocks_of(replica):
            assert replica in index.replicas_of(h)
    for h in range(31):
        for replica in index.replicas_of(h):
            assert h in index.blocks_of(replica)


index_ops = st.lists(
    st.one_of(
        st.tuples(st.just("plant"), st.sampled_from([A, B]), hashes),
        st.tuples(st.just("report"), st.sampled_from([A, B]), hashes),
        st.tuples(st.just("remove"), st.sampled_from([A, B]), st.just([])),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops=index_ops, grace=st.integers(0, 6))
def test_reports_apply_as_differences_yet_give_what_a_full_rebuild_would(ops, grace):
    """Unbounded index: after a report, a replica holds exactly the listed blocks plus those routing
    planted there within the grace window; between reports, plants add to that."""
    index = PrefixIndex(max_blocks=10_000)
    held: dict[str, set[int]] = {A: set(), B: set()}
    planted_at: dict[tuple[str, int], int] = {}
    for now, (kind, replica, blocks) in enumerate(ops):
        if kind == "plant":
            index.insert(replica, blocks, now=now)
            held[replica] |= set(blocks)
            planted_at.update({(replica, h): now for h in blocks})
        elif kind == "report":
            index.sync_replica(replica, listing(blocks), now, grace)
            young = {
                h for h in held[replica] if planted_at.get((replica, h), -(10**9)) >= now - grace
            }
            held[replica] = set(blocks) | young
        else:
            index.remove_replica(replica)
            held[replica] = set()
            planted_at = {k: v for k, v in planted_at.items() if k[0] != replica}
        for r in (A, B):
            assert index.blocks_of(r) == held[r]
            for h in held[r]:
                assert r in index.replicas_of(h)


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    num_ops=st.integers(1, 150),
    grace=st.integers(0, 6),
    bound=st.sampled_from([10, 10_000]),
)
def test_reports_applied_by_their_change_leave_the_index_a_whole_list_would(
    seed, num_ops, grace, bound
):
    """An index applying each report's own account of its change ends exactly where one comparing
    whole lists ends (owners, LRU order, unreported plants), also when it missed a report (it then
    compares lists), when a list was cut at the limit, and with each replica at its bound."""
    rng = random.Random(seed)  # a seeded stream of operations: hypothesis favours short, empty ones
    pools = {A: BlockPool(12), B: BlockPool(12)}
    held: dict[str, list[int]] = {A: [], B: []}
    by_change, by_list = PrefixIndex(bound), PrefixIndex(bound)
    for now in range(num_ops):
        replica = rng.choice([A, B])
        pool = pools[replica]
        kind = rng.choice(["fill", "fill", "free", "plant", "report", "report", "skip", "cut"])
        if kind == "fill":
            blocks = pool.allocate(min(rng.randint(1, 4), pool.num_free))
            # Hashes collide: some are cached already, some come back after eviction.
            h = rng.randrange(40)
            for i, block in enumerate(blocks):
                pool.register(block, h + i)
            held[replica] += blocks
        elif kind == "free":
            n = rng.randint(0, len(held[replica]))
            pool.release(held[replica][:n])
            del held[replica][:n]
        elif kind == "plant":
            h = rng.randrange(40)
            planted = list(range(h, h + rng.randint(0, 4)))
            for index in (by_change, by_list):
                index.insert(replica, planted, now)
        else:  # "skip": a report this router never saw; "cut": a list cut at the limit
            report = pool.prefix_report(6 if kind == "cut" else 12)
            if kind != "skip":
                by_change.sync_replica(replica, report, now, grace)
                by_list.sync_replica(replica, listing(report.hashes, report.report_id), now, grace)
        a, b = by_change, by_list
        assert list(a._owners.items()) == list(b._owners.items())
        assert (
            a._by_replica == b._by_replica
            and a._unreported == b._unreported
            and a._reported == b._reported
        )


@settings(max_examples=300, deadline=None)
@given(listed=st.lists(st.integers(0, 10**6), unique=True, max_size=300), data=st.data())
def test_newly_listed_blocks_keep_the_report_order_wherever_they_sit(listed, data):
    """The tail search gives what a filter of the whole report gives, for any positions of the
    wanted."""
    wanted = set(
        data.draw(st.lists(st.sampled_from(listed), max_size=40) if listed else st.just([]))
    )
    assert _in_listed_order(listed, wanted) == [h for h in listed if h in wanted]
