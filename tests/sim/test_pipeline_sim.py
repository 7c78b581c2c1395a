"""Pipeline stages in the simulator's cost model: a stage's share of the costs, the bubble of one
step in flight (1 - 1/N idle), micro-batches that close it (up to the hand-offs), a TP group's
all-reduces (a ring over NVLink, over the NIC once it spans nodes), and shapes out of range
refused naming the field."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from sim.cost import load_profile
from sim.pipeline import (
    PipelineShape,
    TensorParallel,
    llama_405b,
    llama_405b_stage_node,
    llama_405b_tp,
    stage_cost,
    steady_decode,
)

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


# ---- tensor parallelism's all-reduces -------------------------------------------------------
def test_an_all_reduce_is_a_ring_of_2_p_minus_1_steps_over_nvlink_inside_a_node():
    tp = TensorParallel(8, 126, 32768, nvlink_bytes_per_s=400e9, nvlink_latency_s=2e-6)
    # 16 tokens of 32 KiB: each of the 14 steps moves 1/8 of 512 KiB over every link at once.
    assert tp.all_reduce_s(16) == pytest.approx(14 * (2e-6 + 16 * 32768 / 8 / 400e9))
    assert not tp.spans_nodes


def test_the_bytes_term_scales_with_the_tokens_and_the_latency_term_does_not():
    tp = TensorParallel(8, 126, 32768, nvlink_latency_s=0.0)
    assert tp.all_reduce_s(64) == pytest.approx(4 * tp.all_reduce_s(16))
    latency_only = TensorParallel(8, 126, 0.0)
    assert latency_only.all_reduce_s(256) == latency_only.all_reduce_s(1) == 14 * 1e-6


def test_the_nic_paces_the_ring_only_when_the_group_spans_nodes():
    inside, across = TensorParallel(8, 10, 4096), TensorParallel(16, 10, 4096)
    slow_nic = {"nic_bytes_per_s": 1e6, "nic_latency_s": 1.0}
    assert replace(inside, **slow_nic).all_reduce_s(32) == inside.all_reduce_s(32)
    assert replace(across, **slow_nic).all_reduce_s(32) > 100 * across.all_reduce_s(32)
    slow_nvlink = {"nvlink_bytes_per_s": 1e6, "nvlink_latency_s": 1.0}
    assert replace(across, **slow_nvlink).all_reduce_s(32) == across.all_reduce_s(32)
    assert across.all_reduce_s(32) == pytest.approx(30 * (10e-6 + 32 * 4096 / 16 / 50e9))
    # Nodes of 16: the same 16 ranks fit one node and stay on NVLink.
    assert not replace(across, ranks_per_node=16).spans_nodes


def test_one_rank_pays_no_all_reduce_and_a_stage_pays_two_per_layer_it_holds():
    assert TensorParallel(1, 126, 32768).all_reduce_s(64) == 0.0
    tp = TensorParallel(8, 126, 32768)
    plain = steady_decode(CPU, PipelineShape(2), 16, 512, 2)
    with_tp = steady_decode(CPU, PipelineShape(2), 16, 512, 2, tp)
    # Two micro-batches of 8 per round on each stage; a stage holds 63 layers.
    assert with_tp.round_s - plain.round_s == pytest.approx(2 * 2 * 63 * tp.all_reduce_s(8))


def test_tp16_across_two_nodes_loses_to_tp8_by_pp2_on_a_10_us_nic():
    """The study's reading (docs/pipeline.md): 252 all-reduces a step, each 30 ring steps paced by
    the NIC, cost TP=16 more than the bubble-free pipeline's second stage does."""
    for batch in (16, 64, 256):
        tp16 = steady_decode(llama_405b(16), PipelineShape(1), batch, 1024, 1, llama_405b_tp(16))
        pp = steady_decode(
            llama_405b(8), PipelineShape(2, 65536, 50e9, 10e-6), batch, 1024, 2, llama_405b_tp(8)
        )
        assert pp.tokens_per_s > 1.9 * tp16.tokens_per_s
        assert llama_405b_tp(16).step_s(batch, 1) > 0.5 * tp16.round_s


def test_past_eight_ranks_the_kv_heads_are_held_twice():
    assert llama_405b(16).kv_bytes_per_token == 2 * llama_405b(8).kv_bytes_per_token


TP_FIGURES = [
    "hidden_bytes_per_token",
    "nvlink_bytes_per_s",
    "nvlink_latency_s",
    "nic_bytes_per_s",
    "nic_latency_s",
]


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf, 1e308 * 10, True, "2"])
@pytest.mark.parametrize("field", TP_FIGURES)
def test_a_tp_figure_out_of_range_is_refused_naming_it(field, bad):
    with pytest.raises(ValueError, match=field):
        TensorParallel(8, 126, **{"hidden_bytes_per_token": 32768.0, field: bad})


@pytest.mark.parametrize("field", ["nvlink_bytes_per_s", "nic_bytes_per_s"])
def test_a_link_without_bandwidth_is_refused(field):
    with pytest.raises(ValueError, match=field):
        TensorParallel(16, 126, 32768, **{field: 0})


@pytest.mark.parametrize("field", TP_FIGURES)
def test_a_huge_finite_tp_figure_keeps_the_arithmetic_finite(field):
    tp = TensorParallel(16, 126, **{"hidden_bytes_per_token": 32768.0, field: 2**64})
    assert math.isfinite(steady_decode(CPU, PipelineShape(2), 16, 512, 2, tp).round_s)


@pytest.mark.parametrize("bad", [2**64, -1, 1025, True, 2.0, math.nan])
@pytest.mark.parametrize("field", ["ranks", "ranks_per_node"])
def test_ranks_out_of_range_are_refused(field, bad):
    with pytest.raises(ValueError, match=field):
        TensorParallel(**{field: bad})


@pytest.mark.parametrize("bad", [2**64, -1, 4097, True, 1.0])
def test_layers_out_of_range_are_refused(bad):
    with pytest.raises(ValueError, match="layers"):
        TensorParallel(8, bad)


@pytest.mark.parametrize("bad", [2**64, -1, 0, True])
def test_a_405b_profile_over_a_gpu_count_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="gpus"):
        llama_405b(bad)
