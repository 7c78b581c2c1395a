"""The app's args: one pydantic model, unknown keys and bad values rejected with the field named."""
import pytest
import yaml

from deploy.app import build_app
from deploy.config import AppConfig


def test_defaults_are_the_embedded_cpu_model():
    cfg = AppConfig.from_args({})
    assert cfg.model == "default" and cfg.device == "cpu"
    assert cfg.scaling_options() == {"num_replicas": 1}
    assert cfg.placement_group_bundles() == [{"CPU": 1.0}]


@pytest.mark.parametrize("args, field", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"num_replicas": 0}, "num_replicas"),
    ({"policy": "lottery"}, "policy"),
    ({"device": "tpu"}, "device"),
    ({"max_num_seqs": "many"}, "max_num_seqs"),
    ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "autoscaling"),
    ({"autoscaling": {"max_replicas": 2, "target_load": 3}}, "autoscaling.target_load"),
    ({"num_replicas": 2, "autoscaling": {"max_replicas": 4}}, "num_replicas"),
    ({"preemption_mode": "swap"}, "num_cpu_blocks"),
    ({"dtype": "auto"}, "dtype"),
    ({"watermark": 1.5}, "watermark"),
    ({"router": "fleet", "router_kwargs": {"router_policy": "dice"}}, "router_kwargs.*router_policy"),
    ({"router": "fleet", "router_kwargs": {"imbalance": 3}}, "router_kwargs.*imbalance"),
    ({"router": "power_of_two", "router_kwargs": {"imbalance_threshold": 3}}, "router_kwargs"),
])
def test_bad_values_name_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        AppConfig.from_args(args)


def test_unknown_keys_are_rejected_not_ignored():
    with pytest.raises(ValueError, match="tensor_parallel\\b.*Extra inputs are not permitted"):
        AppConfig.from_args({"tensor_parallel": 2})


def test_build_app_stops_on_a_bad_arg_with_the_field_named():
    with pytest.raises(ValueError, match="max_model_len"):
        build_app({"max_model_len": -5})


def test_tensor_parallel_replica_gets_one_bundle_per_worker():
    cfg = AppConfig.from_args({"device": "cuda", "tensor_parallel_size": 2, "worker_num_cpus": 2})
    assert cfg.placement_group_bundles() == [{"CPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}]
    # Serve places the replica actor in the first bundle: its resources must fit there.
    assert cfg.replica_actor_options() == {"num_cpus": 1.0, "num_gpus": 0.0}


def test_single_gpu_replica_runs_its_worker_in_process():
    cfg = AppConfig.from_args({"device": "cuda"})
    assert cfg.placement_group_bundles() == [{"CPU": 1.0, "GPU": 1.0}]
    assert cfg.replica_actor_options() == {"num_cpus": 1.0, "num_gpus": 1.0}


def test_autoscaling_becomes_serve_autoscaling_config():
    cfg = AppConfig.from_args({"autoscaling": {"min_replicas": 1, "max_replicas": 4,
                                               "target_ongoing_requests": 8}})
    opts = cfg.scaling_options()
    assert opts["num_replicas"] == "auto"
    assert opts["autoscaling_config"]["max_replicas"] == 4
    assert opts["autoscaling_config"]["target_ongoing_requests"] == 8


def test_router_choice_maps_to_request_router_config():
    assert AppConfig.from_args({"router": "power_of_two"}).request_router_config() is None  # Serve's own
    assert AppConfig.from_args({}).request_router_config()["request_router_class"] == "cluster.router.FleetRouter"
    fleet = AppConfig.from_args({"router": "fleet", "router_kwargs": {"router_policy": "least_loaded"}})
    rc = fleet.request_router_config()
    assert rc["request_router_class"] == "cluster.router.FleetRouter"
    assert rc["request_router_kwargs"] == {"router_policy": "least_loaded"}


def test_deploy_yaml_args_build_the_two_deployments():
    spec = yaml.safe_load(open("deploy.yaml"))
    app = build_app(spec["applications"][0]["args"])
    ingress = app._bound_deployment
    replica = ingress.init_args[1]._bound_deployment
    assert ingress.name == "OpenAIIngress"
    assert replica.name == "LLMReplica"
    assert replica._deployment_config.num_replicas == 1
    assert replica._replica_config.placement_group_bundles == [{"CPU": 1.0}]
