"""The app's args: one config tree, unknown keys and bad values rejected with the field's path."""

import functools
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from deploy.api_keys import ApiKeyProfile
from deploy.app import build_app
from deploy.autoscaling_args import AutoscalingArgs
from deploy.config import AppConfig
from settings import declared_settings


def test_defaults_are_the_embedded_model_on_a_cpu_bundle():
    cfg = AppConfig.from_args({})
    # device "auto" asks Ray for no GPU, so the replica sees none and runs on the CPU.
    assert cfg.engine.model == "default" and cfg.engine.device == "auto"
    assert cfg.scaling_options() == {"num_replicas": 1}
    assert cfg.placement_group_bundles() == [{"CPU": 1.0}]


def test_a_replica_reserves_a_bundle_per_rank_of_tensor_times_pipeline():
    cfg = AppConfig.from_args({"tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    bundles = cfg.placement_group_bundles()
    assert bundles[0] == {"CPU": cfg.replica_num_cpus} and len(bundles) == 1 + 4
    assert cfg.placement_group_strategy() == "STRICT_PACK"
    assert len(AppConfig.from_args({"pipeline_parallel_size": 3}).placement_group_bundles()) == 4


def test_a_served_replica_refuses_the_multiprocessing_executor():
    with pytest.raises(ValueError, match="distributed_executor_backend: 'mp'"):
        AppConfig.from_args({"distributed_executor_backend": "mp"})
    assert AppConfig.from_args({"distributed_executor_backend": "ray"}).engine.world_size == 1


def test_flat_keys_land_in_the_tree_where_they_are_declared():
    cfg = AppConfig.from_args(
        {
            "max_num_seqs": 7,
            "dtype": "bfloat16",
            "swap_min_computed_tokens": 9,
            "fair_output_weight": 3,
            "num_replicas": 2,
        }
    )
    assert cfg.engine.scheduler.max_num_seqs == 7 and cfg.engine.dtype == "bfloat16"
    assert cfg.engine.scheduler.swap_min_computed_tokens == 9
    assert cfg.engine.scheduler.fair_output_weight == 3.0 and cfg.num_replicas == 2


def test_optional_sections_say_the_same_as_flat_keys():
    flat = AppConfig.from_args({"max_num_seqs": 7, "dtype": "bfloat16", "policy": "fair"})
    nested = AppConfig.from_args(
        {
            "engine": {"dtype": "bfloat16", "scheduler": {"max_num_seqs": 7}},
            "scheduler": {"policy": "fair"},
        }
    )
    assert flat.engine == nested.engine


def test_a_bad_value_names_its_full_path():
    with pytest.raises(ValueError, match=r"engine\.scheduler\.max_num_seqs: must be >= 1"):
        AppConfig.from_args({"scheduler": {"max_num_seqs": 0}})
    with pytest.raises(ValueError, match=r"engine\.kv_cache_memory_gb: must be finite"):
        AppConfig.from_args({"kv_cache_memory_gb": float("nan")})
    with pytest.raises(ValueError, match=r"engine\.scheduler\.not_a_knob"):
        AppConfig.from_args({"engine": {"scheduler": {"not_a_knob": 1}}})


def test_the_configuration_page_table_is_generated_from_the_tree():
    from deploy.settings_doc import replace_table

    page = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    text = page.read_text()
    assert replace_table(text) == text, (
        "run: python -m deploy.settings_doc --write docs/configuration.md"
    )


@pytest.mark.parametrize(
    "args, field",
    [
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
        (
            {"router": "fleet", "router_kwargs": {"router_policy": "dice"}},
            "router_kwargs.*router_policy",
        ),
        ({"router": "fleet", "router_kwargs": {"imbalance": 3}}, "router_kwargs.*imbalance"),
        ({"router": "power_of_two", "router_kwargs": {"imbalance_threshold": 3}}, "router_kwargs"),
        ({"omp_spin_count": -1}, "omp_spin_count"),
        ({"omp_spin_count": 2**64}, "omp_spin_count"),
        ({"omp_spin_count": float("nan")}, "omp_spin_count"),
        ({"omp_spin_count": "short"}, "omp_spin_count"),
        ({"process_niceness": -21}, "process_niceness"),
        ({"process_niceness": 2**64}, "process_niceness"),
        ({"process_niceness": float("nan")}, "process_niceness"),
        ({"stream_interval": 0}, "stream_interval"),
        ({"stream_interval": 2**64}, "stream_interval"),
        ({"stream_interval": 2.5}, "stream_interval"),
        ({"stream_interval": -1}, "stream_interval"),
        ({"stream_interval": float("nan")}, "stream_interval"),
        ({"stream_interval": 10**9}, "stream_interval"),
        ({"expert_parallel": "yes"}, "expert_parallel"),
        ({"expert_parallel": 2**64}, "expert_parallel"),
        ({"expert_parallel": -1}, "expert_parallel"),
        ({"expert_parallel": float("nan")}, "expert_parallel"),
        ({"expert_parallel": "x" * 10_000_000}, "expert_parallel"),
    ],
)
def test_bad_values_name_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        AppConfig.from_args(args)


def test_the_spin_count_reaches_the_replica_process_environment():
    assert (
        "runtime_env" not in AppConfig.from_args({}).replica_actor_options()
    )  # libgomp's own default
    options = AppConfig.from_args({"omp_spin_count": 3000}).replica_actor_options()
    assert options["runtime_env"] == {"env_vars": {"GOMP_SPINCOUNT": "3000"}}


def test_unknown_keys_are_rejected_not_ignored():
    with pytest.raises(ValueError, match="tensor_parallel: unknown setting"):
        AppConfig.from_args({"tensor_parallel": 2})


def test_build_app_stops_on_a_bad_arg_with_the_field_named():
    with pytest.raises(ValueError, match="max_model_len"):
        build_app({"max_model_len": -5})


def test_tensor_parallel_replica_gets_one_bundle_per_worker():
    cfg = AppConfig.from_args({"device": "cuda", "tensor_parallel_size": 2, "worker_num_cpus": 2})
    assert cfg.placement_group_bundles() == [
        {"CPU": 1.0},
        {"CPU": 2.0, "GPU": 1.0},
        {"CPU": 2.0, "GPU": 1.0},
    ]
    # Serve places the replica actor in the first bundle: its resources must fit there.
    assert cfg.replica_actor_options() == {"num_cpus": 1.0, "num_gpus": 0.0}


def test_one_default_for_each_setting_across_serving_and_offline():
    from engine.config import EngineConfig

    assert AppConfig.from_args({}).engine.scheduler == EngineConfig().scheduler


def test_single_gpu_replica_runs_its_worker_in_process():
    cfg = AppConfig.from_args({"device": "cuda"})
    assert cfg.placement_group_bundles() == [{"CPU": 1.0, "GPU": 1.0}]
    assert cfg.replica_actor_options() == {"num_cpus": 1.0, "num_gpus": 1.0}


def test_autoscaling_becomes_serve_autoscaling_config():
    cfg = AppConfig.from_args(
        {"autoscaling": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}}
    )
    opts = cfg.scaling_options()
    assert opts["num_replicas"] == "auto"
    assert opts["autoscaling_config"]["max_replicas"] == 4
    assert opts["autoscaling_config"]["target_ongoing_requests"] == 8


def test_router_choice_maps_to_request_router_config():
    assert (
        AppConfig.from_args({"router": "power_of_two"}).request_router_config() is None
    )  # Serve's own
    assert (
        AppConfig.from_args({}).request_router_config()["request_router_class"]
        == "cluster.serve_router.FleetRouter"
    )
    fleet = AppConfig.from_args(
        {"router": "fleet", "router_kwargs": {"router_policy": "least_loaded"}}
    )
    rc = fleet.request_router_config()
    assert rc["request_router_class"] == "cluster.serve_router.FleetRouter"
    assert rc["request_router_kwargs"] == {"router_policy": "least_loaded"}


def test_deploy_yaml_args_build_the_two_deployments():
    spec = yaml.safe_load(Path("deploy.yaml").read_text())
    app = build_app(spec["applications"][0]["args"])
    ingress = app._bound_deployment
    (replica_app,) = ingress.init_args[1]  # one model: one replica deployment
    replica = replica_app._bound_deployment
    assert ingress.name == "OpenAIIngress"
    assert replica.name == "LLMReplica"
    assert replica._deployment_config.num_replicas == 1
    assert replica._replica_config.placement_group_bundles == [
        {"CPU": 2.0}
    ]  # both cores for the engine
    assert ingress._replica_config.ray_actor_options["num_cpus"] == 0


def test_api_keys_come_from_an_environment_variable_named_in_the_args(monkeypatch):
    monkeypatch.setenv("KEYS_FOR_TEST", '{"k1": {"tenant": "team-a", "max_priority": 5}}')
    cfg = AppConfig.from_args({"api_keys_env": "KEYS_FOR_TEST"})
    assert (
        cfg.key_profiles()["k1"].tenant == "team-a" and cfg.key_profiles()["k1"].max_priority == 5
    )
    assert "k1" not in str(cfg.summary())  # what the app logs holds no key
    monkeypatch.setenv("KEYS_FOR_TEST", "not json")
    with pytest.raises(ValueError, match="api_keys_env: KEYS_FOR_TEST must hold") as raised:
        AppConfig.from_args({"api_keys_env": "KEYS_FOR_TEST"})
    assert "not json" not in str(raised.value)
    with pytest.raises(ValueError, match="NOT_SET_ANYWHERE is not set"):
        AppConfig.from_args({"api_keys_env": "NOT_SET_ANYWHERE"})


def test_the_default_queue_limit_follows_replica_capacity():
    assert AppConfig.from_args({"max_ongoing_requests": 8, "num_replicas": 3}).queue_limit() == 24
    assert (
        AppConfig.from_args({"max_ongoing_requests": 8, "max_queued_requests": -1}).queue_limit()
        == -1
    )


def test_an_app_exposed_beyond_loopback_needs_a_key_or_an_explicit_waiver(monkeypatch):
    from deploy.app import check_exposure

    open_app = AppConfig.from_args({})
    check_exposure("127.0.0.1", open_app)
    with pytest.raises(ValueError, match="api_keys: Serve's host is unknown"):
        check_exposure(None, open_app)  # a lookup that failed never waives the keys
    check_exposure(None, AppConfig.from_args({"api_key": "k"}))
    with pytest.raises(ValueError, match="api_keys: Serve listens on serving.example"):
        check_exposure("serving.example", open_app)
    check_exposure("serving.example", AppConfig.from_args({"api_key": "k"}))
    check_exposure("serving.example", AppConfig.from_args({"allow_unauthenticated": True}))


def test_serve_default_host_is_the_loopback_the_exposure_check_assumes():
    from ray.serve.config import HTTPOptions

    from deploy.app import SERVE_DEFAULT_HOST

    assert HTTPOptions().host == SERVE_DEFAULT_HOST


def test_a_replica_runs_as_many_torch_threads_as_its_bundle_reserves():
    from deploy.config import AppConfig

    assert AppConfig.from_args({"replica_num_cpus": 2}).engine.cpu_threads == 2
    assert AppConfig.from_args({"replica_num_cpus": 0.5}).engine.cpu_threads == 1  # at least one
    assert (
        AppConfig.from_args({"replica_num_cpus": 4, "cpu_threads": 1}).engine.cpu_threads == 1
    )  # explicit wins
    shipped = yaml.safe_load(Path("deploy.yaml").read_text())["applications"][0]["args"]
    assert (
        AppConfig.from_args(shipped).engine.cpu_threads == 2
    )  # both cores of the 2-core dev machine
    # ... at the priority of the client and the node's other processes, not Ray's nice 15
    assert AppConfig.from_args(shipped).engine.process_niceness == 0


def test_the_routing_stats_period_is_the_one_the_replicas_report_at():
    from router.stats import ROUTING_STATS_PERIOD_S

    config = AppConfig.from_args({}).request_router_config()
    assert config["request_routing_stats_period_s"] == ROUTING_STATS_PERIOD_S


# ---- every key of the tree, fuzzed: taken as given, or refused naming its path
HUGE = "x" * 10_000_000
HOSTILE = [2**64, -(2**64), -1, 0, math.nan, math.inf, 10**400, 1e308, HUGE, None, True, [], {}]


def _keys() -> list[tuple[dict, str, Callable[[AppConfig], object]]]:
    """(args that set one key to VALUE, the path errors name, where the value lands)."""
    from engine.config import EngineConfig
    from router.config import RoutingConfig
    from scheduler.config import SchedulerConfig

    def at(*names: str) -> Callable[[AppConfig], object]:
        return lambda cfg: functools.reduce(getattr, names, cfg)

    keys = [({f.name: VALUE}, f.name, at(f.name)) for f in declared_settings(AppConfig)]
    keys += [
        ({f.name: VALUE}, f"engine.{f.name}", at("engine", f.name))
        for f in declared_settings(EngineConfig)
    ]
    keys += [
        ({f.name: VALUE}, f"engine.scheduler.{f.name}", at("engine", "scheduler", f.name))
        for f in declared_settings(SchedulerConfig)
    ]
    keys += [
        ({"engine": VALUE}, "engine", at("engine")),
        ({"scheduler": VALUE}, "engine.scheduler", at("engine", "scheduler")),
    ]
    keys += [
        (
            {"router_kwargs": {f.name: VALUE}},
            f"router_kwargs.{f.name}",
            lambda cfg, n=f.name: cfg.router_kwargs[n],
        )
        for f in declared_settings(RoutingConfig)
    ]
    keys += [
        ({"autoscaling": {f.name: VALUE}}, f"autoscaling.{f.name}", at("autoscaling", f.name))
        for f in declared_settings(AutoscalingArgs)
    ]
    keys += [
        (
            {"api_keys": {"k": {"tenant": "t", f.name: VALUE}}},
            f"api_keys[0].{f.name}",
            lambda cfg, n=f.name: getattr(cfg.api_keys["k"], n),
        )
        for f in declared_settings(ApiKeyProfile)
    ]
    return keys


VALUE = object()  # where _keys puts the fuzzed value
KEYS = _keys()


def _with(args: dict, value: object) -> dict:
    return {
        k: _with(v, value) if isinstance(v, dict) else (value if v is VALUE else v)
        for k, v in args.items()
    }


def _taken_or_refused_by_path(key: tuple, value: object) -> None:
    args, path, landed = key
    try:
        config = AppConfig.from_args(_with(args, value))
    except ValueError as exc:
        message = str(exc)
        assert message.startswith(f"invalid raylm app args: {path}"), message[:300]
        assert len(message) < 2000
        return
    kept = landed(config)
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        assert type(kept) in (int, float, str)
        assert kept == (float(value) if isinstance(kept, float) else value)  # an int for a float


def test_hostile_values_of_every_key_are_taken_or_refused_naming_its_path():
    for key in KEYS:
        for value in HOSTILE:
            _taken_or_refused_by_path(key, value)


@settings(deadline=None)
@given(st.sampled_from(KEYS), st.one_of(st.integers(), st.floats(), st.text(max_size=8)))
def test_any_value_of_any_key_is_taken_or_refused_naming_its_path(key, value):
    _taken_or_refused_by_path(key, value)
