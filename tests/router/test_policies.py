"""Fleet routing policies, without Ray: load beats affinity past the threshold, longest prefix wins
otherwise, the prefix index stays within its LRU bound, and dead replicas are forgotten."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.config import RoutingConfig
from router.fleet import FleetState
from router.loads import LoadTracker
from router.policies import LeastLoaded, PowerOfTwo, PrefixAffinity, RouteRequest
from router.prefix_index import PrefixIndex, ReportChange, _in_listed_order

A, B, C = "a", "b", "c"


def fleet(**kw) -> FleetState:
    return FleetState(RoutingConfig(**kw))


_ids = itertools.count()


def busy(state: FleetState, replica: str, n: int, now: float = 0.0) -> None:
    """Charge replica with n more confirmed requests that carry no prefix."""
    for _ in range(n):
        state.on_routed(RouteRequest(f"busy-{next(_ids)}"), replica, now)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "field,value",
    [
        ("router_policy", "random"),
        ("imbalance_threshold", -1),
        ("imbalance_ratio", 0.5),
        ("min_match_blocks", 0),
        ("max_index_blocks", 0),
        ("tokens_per_request", 0),
        ("kv_usage_weight", -0.5),
        ("stats_grace_s", -1),
        ("unconfirmed_ttl_s", 0),
    ],
)
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        RoutingConfig(**{field: value})


def test_router_kwargs_map_one_to_one_and_unknown_keys_are_named():
    config = RoutingConfig.from_router_kwargs(
        {"router_policy": "least_loaded", "imbalance_threshold": 2}
    )
    assert (config.router_policy, config.imbalance_threshold) == ("least_loaded", 2)
    assert RoutingConfig.from_router_kwargs(None) == RoutingConfig()
    with pytest.raises(ValueError, match="router_kwargs.imbalance"):
        RoutingConfig.from_router_kwargs({"imbalance": 2})


# ---------------------------------------------------------------- load


def test_load_counts_own_inflight_requests_and_tokens():
    loads = LoadTracker(tokens_per_request=1000, kv_usage_weight=1.0, unconfirmed_ttl_s=30)
    loads.start("r1", A, num_tokens=500, now=0, confirmed=True)
    loads.start("r2", A, num_tokens=1500, now=0, confirmed=True)
    assert loads.get(A).inflight_requests == 2
    assert loads.load(A) == pytest.approx(2 + 2.0)
    loads.finish("r1")
    assert loads.load(A) == pytest.approx(1 + 1.5)
    loads.finish("r1")  # completing twice (rejected, then completed) is harmless
    assert loads.get(A).inflight_requests == 1


def test_load_takes_the_larger_of_own_counts_and_the_late_report():
    loads = LoadTracker(tokens_per_request=10**9, kv_usage_weight=0.0, unconfirmed_ttl_s=30)
    loads.start("r1", A, 0, now=0, confirmed=True)
    loads.report(A, {"num_waiting": 3, "num_running": 4, "kv_cache_usage": 0.5})
    assert loads.load(A) == 7  # other routers' traffic shows up only in the report
    for i in range(9):
        loads.start(f"x{i}", A, 0, now=0, confirmed=True)
    assert loads.load(A) == 10  # the report is stale: own in-flight count is larger


def test_load_adds_kv_cache_usage_and_rejects_non_numeric_stats():
    loads = LoadTracker(tokens_per_request=1000, kv_usage_weight=2.0, unconfirmed_ttl_s=30)
    loads.report(A, {"num_waiting": 0, "num_running": 1, "kv_cache_usage": 0.25})
    assert loads.load(A) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="num_running"):
        loads.report(A, {"num_running": "many"})


def test_moving_a_request_recharges_the_new_replica():
    loads = LoadTracker(1000, 0.0, 30)
    loads.start("r1", A, 100, now=0, confirmed=False)
    loads.start("r1", B, 100, now=0, confirmed=True)
    assert (loads.get(A).inflight_requests, loads.get(B).inflight_requests) == (0, 1)
    assert loads.get(A).inflight_tokens == 0


def test_unconfirmed_decisions_expire_confirmed_ones_do_not():
    loads = LoadTracker(1000, 0.0, unconfirmed_ttl_s=10)
    loads.start("cancelled", A, 0, now=0, confirmed=False)
    loads.start("running", A, 0, now=0, confirmed=True)
    loads.expire(now=5)
    assert loads.get(A).inflight_requests == 2
    loads.expire(now=11)
    assert loads.get(A).inflight_requests == 1
    assert loads.num_inflight() == 1


# ---------------------------------------------------------------- prefix index


def test_match_counts_only_the_leading_run():
    index = PrefixIndex(max_blocks=100)
    index.insert(A, [1, 2, 3], now=0)
    index.insert(B, [1, 9, 3], now=0)  # holds block 3's hash but not the run 1-2-3
    assert index.match([1, 2, 3, 4], [A, B, C]) == {A: 3, B: 1, C: 0}
    assert index.match([7, 1, 2], [A, B]) == {A: 0, B: 0}
    assert index.match([], [A]) == {A: 0}


def test_lru_bound_evicts_least_recently_used_blocks_and_tail_blocks_first():
    index = PrefixIndex(max_blocks=4)
    index.insert(A, [1, 2, 3], now=0)
    index.insert(B, [7, 8], now=1)
    assert len(index) == 4
    # Block 3, the tail of the oldest prompt, goes first: A keeps its leading run 1-2.
    assert index.match([1, 2, 3], [A]) == {A: 2}
    assert index.blocks_of(A) == {1, 2}
    index.match([1, 2], [A])  # a match is a use
    index.insert(C, [5], now=2)
    assert index.replicas_of(8) == set() and index.replicas_of(7) == {B}
    assert index.replicas_of(1) == {A}


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
    index.sync_replica(A, [1, 4], now=10, grace_s=5)
    assert index.blocks_of(A) == {1, 4, 5}
    assert index.replicas_of(2) == set()


# ---------------------------------------------------------------- policies


def test_round_robin_cycles_blind_to_load():
    state = fleet(router_policy="round_robin")
    busy(state, A, 10)
    firsts = [state.route(RouteRequest(f"r{i}"), [A, B, C], now=0)[0] for i in range(6)]
    assert firsts == [A, B, C, A, B, C]


def test_least_loaded_prefers_the_idle_replica_and_rotates_ties():
    state = fleet(router_policy="least_loaded")
    busy(state, A, 2)
    ranking = LeastLoaded().rank([A, B, C], RouteRequest("q"), state)
    assert ranking[-1] == A
    policy = LeastLoaded()
    firsts = {policy.rank([B, C], RouteRequest(f"q{i}"), state)[0] for i in range(2)}
    assert firsts == {B, C}


def test_power_of_two_picks_the_less_loaded_of_its_pair():
    state = fleet(router_policy="power_of_two", seed=3)
    busy(state, A, 5)
    policy = PowerOfTwo(seed=3)
    for i in range(20):
        pair = policy.rank([A, B], RouteRequest(f"q{i}"), state)
        assert pair == [B, A]
    assert len(policy.rank([A, B, C], RouteRequest("q"), state)) == 2


def test_longest_prefix_run_wins_when_load_is_balanced():
    state = fleet(imbalance_threshold=4)
    state.index.insert(A, [1, 2], now=0)
    state.index.insert(B, [1, 2, 3], now=0)
    busy(state, B, 2)  # within the threshold of idle A and C
    assert state.route(RouteRequest("q", 10, [1, 2, 3, 4]), [A, B, C], now=0)[0] == B


def test_load_imbalance_beats_affinity_past_the_threshold():
    policy = PrefixAffinity(imbalance_threshold=3, min_match_blocks=1)
    state = fleet()
    state.index.insert(A, [1, 2, 3], now=0)
    busy(state, A, 3)
    assert (
        policy.rank([A, B], RouteRequest("q", 0, [1, 2, 3]), state)[0] == A
    )  # exactly at threshold
    busy(state, A, 4)
    assert policy.rank([A, B], RouteRequest("q", 0, [1, 2, 3]), state) == [B, A]


def test_under_heavy_load_a_relative_skew_keeps_affinity():
    policy = PrefixAffinity(imbalance_threshold=3, min_match_blocks=1, imbalance_ratio=1.5)
    state = fleet()
    state.index.insert(A, [1, 2, 3], now=0)
    busy(state, B, 20)
    busy(state, A, 29)  # 9 ahead, but within 1.5x of 20
    assert policy.rank([A, B], RouteRequest("q", 0, [1, 2, 3]), state)[0] == A
    busy(state, A, 2)  # 31 > max(20 + 3, 30)
    assert policy.rank([A, B], RouteRequest("q", 0, [1, 2, 3]), state)[0] == B


def test_an_overloaded_longest_holder_yields_to_a_shorter_run_before_no_run():
    policy = PrefixAffinity(imbalance_threshold=2, min_match_blocks=1)
    state = fleet()
    state.index.insert(A, [1, 2, 3], now=0)
    state.index.insert(B, [1], now=0)
    busy(state, A, 6)
    busy(state, B, 1)
    assert policy.rank([A, B, C], RouteRequest("q", 0, [1, 2, 3]), state)[0] == B


def test_request_without_block_hashes_is_routed_by_load():
    state = fleet()
    state.index.insert(A, [1], now=0)
    busy(state, A, 1)
    assert state.route(RouteRequest("q", 10, []), [A, B], now=0)[0] == B


def test_a_new_prefix_goes_to_the_replica_holding_the_fewest_blocks_within_the_threshold():
    policy = PrefixAffinity(imbalance_threshold=2, min_match_blocks=1)
    state = fleet()
    state.index.insert(A, [1, 2, 3], now=0)
    state.index.insert(B, [4], now=0)
    busy(state, C, 1)
    assert policy.rank([A, B, C], RouteRequest("q", 0, [9, 9]), state)[0] == C
    busy(state, C, 2)  # now 3 ahead of the idle replicas: past the threshold
    assert policy.rank([A, B, C], RouteRequest("q", 0, [9, 9]), state)[0] == B


def test_short_match_below_min_match_blocks_is_ignored():
    policy = PrefixAffinity(imbalance_threshold=4, min_match_blocks=2)
    state = fleet()
    state.index.insert(A, [1], now=0)
    busy(state, A, 1)
    assert policy.rank([A, B], RouteRequest("q", 0, [1, 2]), state)[0] == B


# ---------------------------------------------------------------- fleet state


def test_a_burst_sharing_a_prefix_stays_together_until_the_threshold_then_spills():
    state = fleet(imbalance_threshold=2)
    prefix = [11, 12, 13]
    firsts = [state.route(RouteRequest(f"r{i}", 0, prefix), [A, B], now=0)[0] for i in range(6)]
    # Charged at decision time, so the burst sees its own earlier members before any confirmation:
    # the holder takes requests until it is 2 ahead of the idle replica (3 vs 0), then it spills.
    assert firsts[:3] == [firsts[0]] * 3
    assert firsts[3] != firsts[0]
    # Both replicas now hold the prefix: the next one goes to the less loaded of the two.
    assert state.index.replicas_of(11) == {A, B}


def test_confirmation_moves_the_charge_and_completion_releases_it():
    state = fleet()
    first = state.route(RouteRequest("r1", 64, [1]), [A, B], now=0)[0]
    other = B if first == A else A
    state.on_routed(RouteRequest("r1", 64, [1]), other, now=0)  # Serve found `first` full
    assert state.loads.get(first).inflight_requests == 0
    assert state.loads.get(other).inflight_requests == 1
    assert other in state.index.replicas_of(1)
    state.on_completed("r1")
    assert state.loads.get(other).inflight_requests == 0
    assert state.routed == {other: 1}


def test_stats_are_applied_once_per_distinct_report():
    state = fleet(stats_grace_s=1)
    state.index.insert(A, [1, 2], now=0)
    report = {"num_waiting": 1, "num_running": 2, "kv_cache_usage": 0.0, "prefix_hashes": [1]}
    state.on_stats(A, report, now=10)
    assert state.loads.get(A).reported_requests == 3
    assert state.index.blocks_of(A) == {1}
    state.index.insert(A, [2], now=20)
    state.on_stats(A, dict(report), now=30)  # the same report re-broadcast: no new information
    assert state.index.blocks_of(A) == {1, 2}


def test_dead_replica_is_forgotten_and_never_chosen():
    state = fleet()
    state.route(RouteRequest("r1", 10, [1, 2]), [A, B], now=0)
    state.on_routed(RouteRequest("r1", 10, [1, 2]), A, now=0)
    state.on_stats(A, {"num_waiting": 0, "num_running": 1, "kv_cache_usage": 0.1}, now=0)
    assert state.remove_replica(A) is True
    assert state.remove_replica(A) is False  # Serve reports a death once per failed request
    assert A not in state.loads.replicas() and A not in state.index.replicas()
    assert state.index.replicas_of(1) == set()
    assert state.route(RouteRequest("r2", 10, [1, 2]), [B], now=1) == [B]
    state.on_completed("r1")  # a late completion for the dead replica is harmless
    assert state.loads.get(A).inflight_requests == 0


def test_retain_drops_replicas_no_longer_in_the_deployment():
    state = fleet()
    state.on_routed(RouteRequest("r1", 10, [1]), A, now=0)
    state.on_routed(RouteRequest("r2", 10, [2]), B, now=0)
    state.retain([B])
    assert state.index.replicas() == {B}
    assert state.loads.replicas() == {B}


def test_no_replicas_no_ranking():
    assert fleet().route(RouteRequest("r"), [], now=0) == []


# ---------------------------------------------------------------- properties

hashes = st.lists(st.integers(0, 30), max_size=8)


@settings(max_examples=200, deadline=None)
@given(
    bound=st.integers(1, 12),
    inserts=st.lists(st.tuples(st.sampled_from([A, B, C]), hashes), max_size=40),
)
def test_index_never_exceeds_its_bound_and_both_directions_agree(bound, inserts):
    index = PrefixIndex(bound)
    for t, (replica, blocks) in enumerate(inserts):
        index.insert(replica, blocks, now=t)
        assert len(index) <= bound
    for replica in (A, B, C):
        for h in index.blocks_of(replica):
            assert replica in index.replicas_of(h)
    for h in range(31):
        for replica in index.replicas_of(h):
            assert h in index.blocks_of(replica)


class _EveryInsertApplied(PrefixIndex):
    """The reference: an insert that repeats the last one is applied all the same."""

    def insert(self, replica, block_hashes, now):
        self._add(replica, list(block_hashes), now)


def _index_state(index: PrefixIndex) -> tuple:
    """Everything a later pick, insert or report reads: owners in LRU order and the per-replica
    sets."""
    return (list(index._owners.items()), index._by_replica, index._reported, index._unreported)


@settings(max_examples=300, deadline=None)
@given(
    bound=st.integers(1, 12),
    grace=st.integers(0, 3),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["plant", "again", "again later", "match", "report", "remove"]),
            st.sampled_from([A, B]),
            st.lists(st.integers(0, 8), max_size=6),
        ),
        max_size=40,
    ),
)  # few distinct blocks: ops overlap
def test_an_insert_repeating_the_last_with_nothing_between_is_skipped_without_changing_the_index(
    bound, grace, ops
):
    """A router charges a request at its pick and again at its confirmation; in a simulator both
    come
    at one instant, and the second insert is skipped. The index must end as if it had been
    applied."""
    index, reference = PrefixIndex(bound), _EveryInsertApplied(bound)
    last = (A, [], 0.0)
    for t, (kind, replica, blocks) in enumerate(ops):
        for ix in (index, reference):
            if kind == "plant":
                ix.insert(replica, blocks, now=t)
            elif kind == "again":  # the confirmation of the last plant, at its instant
                ix.insert(*last)
            elif kind == "again later":
                ix.insert(last[0], last[1], now=t)
            elif kind == "match":
                ix.match(blocks, [A, B])  # a use that reorders the LRU between the two inserts
            elif kind == "report":
                ix.sync_replica(replica, blocks, now=t, grace_s=grace)
            else:
                ix.remove_replica(replica)
        if kind == "plant":
            last = (replica, blocks, t)
        assert _index_state(index) == _index_state(reference)


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
            index.sync_replica(replica, blocks, now=now, grace_s=grace)
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


@settings(max_examples=300, deadline=None)
@given(listed=st.lists(st.integers(0, 10**6), unique=True, max_size=300), data=st.data())
def test_newly_listed_blocks_keep_the_report_order_wherever_they_sit(listed, data):
    """The tail search gives what a filter of the whole report gives, for any positions of the
    wanted."""
    wanted = set(
        data.draw(st.lists(st.sampled_from(listed), max_size=40) if listed else st.just([]))
    )
    assert _in_listed_order(listed, wanted) == [h for h in listed if h in wanted]


def test_the_candidate_loads_follow_every_change_of_a_replica_load():
    """loads_of keeps the list it returned for the same candidates current, removals included."""
    state = fleet(kv_usage_weight=1.0)
    names = [A, B, C]
    assert list(state.loads.loads_of(names)) == [0.0, 0.0, 0.0]
    busy(state, B, 2)
    state.on_stats(C, {"num_waiting": 3, "num_running": 1, "kv_cache_usage": 0.5}, now=0)
    assert (
        list(state.loads.loads_of(names)) == [state.loads.load(r) for r in names] == [0.0, 2.0, 4.5]
    )
    state.on_completed(next(iter(state.loads._requests)))
    state.remove_replica(C)
    assert list(state.loads.loads_of(names)) == [0.0, 1.0, 0.0]
    assert list(state.loads.loads_of([C, B])) == [0.0, 1.0]  # another list: read afresh


def test_the_least_load_rises_with_its_only_holder_and_is_found_afresh_for_another_list():
    state = fleet()
    names = [A, B, C, "d"]
    for r in (A, B, C):
        busy(state, r, 1)
    assert state.loads.least_load(names) == 0.0  # "d" alone
    busy(state, "d", 2)
    assert state.loads.least_load(names) == 1.0
    assert state.loads.least_load(["d"]) == 2.0


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["route", "complete", "report", "remove", "relist"]),
            st.sampled_from([A, B, C, "d"]),
            st.integers(0, 3),
        ),
        max_size=60,
    )
)
def test_the_least_candidate_load_and_footprint_follow_every_change(ops):
    """The kept minimum equals a fresh min over the kept list after every change, whichever way it
    moves."""
    state = fleet(kv_usage_weight=1.0)
    names = [A, B, C, "d"]
    for i, (kind, replica, n) in enumerate(ops):
        if kind == "route":
            state.on_routed(RouteRequest(f"r{i}", 0, [n, n + 1][:n]), replica, now=i)
        elif kind == "complete" and state.loads._requests:
            state.on_completed(sorted(state.loads._requests)[n % len(state.loads._requests)])
        elif kind == "report":
            state.on_stats(
                replica,
                {
                    "num_waiting": n,
                    "num_running": 0,
                    "kv_cache_usage": n / 4,
                    "prefix_hashes": list(range(n)),
                },
                now=i,
            )
        elif kind == "remove":
            state.remove_replica(replica)
        elif kind == "relist":
            names = list(names)  # another list object: read afresh
        assert (
            state.loads.least_load(names)
            == min(state.loads.loads_of(names))
            == min(state.loads.load(r) for r in names)
        )
        assert (
            state.index.smallest_footprint(names)
            == min(state.index.footprints(names))
            == min(state.index.footprint(r) for r in names)
        )


def _stats(report, with_change: bool) -> dict:
    from router.stats import RoutingStats

    stats = RoutingStats()
    stats.set_prefix(report)
    out = stats.as_dict()
    if not with_change:  # numbered, so that both routers apply the same reports
        for key in ("prefix_base_id", "prefix_listed", "prefix_unlisted"):
            out.pop(key, None)
    return out


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
    """A router applying each report's own account of its change ends exactly where one comparing
    whole lists ends (owners, LRU order, unreported plants), also when it missed a report (it then
    compares lists), when a list was cut at the limit, and with the index at its LRU bound."""
    import random

    from scheduler.block_manager import BlockPool

    rng = random.Random(
        seed
    )  # a seeded stream of operations: hypothesis alone favours short, empty ones
    pools = {A: BlockPool(12), B: BlockPool(12)}
    held: dict[str, list[int]] = {A: [], B: []}
    by_change, by_list = (fleet(max_index_blocks=bound, stats_grace_s=grace) for _ in range(2))
    for now in range(num_ops):
        replica = rng.choice([A, B])
        pool, kind = (
            pools[replica],
            rng.choice(["fill", "fill", "free", "plant", "report", "report", "skip", "cut"]),
        )
        if kind == "fill":
            blocks = pool.allocate(min(rng.randint(1, 4), pool.num_free))
            h = rng.randrange(
                40
            )  # hashes collide: some are cached already, some come back after eviction
            for i, block in enumerate(blocks):
                pool.register(block, h + i)
            held[replica] += blocks
        elif kind == "free":
            n = rng.randint(0, len(held[replica]))
            pool.release(held[replica][:n])
            del held[replica][:n]
        elif kind == "plant":
            h = rng.randrange(40)
            request = RouteRequest(f"r{now}", 1, list(range(h, h + rng.randint(0, 4))))
            for state in (by_change, by_list):
                state.on_routed(request, replica, now)
        else:  # "skip": a report this router never saw; "cut": a list cut at the limit
            report = pool.prefix_report(6 if kind == "cut" else 12)
            if kind != "skip":
                by_change.on_stats(replica, _stats(report, True), now)
                by_list.on_stats(replica, _stats(report, False), now)
        a, b = by_change.index, by_list.index
        assert list(a._owners.items()) == list(b._owners.items())
        assert (
            a._by_replica == b._by_replica
            and a._unreported == b._unreported
            and a._reported == b._reported
        )


def test_a_report_whose_change_does_not_add_up_is_applied_as_a_whole_list():
    state = fleet()
    state.on_stats(A, {"prefix_hashes": [1, 2, 3], "prefix_report_id": 1}, now=0)
    # Claims 9 is new and 1 gone, but the list says otherwise: the list wins.
    state.on_stats(
        A,
        {
            "prefix_hashes": [1, 2, 3, 4],
            "prefix_report_id": 2,
            "prefix_base_id": 1,
            "prefix_listed": [9],
            "prefix_unlisted": [1],
        },
        now=1,
    )
    assert state.index.blocks_of(A) == {1, 2, 3, 4}
    state.on_stats(
        A,
        {
            "prefix_hashes": [2, 3, 4, 5],
            "prefix_report_id": 3,
            "prefix_base_id": 2,
            "prefix_listed": [5],
            "prefix_unlisted": [1],
        },
        now=2,
    )
    assert state.index.blocks_of(A) == {2, 3, 4, 5}
    # Malformed change fields are ignored, never an error.
    state.on_stats(
        A,
        {
            "prefix_hashes": [2, 3],
            "prefix_report_id": "x",
            "prefix_base_id": 3,
            "prefix_listed": 7,
            "prefix_unlisted": None,
        },
        now=3,
    )
    assert state.index.blocks_of(A) == {2, 3}


@pytest.mark.parametrize(
    "listed,usable",
    [
        ([], True),
        ([0, 7, 2**128 - 1], True),
        ([2**128], False),
        ([-1], False),
        ([True], False),
        ([1.0], False),
        ([3, "3"], False),
        ([None], False),
        ((3,), False),
        ("3", False),
    ],
)
def test_a_change_is_used_only_when_its_lists_hold_block_hashes(listed, usable):
    """A change list is a list of ints in [0, 2^128); anything else sends the router to the full
    list."""
    change = ReportChange.of(
        {
            "prefix_report_id": 2,
            "prefix_base_id": 1,
            "prefix_listed": listed,
            "prefix_unlisted": [5],
        }
    )
    assert (change.base_id is not None) == usable


@pytest.mark.parametrize(
    "field,value",
    [
        ("prefix_report_id", 2**64),
        ("prefix_report_id", -1),
        ("prefix_report_id", float("nan")),
        ("prefix_base_id", 2**64),
        ("prefix_base_id", -1),
        ("prefix_base_id", float("nan")),
        ("prefix_listed", list(range(100_000))),
        ("prefix_listed", [float("nan")]),
        ("prefix_listed", [2**64, -1]),
        ("prefix_unlisted", list(range(100_000))),
        ("prefix_unlisted", [-1]),
        ("prefix_unlisted", "x" * 10_000_000),
    ],
)
def test_hostile_report_change_fields_never_corrupt_the_index(field, value):
    """Whatever a change field holds, the index ends holding exactly what the report lists."""
    state = fleet()
    state.on_stats(A, {"prefix_hashes": [1, 2, 3], "prefix_report_id": 1}, now=0)
    report = {
        "prefix_hashes": [2, 3, 4],
        "prefix_report_id": 2,
        "prefix_base_id": 1,
        "prefix_listed": [4],
        "prefix_unlisted": [1],
        field: value,
    }
    state.on_stats(A, report, now=1)
    assert state.index.blocks_of(A) == {2, 3, 4}
    state.on_stats(
        A,
        {
            "prefix_hashes": [3, 4, 5],
            "prefix_report_id": 3,
            "prefix_base_id": 2,
            "prefix_listed": [5],
            "prefix_unlisted": [2],
        },
        now=2,
    )
    assert state.index.blocks_of(A) == {3, 4, 5}


op = st.one_of(
    st.tuples(st.just("route"), hashes, st.integers(0, 4000)),
    st.tuples(st.just("confirm"), st.sampled_from([A, B, C])),
    st.tuples(st.just("complete"), st.integers(0, 30)),
    st.tuples(st.just("stats"), st.sampled_from([A, B, C]), st.integers(0, 8), hashes),
    st.tuples(st.just("kill"), st.sampled_from([A, B, C])),
)


@settings(max_examples=200, deadline=None)
@given(
    policy=st.sampled_from(["round_robin", "least_loaded", "power_of_two", "prefix_affinity"]),
    ops=st.lists(op, max_size=60),
)
def test_never_routes_to_a_dead_replica_and_keeps_no_state_for_it(policy, ops):
    state = fleet(router_policy=policy, max_index_blocks=16, seed=0)
    alive = {A, B, C}
    dead: set[str] = set()
    last: RouteRequest | None = None
    for t, o in enumerate(ops):
        if o[0] == "route":
            last = RouteRequest(f"r{t}", o[2], o[1])
            ranking = state.route(last, alive, now=t)
            assert set(ranking) <= alive
            assert bool(ranking) == bool(alive)
        elif o[0] == "confirm" and last is not None and o[1] in alive:
            state.on_routed(last, o[1], now=t)
        elif o[0] == "complete":
            state.on_completed(f"r{o[1]}")
        elif o[0] == "stats" and o[1] in alive:
            state.on_stats(
                o[1],
                {
                    "num_waiting": 0,
                    "num_running": o[2],
                    "kv_cache_usage": 0.0,
                    "prefix_hashes": o[3],
                },
                now=t,
            )
        elif o[0] == "kill":
            alive.discard(o[1])
            dead.add(o[1])
            state.remove_replica(o[1])
        assert not (state.loads.replicas() | state.index.replicas()) & dead
        assert all(state.loads.get(r).inflight_requests >= 0 for r in (A, B, C))


@pytest.mark.parametrize("state", ["failed", "stalled", "draining"])
def test_a_replica_that_reports_itself_unhealthy_is_never_picked(state):
    fleet_state = fleet(router_policy="least_loaded")
    fleet_state.on_stats(
        A, {"num_waiting": 0, "num_running": 0, "kv_cache_usage": 0.0, "state": state}, now=0
    )
    fleet_state.on_stats(
        B, {"num_waiting": 9, "num_running": 9, "kv_cache_usage": 0.9, "state": "ok"}, now=0
    )
    for i in range(5):
        assert fleet_state.route(RouteRequest(f"r{i}", 10, []), [A, B], now=1) == [B]
    fleet_state.on_stats(
        A, {"num_waiting": 0, "num_running": 0, "kv_cache_usage": 0.0, "state": "ok"}, now=2
    )
    assert fleet_state.route(RouteRequest("back", 10, []), [A, B], now=3)[0] == A


# ---------------------------------------------------------------- circuit breaker


OK_STATS = {"num_waiting": 0, "num_running": 0, "kv_cache_usage": 0.0, "state": "ok"}


def fail_on(state: FleetState, replica: str, n: int, now: float) -> None:
    """n requests routed to replica whose caller then reports a replica failure."""
    for _ in range(n):
        request = RouteRequest(f"doomed-{next(_ids)}", 10, [])
        state.on_routed(request, replica, now)
        assert state.on_outcome(request.request_id, ok=False, now=now) == replica


def test_consecutive_failures_reported_by_the_caller_open_the_circuit_and_the_router_skips_it():
    state = fleet(
        router_policy="least_loaded", circuit_breaker_failures=3, circuit_breaker_cooldown_s=10
    )
    fail_on(state, A, 2, now=0)
    assert A in state.route(RouteRequest("still", 10, []), [A, B], now=1)
    fail_on(state, A, 1, now=1)
    busy(state, B, 5, now=1)  # even a much busier B beats a replica with an open circuit
    for i in range(5):
        assert state.route(RouteRequest(f"r{i}", 10, []), [A, B], now=2) == [B]


def test_an_open_circuit_closes_on_a_fresh_ok_report_after_the_cool_down():
    state = fleet(
        router_policy="least_loaded", circuit_breaker_failures=1, circuit_breaker_cooldown_s=10
    )
    busy(state, B, 5, now=0)
    fail_on(state, A, 1, now=0)
    state.on_stats(A, {**OK_STATS, "num_running": 1}, now=5)  # too early: may predate the failure
    assert state.route(RouteRequest("early", 10, []), [A, B], now=5) == [B]
    state.on_stats(A, OK_STATS, now=11)
    assert state.route(RouteRequest("back", 10, []), [A, B], now=11)[0] == A


def test_a_success_reported_by_the_caller_resets_the_count():
    state = fleet(router_policy="least_loaded", circuit_breaker_failures=2)
    for i in range(5):
        fail_on(state, A, 1, now=i)
        state.on_routed(RouteRequest(f"fine-{i}", 10, []), A, now=i)
        assert state.on_outcome(f"fine-{i}", ok=True, now=i) == A
    assert not state.breaker.is_open(A)


def test_when_every_circuit_is_open_the_router_still_routes():
    # Refusing everything would strand requests; their own migration limit decides when to give up.
    state = fleet(router_policy="least_loaded", circuit_breaker_failures=1)
    fail_on(state, A, 1, now=0)
    fail_on(state, B, 1, now=0)
    assert sorted(state.route(RouteRequest("any", 10, []), [A, B], now=1)) == [A, B]


def test_after_the_cool_down_one_probe_goes_to_the_replica_and_its_success_closes_the_circuit():
    state = fleet(
        router_policy="least_loaded", circuit_breaker_failures=1, circuit_breaker_cooldown_s=10
    )
    fail_on(state, A, 1, now=0)
    busy(state, B, 5, now=0)
    probe = RouteRequest("probe", 10, [])
    assert state.route(probe, [A, B], now=10)[0] == A
    assert state.route(RouteRequest("second", 10, []), [A, B], now=10.5) == [
        B
    ]  # one probe at a time
    state.on_routed(probe, A, now=10)
    assert state.on_outcome("probe", ok=True, now=11) == A
    assert state.route(RouteRequest("back", 10, []), [A, B], now=11)[0] == A


def test_outcomes_of_unknown_requests_are_ignored_and_removal_forgets_the_circuit():
    state = fleet(circuit_breaker_failures=1)
    assert state.on_outcome("never-routed", ok=False, now=0) is None
    fail_on(state, A, 1, now=0)
    state.remove_replica(A)
    assert not state.breaker.replicas()
    fail_on(state, B, 1, now=0)
    state.retain([A])
    assert not state.breaker.replicas()


@pytest.mark.parametrize(
    "field,value",
    [
        ("circuit_breaker_failures", -1),
        ("circuit_breaker_cooldown_s", 0),
        ("circuit_breaker_cooldown_s", float("nan")),
        ("seed", -1),
    ],
)
def test_breaker_settings_reject_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        RoutingConfig(**{field: value})
