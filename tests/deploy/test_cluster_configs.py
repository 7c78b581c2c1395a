"""The cluster-launcher configs (ray_config.yaml for AWS, deploy/clusters/gcp.yaml) validate as
`ray up` would, offline; every Serve config we ship builds its app."""

import ipaddress
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray._private.ray_constants import PROMETHEUS_SERVICE_DISCOVERY_FILE
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.schema import ServeDeploySchema

from deploy.app import application, check_exposure
from deploy.config import AppConfig
from deploy.fleet_config import FleetConfig
from tests.deploy.test_install import SETUP_KEYS, pip_installs, requirements

ROOT = Path(__file__).resolve().parents[2]
SERVE_CONFIGS = [ROOT / "deploy.yaml"] + sorted((ROOT / "deploy" / "examples").glob("*.yaml"))
CLUSTER_CONFIGS = [ROOT / "ray_config.yaml", ROOT / "deploy" / "clusters" / "gcp.yaml"]
# provider -> (the node_config key naming the machine, the GPU machine family)
GPU_MACHINES = {"aws": ("InstanceType", "g5."), "gcp": ("machineType", "g2-")}
METRICS_PORT = re.compile(r"--metrics-export-port=(\d+)")


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
def test_cluster_config_validates_like_ray_up(path):
    config = prepare_config(yaml.safe_load(path.read_text()))
    validate_config(config)
    nodes = config["available_node_types"]
    head = nodes[config["head_node_type"]]
    workers = [n for name, n in nodes.items() if name != config["head_node_type"]]
    assert "GPU" not in head["resources"] and head["max_workers"] == 0
    assert workers and all(0 <= w["min_workers"] <= w["max_workers"] for w in workers)
    key, family = GPU_MACHINES[config["provider"]["type"]]
    assert workers[0]["node_config"][key].startswith(family)  # GPU machines
    assert any("pip install" in c and "-e" in c for c in config["setup_commands"])


@pytest.fixture(autouse=True)
def _example_keys(monkeypatch):
    monkeypatch.setenv("RAYLM_API_KEYS", '{"k-team-a": {"tenant": "team-a", "max_priority": 0}}')


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
def test_ray_dashboard_and_job_api_stay_on_loopback(path):
    config = yaml.safe_load(path.read_text())
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


def _cluster(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_the_validator_refuses_a_misspelt_launcher_setting():
    """The validation above is Ray's own schema, not a formality: a typo fails it, by name."""
    config = _cluster(CLUSTER_CONFIGS[0])
    config["rsync_exclud"] = config.pop("rsync_exclude")
    with pytest.raises(jsonschema.ValidationError, match="rsync_exclud"):
        validate_config(prepare_config(config))


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
def test_cluster_config_pins_a_current_ray_gpu_image(path):
    """Ray's image for the Ray the setup installs, on a Python raylm supports, over an Ubuntu 22.04
    or newer host: without an image the launcher falls back to its Ubuntu 18.04 AMI (glibc 2.27,
    Python 3.7), where neither torch 2.13's manylinux_2_28 wheels nor raylm install."""
    config = _cluster(path)
    image = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py3(\d+)-gpu", config["docker"]["image"])
    assert image, config["docker"]["image"]
    assert f"'ray[serve]=={image[1]}'" in " ".join(config["setup_commands"])
    assert int(image[2]) >= 10
    for node in config["available_node_types"].values():
        release = re.search(r"ubuntu-(\d\d)\.?04", str(node["node_config"]))
        assert release and int(release[1]) >= 22, node["node_config"]


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
def test_cluster_sync_leaves_the_local_state_behind(path):
    config = _cluster(path)
    assert {".venv", ".git", "__pycache__", "*.egg-info"} <= set(config["rsync_exclude"])
    assert ".gitignore" in config["rsync_filter"]


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
def test_every_node_starts_ray_with_the_secrets_file(path):
    """HF_TOKEN and the API keys reach every Ray task (the app's build among them) through the
    environment of `ray start`, from a file synced from outside the checkout."""
    config = _cluster(path)
    assert config["file_mounts"]["~/.raylm"] == "~/.raylm"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        start = config[key][-1]
        assert "set -a && . ~/.raylm/cluster.env && set +a &&" in start
        assert start.index("cluster.env") < start.index("ray start")


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
def test_cluster_setup_installs_what_serving_needs_from_wheels(path):
    """The project with its gpu extra alone (never test, bench or lint), wheels only, and on the
    head the cloud SDK its autoscaler launches workers with."""
    config = _cluster(path)
    installs = pip_installs([c for key in SETUP_KEYS for c in config.get(key) or []])
    assert installs and all("--only-binary=:all:" in args for args in installs)
    project = [r for args in installs for r in requirements(args) if r.startswith(".")]
    assert project == [".[gpu]"]
    sdk = {"aws": "boto3", "gcp": "google-api-python-client"}[config["provider"]["type"]]
    assert any(sdk in command for command in config["head_setup_commands"])


def test_every_node_exports_metrics_where_prometheus_scrapes():
    """One fixed metrics port on every launched node and in every example's instructions; the
    shipped scrape config reads Ray's node list and the ingress's /metrics on Serve's port."""
    ports = set()
    for path in CLUSTER_CONFIGS:
        config = _cluster(path)
        for key in ("head_start_ray_commands", "worker_start_ray_commands"):
            found = METRICS_PORT.findall(" ".join(config[key]))
            assert len(found) == 1, (path.name, key)
            ports |= set(found)
    for path in sorted((ROOT / "deploy" / "examples").glob("*.yaml")):
        assert METRICS_PORT.findall(path.read_text()), path.name
        ports |= set(METRICS_PORT.findall(path.read_text()))
    assert ports == {"8080"}
    jobs = {
        job["job_name"]: job
        for job in _cluster(ROOT / "deploy" / "prometheus.yml")["scrape_configs"]
    }
    discovery = f"/tmp/ray/session_latest/{PROMETHEUS_SERVICE_DISCOVERY_FILE}"
    assert jobs["ray"]["file_sd_configs"] == [{"files": [discovery]}]
    ingress = jobs["raylm-ingress"]
    assert ingress["metrics_path"] == "/metrics"  # tests/cluster_launch scrapes it from a launch
    http_ports = {_cluster(p).get("http_options", {}).get("port", 8000) for p in SERVE_CONFIGS}
    assert ingress["static_configs"] == [{"targets": [f"127.0.0.1:{p}" for p in http_ports]}]
