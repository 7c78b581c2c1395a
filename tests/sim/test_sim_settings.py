"""The simulator's configs declare their fields with setting(): any value of any of them is taken
whole or refused naming the field, as the engine's settings are."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from settings import build, declared_settings
from sim.adapters import AdapterMix, AdapterSlotsConfig
from sim.agents import AgentConfig
from sim.autoscale import AutoscaleConfig, DayWorkloadConfig
from sim.disagg import DisaggConfig
from sim.fleet_config import HostConfig, SimConfig
from sim.kv_copy import LinkConfig
from sim.tier_study import ConversationConfig
from sim.workload import MAX_LEN, WorkloadConfig

CONFIGS = [
    AdapterSlotsConfig,
    AdapterMix,
    AutoscaleConfig,
    ConversationConfig,
    DayWorkloadConfig,
    DisaggConfig,
    HostConfig,
    LinkConfig,
    SimConfig,
    WorkloadConfig,
]
HOSTILE = [2**64, -(2**64), -1, 0, math.nan, math.inf, -math.inf, 10**400, 1e308, "x" * 10_000_000]


@given(
    st.sampled_from(CONFIGS).flatmap(
        lambda cls: st.tuples(
            st.just(cls),
            st.sampled_from([f.name for f in declared_settings(cls)]),
            st.one_of(st.sampled_from(HOSTILE), st.integers(), st.floats(), st.text(max_size=8)),
        )
    )
)
def test_any_value_of_any_sim_setting_is_taken_or_refused_by_name(case):
    cls, name, value = case
    try:
        config = build(cls, {name: value}, "at.")
    except ValueError as exc:
        assert str(exc).startswith(f"at.{name}: ")
        assert len(str(exc)) < 1000
        return
    kept = getattr(config, name)
    assert type(kept) in (int, float)
    assert math.isfinite(kept)
    assert kept == (float(value) if isinstance(kept, float) else value)


@pytest.mark.parametrize(
    "cls,name,value,message",
    [
        (AdapterSlotsConfig, "slots", 0, "must be >= 1"),
        (AdapterSlotsConfig, "load_s", 3601.0, "must be <= 3600"),
        (AdapterMix, "zipf_s", math.nan, "must be finite"),
        (DayWorkloadConfig, "burst_factor", 101.0, "must be <= 100"),
        (AutoscaleConfig, "look_back_s", 0.0, "must be > 0"),
        (DisaggConfig, "decode_replicas", True, "must be an integer"),
        (HostConfig, "replicas_per_host", 2**64, "must fit in 64 bits"),
        (WorkloadConfig, "rate", -1, "must be > 0"),
        (LinkConfig, "bandwidth_bytes_per_s", 0.5, "must be >= 1.0"),
        (ConversationConfig, "users", 2**20 + 1, "must be <= 1048576"),
    ],
)
def test_a_bound_is_refused_with_the_field_and_the_bound(cls, name, value, message):
    with pytest.raises(ValueError, match=f"^{name}: {message}"):
        cls(**{name: value})


# Every (low, high) token range of a workload config, checked by one rule (sim.workload).
LENGTH_RANGES = [
    (WorkloadConfig, "question_len"),
    (WorkloadConfig, "output_len"),
    (DayWorkloadConfig, "chat_question_len"),
    (DayWorkloadConfig, "chat_output_len"),
    (DayWorkloadConfig, "long_prompt_len"),
    (DayWorkloadConfig, "long_output_len"),
    (ConversationConfig, "question_len"),
    (ConversationConfig, "answer_len"),
    (AgentConfig, "question_len"),
    (AgentConfig, "answer_len"),
]


@pytest.mark.parametrize("cls,name", LENGTH_RANGES)
@pytest.mark.parametrize(
    "bad",
    [(1, 2**64), (-1, 4), (1, math.nan), (1, 10**30), (5, 4), (0, 4), (1.0, 4), (1, MAX_LEN + 1)],
)
def test_a_length_range_out_of_bounds_is_refused_naming_its_field(cls, name, bad):
    with pytest.raises(ValueError, match=f"^{name}: need integers 1 <= low <= high <= 2\\^20"):
        cls(**{name: bad})


@pytest.mark.parametrize("cls,name", LENGTH_RANGES)
def test_a_length_range_takes_its_bounds(cls, name):
    assert getattr(cls(**{name: (1, MAX_LEN)}), name) == (1, MAX_LEN)


@pytest.mark.parametrize("cls", [ConversationConfig, AgentConfig])
@pytest.mark.parametrize(
    "bad", [(0.0, 2.0**64), (-1.0, 1.0), (0.0, math.nan), (0.0, 1e300), (2.0, 1.0)]
)
def test_a_think_time_range_out_of_bounds_is_refused_naming_it(cls, bad):
    with pytest.raises(ValueError, match=r"^think_s: need 0 <= low <= high <= 1e6"):
        cls(think_s=bad)
