"""A tensor-parallel replica stays on one node by default, and a replica no node can hold fails
with its bundles and the largest node named instead of waiting forever."""

from __future__ import annotations

import logging

import pytest

from cluster.placement import (
    UnplaceableError,
    default_strategy,
    spread_warning,
    unplaceable,
    wait_until_placeable,
)
from deploy.app import build_app, check_placement
from deploy.config import AppConfig

GPU_NODE = {"CPU": 48.0, "GPU": 4.0, "memory": 1e11}
HEAD = {"CPU": 8.0, "memory": 3e10}
TP2 = [{"CPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]


def test_tensor_parallel_replicas_default_to_one_node():
    assert default_strategy(1) == "PACK"
    assert default_strategy(2) == "STRICT_PACK"
    assert AppConfig.from_args({}).placement_group_strategy() == "PACK"
    tp2 = AppConfig.from_args({"tensor_parallel_size": 2})
    assert tp2.placement_strategy is None and tp2.placement_group_strategy() == "STRICT_PACK"
    spread = AppConfig.from_args({"tensor_parallel_size": 2, "placement_strategy": "SPREAD"})
    assert spread.placement_group_strategy() == "SPREAD"


@pytest.mark.parametrize("strategy", ["PACK", "SPREAD", "STRICT_SPREAD"])
def test_spreading_tensor_parallel_ranks_is_allowed_with_a_warning(strategy):
    assert spread_warning(strategy, 1) is None
    assert spread_warning("STRICT_PACK", 4) is None
    warning = spread_warning(strategy, 2)
    assert warning is not None
    assert f"placement_strategy: {strategy} with tensor_parallel_size 2" in warning
    assert "cross the network through NCCL" in warning


@pytest.mark.parametrize("strategy", ["PACK", "SPREAD"])
def test_the_app_logs_the_spread_warning_before_placing(strategy, caplog):
    # PACK and SPREAD fit a one-node test cluster; STRICT_SPREAD would wait for more nodes.
    config = AppConfig.from_args(
        {"tensor_parallel_size": 2, "placement_strategy": strategy, "device": "cpu"}
    )
    with caplog.at_level(logging.WARNING, logger="deploy.app"):
        check_placement(config)
    assert spread_warning(strategy, 2) in caplog.text


def test_a_gpu_node_holds_a_tp2_replica_under_every_strategy_that_can_fit():
    for strategy in ("STRICT_PACK", "PACK", "SPREAD"):
        assert unplaceable(TP2, strategy, [HEAD, GPU_NODE]) is None
    # Three bundles, each on a node of its own: two GPU nodes and the head.
    assert unplaceable(TP2, "STRICT_SPREAD", [HEAD, GPU_NODE, GPU_NODE]) is None


def test_strict_pack_needs_one_node_with_all_the_gpus():
    one_gpu = {"CPU": 8.0, "GPU": 1.0}
    problem = unplaceable(TP2, "STRICT_PACK", [HEAD, one_gpu, one_gpu])
    assert problem is not None
    assert "bundles [{CPU: 1}, {CPU: 1, GPU: 1}, {CPU: 1, GPU: 1}] under STRICT_PACK" in problem
    assert "one node must hold them all ({CPU: 3, GPU: 2})" in problem
    assert "the largest node has {CPU: 8, GPU: 1}" in problem
    # Spread over the two one-GPU nodes, it fits (at the cost the warning names).
    assert unplaceable(TP2, "PACK", [HEAD, one_gpu, one_gpu]) is None


def test_a_cluster_without_gpus_holds_no_gpu_replica():
    for strategy in ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"):
        problem = unplaceable(TP2, strategy, [HEAD])
        assert problem is not None and "the largest node has {CPU: 8, GPU: 0}" in problem


def test_strict_spread_needs_a_node_per_bundle():
    problem = unplaceable(TP2, "STRICT_SPREAD", [HEAD, GPU_NODE])
    assert problem is not None and "each must sit on a node of its own (3 nodes)" in problem


def test_best_effort_strategies_need_the_sum_somewhere_in_the_cluster():
    bundles = [{"CPU": 6.0}, {"CPU": 6.0}]
    assert unplaceable(bundles, "SPREAD", [HEAD, HEAD]) is None
    problem = unplaceable(bundles, "SPREAD", [HEAD])
    assert problem is not None
    assert "bundles [{CPU: 6}, {CPU: 6}] under SPREAD" in problem
    assert "the largest node has {CPU: 8}" in problem


def test_an_empty_cluster_holds_nothing():
    problem = unplaceable([{"CPU": 1.0}], "PACK", [])
    assert problem is not None and "bundles [{CPU: 1}] under PACK" in problem


# ---- on a Ray cluster (8 logical CPUs, no GPU) --------------------------------------------------


@pytest.mark.slow
def test_wait_fails_at_once_with_no_timeout(ray_cluster):
    with pytest.raises(UnplaceableError, match=r"the largest node has \{CPU: 8\}"):
        wait_until_placeable([{"CPU": 64.0}], "STRICT_PACK", 0)
    wait_until_placeable([{"CPU": 1.0}, {"CPU": 1.0}], "STRICT_PACK", 0)  # fits: returns


@pytest.mark.slow
def test_wait_gives_up_after_its_timeout_and_leaves_no_probe_group(ray_cluster):
    from ray.util.placement_group import placement_group_table

    def live_groups() -> set[str]:
        return {k for k, v in placement_group_table().items() if v["state"] != "REMOVED"}

    before = live_groups()
    with pytest.raises(UnplaceableError, match="waited 1s: placement_timeout_s"):
        wait_until_placeable([{"CPU": 4.0}, {"CPU": 5.0}], "STRICT_PACK", 1)
    assert live_groups() == before


@pytest.mark.slow
def test_build_app_fails_for_a_replica_no_node_can_hold(ray_cluster):
    args = {
        "device": "cpu",
        "tensor_parallel_size": 2,
        "worker_num_cpus": 6,
        "placement_timeout_s": 0,
    }
    with pytest.raises(UnplaceableError) as raised:
        build_app(args)
    message = str(raised.value)
    assert "bundles [{CPU: 1}, {CPU: 6}, {CPU: 6}] under STRICT_PACK" in message
    assert "one node must hold them all ({CPU: 13})" in message
    assert "the largest node has {CPU: 8}" in message


@pytest.mark.slow
def test_offline_tensor_parallel_engine_fails_when_no_node_has_enough_cpus(ray_cluster, tiny_llama):
    from cluster.ray_executor import RayExecutor
    from engine.config import EngineConfig

    runner_config = EngineConfig(device="cpu", load_progress=False).runner_config(tiny_llama, 64)
    with pytest.raises(UnplaceableError, match="tensor_parallel_size: 9 ranks: no node"):
        RayExecutor(runner_config, 9)
