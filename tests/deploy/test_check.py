"""Fail fast: an app is measured in all (every replica's placement group and the ingress) against
what the cluster has, by build_app and by `python -m deploy check`; the shipped configs fit the
machines their comments name."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.exceptions import RayServeException

from cluster.placement import UnplaceableError
from deploy.app import UnplaceableAppError, build_app
from deploy.check import app_demand, placement_problems, starting_replicas
from deploy.config import AppConfig
from deploy.fleet_config import FleetConfig

ROOT = Path(__file__).resolve().parents[2]
TWO_CORES = [{"CPU": 2.0}]
# ray_config.yaml: an m5.2xlarge head (8 CPUs, no GPU), g5.12xlarge workers (48 CPUs, 4 GPUs).
RAY_UP_CLUSTER = [{"CPU": 8.0}, {"CPU": 48.0, "GPU": 4.0}, {"CPU": 48.0, "GPU": 4.0}]


def fleets(name: str) -> list[FleetConfig]:
    spec = yaml.safe_load((ROOT / name).read_text())
    return [FleetConfig.from_args(app["args"]) for app in spec["applications"]]


@pytest.mark.parametrize(
    "name",
    [
        "deploy.yaml",
        "deploy/examples/cpu_two_replicas.yaml",
        "deploy/examples/cpu_two_models.yaml",
    ],
)
def test_the_cpu_configs_fit_a_two_core_machine(name, monkeypatch):
    monkeypatch.setenv("RAYLM_API_KEYS", '{"k": {"tenant": "t"}}')
    for fleet in fleets(name):
        assert placement_problems(fleet, TWO_CORES, "this machine") == []


@pytest.mark.parametrize(
    "name, nodes",
    [("gpu_tp2.yaml", RAY_UP_CLUSTER[:2]), ("gpu_dp_tp2.yaml", RAY_UP_CLUSTER)],
)
def test_the_gpu_examples_fit_the_ray_up_cluster_their_comments_name(name, nodes, monkeypatch):
    monkeypatch.setenv("RAYLM_API_KEYS", '{"k": {"tenant": "t"}}')
    [fleet] = fleets(f"deploy/examples/{name}")
    assert placement_problems(fleet, nodes, "the cluster") == []
    if name == "gpu_dp_tp2.yaml":  # 8 GPUs: one 4-GPU worker is not enough
        [problem] = placement_problems(fleet, RAY_UP_CLUSTER[:2], "the cluster")
        assert problem == (
            "the app needs {CPU: 14, GPU: 8} in all (4 x {CPU: 3, GPU: 2} "
            "(meta-llama/Llama-3.1-8B-Instruct) + 2 x {CPU: 1} (ingress)); the cluster has "
            "{CPU: 56, GPU: 4}"
        )


def test_the_two_node_pipeline_example_puts_each_stage_on_a_gpu_node_of_its_own(monkeypatch):
    """gpu_pp2_two_nodes.yaml: STRICT_SPREAD over the head and both GPU workers of ray_config.yaml;
    with one GPU worker the check names the bundles and the largest node."""
    monkeypatch.setenv("RAYLM_API_KEYS", '{"k": {"tenant": "t"}}')
    [fleet] = fleets("deploy/examples/gpu_pp2_two_nodes.yaml")
    [model] = fleet.models
    assert model.engine.pipeline_parallel_size == 2 and model.engine.world_size == 2
    assert model.placement_group_strategy() == "STRICT_SPREAD"
    stage = {"CPU": 1.0, "GPU": 1.0}
    assert model.placement_group_bundles() == [{"CPU": 1.0}, stage, stage]
    assert placement_problems(fleet, RAY_UP_CLUSTER, "the cluster") == []
    [problem] = placement_problems(fleet, RAY_UP_CLUSTER[:2], "the cluster")
    assert "under STRICT_SPREAD, and each must sit on a node of its own (3 nodes)" in problem


def test_two_replicas_and_the_ingress_on_two_cores_name_what_they_need_and_what_there_is():
    fleet = FleetConfig.from_args(
        {"num_replicas": 2, "replica_num_cpus": 1, "ingress_num_cpus": 0.5}
    )
    assert placement_problems(fleet, TWO_CORES, "this machine") == [
        "the app needs {CPU: 2.5} in all (2 x {CPU: 1} (default) + 1 x {CPU: 0.5} (ingress)); "
        "this machine has {CPU: 2}"
    ]


def test_replicas_counted_at_start():
    def count(**args) -> int:
        return starting_replicas(AppConfig.from_args(args))

    assert count() == 1
    assert count(num_replicas=3) == 3
    assert count(autoscaling={"min_replicas": 0, "max_replicas": 4}) == 1  # scale to zero: one
    assert count(autoscaling={"min_replicas": 2, "max_replicas": 4, "initial_replicas": 3}) == 3
    fleet = FleetConfig.from_args(
        {"models": [{"name": "a", "num_replicas": 2}, {"name": "b"}], "ingress_replicas": 2}
    )
    assert app_demand(fleet).total == {"CPU": 3 * 1.0 + 2 * 0.5}


@pytest.mark.slow
def test_build_app_fails_at_once_for_an_app_the_cluster_cannot_hold(ray_cluster):
    """Each replica fits a node of the session's 8-CPU cluster; nine of them do not."""
    with pytest.raises(UnplaceableAppError) as raised:
        build_app({"num_replicas": 9, "placement_timeout_s": 0, "ingress_num_cpus": 0})
    assert isinstance(raised.value, UnplaceableError)
    assert isinstance(raised.value, RayServeException)  # Serve reports it as one line
    assert str(raised.value) == (
        "the app needs {CPU: 9} in all (9 x {CPU: 1} (default) + 1 x {CPU: 0} (ingress)); "
        "the cluster has {CPU: 8} (placement_timeout_s: 0)"
    )


@pytest.mark.parametrize(
    "key, nearest",
    [
        ("max_num_seq", "['max_num_seqs']"),  # a scheduler setting, written flat
        ("modle", "['model']"),  # an engine setting
        ("min_replica", "'autoscaling.min_replicas'"),  # inside an optional section
    ],
)
def test_an_unknown_setting_names_the_nearest_of_every_section(key, nearest):
    with pytest.raises(ValueError) as raised:
        AppConfig.from_args({key: 1})
    message = str(raised.value)
    assert message.startswith(f"invalid raylm app args: {key}: unknown setting; known: [")
    assert nearest in message and "docs/configuration.md" in message


@pytest.mark.slow
def test_the_check_names_nodes_whose_ray_start_lacks_the_keys_variable(ray_cluster, monkeypatch):
    """The shell has the variable, the cluster (started before it was set) does not: Serve would
    build the app there and fail, so the check says so, unless the app's runtime_env gives it."""
    import ray

    from deploy.__main__ import cluster_env_problems
    from deploy.check import nodes_lacking

    [node] = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
    monkeypatch.setenv("RAYLM_CHECK_TEST_KEYS", '{"k": {"tenant": "t"}}')
    fleet = FleetConfig.from_args({"api_keys_env": "RAYLM_CHECK_TEST_KEYS"})
    assert nodes_lacking(["PATH", "RAYLM_CHECK_TEST_KEYS"]) == {node: ["RAYLM_CHECK_TEST_KEYS"]}
    assert cluster_env_problems(fleet, {}) == [
        f"api_keys_env: RAYLM_CHECK_TEST_KEYS is not set on node(s) {node} of the Ray cluster, "
        "where Serve may build the app (its tasks have the environment of `ray start` there, not "
        "this shell's; docs/operations.md#where-api_keys_env-is-read)"
    ]
    given = {"env_vars": {"RAYLM_CHECK_TEST_KEYS": "{}"}}
    assert cluster_env_problems(fleet, given) == []


@pytest.mark.slow
def test_serve_s_build_task_reports_a_bad_config_as_one_line_without_retrying(ray_cluster):
    """The task Serve's controller builds a config file's app in (serve run / serve deploy):
    build_app's error comes back as its result, the one line Serve shows after "Deploying app
    'x' failed with exception:", instead of a traceback raised and retried 3 times."""
    import ray
    from ray.serve._private.application_state import build_serve_application
    from ray.serve.schema import LoggingConfig

    ref = build_serve_application.remote(
        "deploy.app:build_app", "v1", "bad", {"max_num_seq": 8}, LoggingConfig(), None, {}, {}, {}
    )
    policy, deploy_args, error = ray.get(ref, timeout=120)
    assert policy is None and deploy_args is None
    assert error == (
        "invalid raylm app args: max_num_seq: unknown setting; known: ['max_num_seqs'] are the "
        "nearest (every setting: docs/configuration.md)"
    )


@pytest.mark.slow
def test_build_app_waits_placement_timeout_s_for_nodes_then_fails_naming_the_wait(ray_cluster):
    """With a timeout the build asks an autoscaler for the app's bundles and waits; none joins
    this cluster, so it fails saying how long it waited."""
    with pytest.raises(UnplaceableAppError) as raised:
        build_app({"num_replicas": 9, "placement_timeout_s": 1, "ingress_num_cpus": 0})
    assert str(raised.value) == (
        "the app needs {CPU: 9} in all (9 x {CPU: 1} (default) + 1 x {CPU: 0} (ingress)); "
        "the cluster has {CPU: 8} (waited 1s: placement_timeout_s)"
    )
