"""ray_config.yaml validates as `ray up` would; every Serve config we ship builds its app."""

import ipaddress
import re
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.schema import ServeDeploySchema

from deploy.app import application, check_exposure
from deploy.config import AppConfig
from deploy.fleet_config import FleetConfig

ROOT = Path(__file__).resolve().parents[2]
SERVE_CONFIGS = [ROOT / "deploy.yaml"] + sorted((ROOT / "deploy" / "examples").glob("*.yaml"))


def test_ray_config_validates_like_ray_up():
    config = prepare_config(yaml.safe_load((ROOT / "ray_config.yaml").read_text()))
    validate_config(config)
    nodes = config["available_node_types"]
    head = nodes[config["head_node_type"]]
    workers = [n for name, n in nodes.items() if name != config["head_node_type"]]
    assert "GPU" not in head["resources"] and head["max_workers"] == 0
    assert workers and all(0 <= w["min_workers"] <= w["max_workers"] for w in workers)
    assert "g5" in workers[0]["node_config"]["InstanceType"]  # GPU instances
    assert any("pip install" in c and "-e" in c for c in config["setup_commands"])


@pytest.fixture(autouse=True)
def _example_keys(monkeypatch):
    monkeypatch.setenv("RAYLM_API_KEYS", '{"k-team-a": {"tenant": "team-a", "max_priority": 0}}')


def test_ray_dashboard_and_job_api_stay_on_loopback():
    config = yaml.safe_load((ROOT / "ray_config.yaml").read_text())
    start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in start
    # Every host flag names a loopback address (none is the wildcard that listens everywhere).
    hosts = re.findall(r"--[\w-]*host=(\S+)", start)
    assert hosts and all(ipaddress.ip_address(h).is_loopback for h in hosts), hosts


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_a_config_that_listens_beyond_loopback_requires_a_key(path):
    spec = yaml.safe_load(path.read_text())
    if spec.get("http_options", {}).get("host", "127.0.0.1") in ("127.0.0.1", "localhost", "::1"):
        return
    for app in spec["applications"]:
        for model in FleetConfig.from_args(app["args"]).models:
            assert model.key_profiles(), path.name


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_serve_config_validates_and_builds(path):
    spec = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    for app in spec.applications:
        assert app.import_path == "deploy.app:build_app"
        # build_app's checks, but placement's: this machine has none of the GPU nodes.
        config = FleetConfig.from_args(app.args)
        check_exposure(spec.http_options.host, config)
        application(config)


@pytest.mark.parametrize("name", ["gpu_tp2.yaml", "gpu_dp_tp2.yaml"])
def test_gpu_examples_put_two_gpu_workers_of_a_replica_on_one_node(name):
    spec = yaml.safe_load((ROOT / "deploy" / "examples" / name).read_text())
    args = spec["applications"][0]["args"]
    app = application(AppConfig.from_args(args))
    replica = app._bound_deployment.init_args[1][0]._bound_deployment
    assert args["tensor_parallel_size"] == 2
    bundles = replica._replica_config.placement_group_bundles
    assert bundles == [{"CPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    assert replica._replica_config.placement_group_strategy == "STRICT_PACK"
