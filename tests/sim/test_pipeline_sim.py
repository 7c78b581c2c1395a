"""Pipeline stages in the simulator's cost model: a stage's share of the costs, the bubble of one
step in flight (1 - 1/N idle), micro-batches that close it (up to the hand-offs), and shapes out
of range refused naming the field."""

from __future__ import annotations

import math

import pytest

from sim.cost import load_profile
from sim.pipeline import PipelineShape, llama_405b_stage_node, stage_cost, steady_decode

CPU = load_profile("cpu")


def test_a_stage_holds_its_share_of_weights_flops_and_kv_and_every_overhead():
    stage = stage_cost(CPU, 4)
    assert stage.weight_bytes == CPU.weight_bytes / 4
    assert stage.num_params == CPU.num_params / 4
    assert stage.kv_bytes_per_token == CPU.kv_bytes_per_token / 4
    assert stage.step_overhead_s == CPU.step_overhead_s
    assert stage.per_seq_overhead_s == CPU.per_seq_overhead_s


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_one_step_in_flight_leaves_each_stage_idle_all_but_its_share(stages):
    shape = PipelineShape(stages)
    one = steady_decode(CPU, shape, 16, 512, 1)
    t = stage_cost(CPU, stages).step_time(0, 16, 16 * 512, 16)
    assert one.round_s == pytest.approx(stages * t)
    assert one.idle_fraction == pytest.approx(1 - 1 / stages)
    assert one.tokens_per_s == pytest.approx(16 / one.round_s)


def test_micro_batches_keep_every_stage_busy_until_the_hand_offs_cost_more_than_a_step():
    quiet = steady_decode(CPU, PipelineShape(2), 16, 512, 2)
    assert quiet.idle_fraction == pytest.approx(0.0)
    t = stage_cost(CPU, 2).step_time(0, 8, 8 * 512, 8)
    assert quiet.round_s == pytest.approx(2 * t)
    # A hand-off as long as a stage's step: each micro-batch waits for it, a third of the round.
    slow = steady_decode(CPU, PipelineShape(2, link_latency_s=t), 16, 512, 2)
    assert slow.round_s == pytest.approx(3 * t)
    assert slow.idle_fraction == pytest.approx(1 / 3)


def test_the_405b_class_study_figures_hold_their_shape():
    """Memory-bound decode: micro-batches close the bubble but re-read each stage's weights per
    micro-batch, so at the same requests they buy little; N x the requests buy N x."""
    cost = llama_405b_stage_node()
    shape = PipelineShape(2, hop_bytes_per_token=65536, link_bytes_per_s=50e9)
    one = steady_decode(cost, shape, 64, 1024, 1)
    many = steady_decode(cost, shape, 64, 1024, 2)
    assert one.idle_fraction > 0.45 and many.idle_fraction < 0.05
    assert 1.0 < many.tokens_per_s / one.tokens_per_s < 1.2
    doubled = steady_decode(cost, shape, 128, 1024, 2)
    assert doubled.tokens_per_s / one.tokens_per_s == pytest.approx(2.0, rel=0.02)


FIGURES = ["hop_bytes_per_token", "link_bytes_per_s", "link_latency_s", "turnaround_s"]


@pytest.mark.parametrize("bad", [-1, math.nan, 1e308 * 10, True, "2"])
@pytest.mark.parametrize("field", FIGURES)
def test_a_shape_out_of_range_is_refused_naming_the_field(field, bad):
    with pytest.raises(ValueError, match=field):
        PipelineShape(2, **{field: bad})


@pytest.mark.parametrize("field", FIGURES)
def test_a_huge_finite_figure_is_a_figure(field):
    """2^64 bytes, bytes/s or seconds is absurd but finite, as CostModel's figures may be: the
    arithmetic stays finite."""
    shape = PipelineShape(2, **{field: 2**64})
    assert math.isfinite(steady_decode(CPU, shape, 16, 512, 2).round_s)


@pytest.mark.parametrize("bad", [2**64, -1, 0, 65, True, 2.0])
def test_stages_out_of_range_are_refused(bad):
    with pytest.raises(ValueError, match="stages"):
        PipelineShape(bad)


@pytest.mark.parametrize("bad", [0, -1, 17, 2**64])
def test_micro_batches_out_of_range_are_refused(bad):
    with pytest.raises(ValueError, match="micro_batches"):
        steady_decode(CPU, PipelineShape(2), 16, 512, bad)
