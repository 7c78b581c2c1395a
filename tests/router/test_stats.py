"""A replica's report to the router: a dict only on its way through Serve, read back once, and a
malformed one refused naming its field (the router then ignores it and keeps routing)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.stats import ReplicaState, RoutingStats
from scheduler.block_manager import PrefixReport
from scheduler.outputs import SchedulerStats
from tests.router.scaffold import fleet

A = "a"

counts = st.integers(0, 2**40)
figures = st.floats(0, 1e6, allow_nan=False)
block_hashes = st.lists(st.integers(0, 2**128 - 1), max_size=6)
reports = st.builds(
    RoutingStats,
    st.builds(SchedulerStats, counts, counts, counts, figures, figures, counts, counts, counts),
    st.sampled_from(ReplicaState),
    st.none()
    | st.builds(PrefixReport, block_hashes, counts, st.none() | counts, block_hashes, block_hashes),
    st.none() | block_hashes,  # the KV tiers' hashes
)


@settings(max_examples=200, deadline=None)
@given(stats=reports)
def test_a_report_read_back_from_its_dict_is_the_report_sent(stats):
    sent = stats.to_dict()
    assert all(type(v) in (int, float, str, list, type(None)) for v in sent.values())
    assert RoutingStats.from_dict(sent) == stats


def test_the_dict_is_flat_with_the_state_as_its_name():
    stats = RoutingStats(
        SchedulerStats(1, 2, 0, 0.5, 0.25, 3),
        ReplicaState.DRAINING,
        PrefixReport([7, 8], 4, 3, [8]),
    )
    sent = stats.to_dict()
    assert sent["state"] == "draining" and sent["num_running"] == 2
    assert sent["prefix_hashes"] == [7, 8] and sent["prefix_base_id"] == 3
    assert "prefix_hashes" not in RoutingStats(stats.scheduler).to_dict()


def test_scheduler_figures_with_a_default_may_be_absent():
    sent = RoutingStats(SchedulerStats(1, 2, 0, 0.5, 0.0, 0)).to_dict()
    for key in ("num_free_blocks", "num_prompt_tokens_queried", "num_prompt_tokens_hit", "state"):
        del sent[key]
    assert RoutingStats.from_dict(sent) == RoutingStats(SchedulerStats(1, 2, 0, 0.5, 0.0, 0))


GOOD = RoutingStats(SchedulerStats(1, 2, 0, 0.5, 0.0, 0), prefix=PrefixReport([1, 2], 5)).to_dict()


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_running", None),  # missing
        ("num_running", "many"),
        ("num_waiting", True),
        ("num_waiting", -1),
        ("num_waiting", 1.0),
        ("kv_cache_usage", float("nan")),
        ("kv_cache_usage", float("inf")),
        ("kv_cache_usage", -0.5),
        ("kv_cache_usage", "0.5"),
        ("state", "sleeping"),
        ("prefix_hashes", 5),
        ("prefix_hashes", "3"),
        ("prefix_hashes", (3,)),
        ("prefix_hashes", [1, "2"]),
        ("prefix_hashes", [2**128]),
        ("prefix_hashes", [-1]),
        ("prefix_hashes", [True]),
        ("prefix_report_id", None),  # missing
        ("prefix_report_id", -1),
        ("prefix_report_id", float("nan")),
        ("prefix_base_id", -1),
        ("prefix_base_id", "4"),
        ("prefix_listed", None),  # missing
        ("prefix_listed", 7),
        ("prefix_listed", [float("nan")]),
        ("prefix_unlisted", [2**64, -1]),
        ("prefix_unlisted", "x" * 10_000_000),
        ("tier_hashes", 5),
        ("tier_hashes", [2**128]),
        ("tier_hashes", [-1, float("nan")]),
    ],
)
def test_a_malformed_field_is_refused_by_name(field, value):
    sent = dict(GOOD)
    if value is None:
        del sent[field]
    else:
        sent[field] = value
    with pytest.raises(ValueError, match=f"routing stats field '{field}'"):
        RoutingStats.from_dict(sent)


@pytest.mark.parametrize("sent", [None, [], "ok", 3])
def test_a_report_that_is_not_a_dict_is_refused(sent):
    with pytest.raises(ValueError, match="routing stats: expected a dict"):
        RoutingStats.from_dict(sent)


@pytest.mark.parametrize(
    "field,value",
    [
        ("prefix_report_id", 2**64),
        ("prefix_base_id", 2**64),
        ("prefix_base_id", 7),
        ("prefix_listed", list(range(100_000))),
        ("prefix_listed", [4, 4]),
        ("prefix_listed", []),
        ("prefix_unlisted", list(range(100_000))),
        ("prefix_unlisted", [9]),
        ("prefix_report_id", -1),
        ("prefix_listed", [2**64, -1]),
        ("prefix_unlisted", "x" * 10_000_000),
    ],
)
def test_hostile_change_fields_never_corrupt_the_index(field, value):
    """Whatever a change field holds, the report is refused by name or the index ends holding
    exactly what the report lists; and the next report applies in full."""
    state = fleet()
    state.on_stats(A, RoutingStats.from_dict(_sent([1, 2, 3], 1)), now=0)
    hostile = {**_sent([2, 3, 4], 2, 1, [4], [1]), field: value}
    try:
        state.on_stats(A, RoutingStats.from_dict(hostile), now=1)
        assert state.index.blocks_of(A) == {2, 3, 4}
    except ValueError as e:
        assert field in str(e)
        assert state.index.blocks_of(A) == {1, 2, 3}
    state.on_stats(A, RoutingStats.from_dict(_sent([3, 4, 5], 3, 2, [5], [2])), now=2)
    assert state.index.blocks_of(A) == {3, 4, 5}


def _sent(hashes, report_id, base_id=None, listed=(), unlisted=()) -> dict:
    """The dict of an idle replica's report with this prefix report."""
    prefix = PrefixReport(hashes, report_id, base_id, list(listed), list(unlisted))
    return RoutingStats(SchedulerStats(0, 0, 0, 0.0, 0.0, 0), prefix=prefix).to_dict()
