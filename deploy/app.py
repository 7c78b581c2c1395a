"""build_app: the import_path of deploy.yaml (deploy.app:build_app)."""

from __future__ import annotations

import logging
from typing import Any

from ray.serve import Application
from ray.serve.exceptions import RayServeException

from cluster.placement import UnplaceableError, spread_warning, wait_until_placeable
from deploy.check import wait_for_capacity
from deploy.config import AppConfig
from deploy.fleet_config import FleetConfig
from deploy.hub import pinned
from deploy.ingress import OpenAIIngress

logger = logging.getLogger(__name__)


class AppConfigError(RayServeException, ValueError):
    """A bad app config. As a RayServeException, Serve's build task reports its message as it is:
    one line, no traceback, no retry of the build."""


class UnplaceableAppError(UnplaceableError, RayServeException):
    """An app the cluster cannot hold, reported by Serve as one line."""


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# Where serve.run starts Serve when nothing started it before (ray.serve.config.HTTPOptions).
SERVE_DEFAULT_HOST = "127.0.0.1"


def check_exposure(host: str | None, config: AppConfig | FleetConfig) -> None:
    """An app reachable beyond this machine needs keys for every model, unless
    allow_unauthenticated says otherwise.

    host: where Serve's proxies listen; None when that could not be read, which counts as beyond
    loopback (an app must not go keyless because a lookup failed).
    """
    fleet = _fleet(config)
    if host in LOOPBACK_HOSTS or fleet.ingress.allow_unauthenticated:
        return
    open_models = [m.model_name for m in fleet.models if not m.key_profiles()]
    if not open_models:
        return
    where = f"Serve listens on {host}, beyond loopback" if host else "Serve's host is unknown"
    what = "the app has" if fleet.single else f"model {open_models[0]!r} has"
    raise ValueError(
        f"api_keys: {where}, and {what} no api_key, api_keys or api_keys_env; set one, or "
        "allow_unauthenticated: true"
    )


def _serve_http_host() -> str | None:
    """The host Serve's proxies bind (None if it cannot be read). Where Ray or Serve is not running
    yet, serve.run will start Serve on its default host, loopback."""
    import ray

    if not ray.is_initialized():
        return SERVE_DEFAULT_HOST
    try:
        from ray.serve.context import _get_global_client

        client = _get_global_client(raise_if_no_controller_running=False)
        return client.http_config.host if client is not None else SERVE_DEFAULT_HOST
    except Exception:
        logger.warning("cannot read the host Serve listens on", exc_info=True)
        return None


def check_placement(config: AppConfig) -> None:
    """Warn where a replica's ranks may leave one node; on a running cluster, fail (after
    placement_timeout_s for an autoscaler) where no node can hold a replica's bundles, instead of
    deploying replicas that wait for a placement group forever."""
    import ray

    strategy = config.placement_group_strategy()
    warning = spread_warning(strategy, config.engine.tensor_parallel_size)
    if warning is not None:
        logger.warning("%s", warning)
    if ray.is_initialized():  # else only the app is built here (serve build), for elsewhere
        wait_until_placeable(config.placement_group_bundles(), strategy, config.placement_timeout_s)


def build_app(args: dict[str, Any] | None = None) -> Application:
    """The Serve application for deploy.yaml's `args`; a bad arg raises AppConfigError (a
    ValueError) naming the field, an app the cluster cannot hold UnplaceableAppError (an
    UnplaceableError) naming what it needs and what the cluster has. A hub model is pinned to its
    commit (deploy/hub.py), so a missing one fails here."""
    try:
        fleet = FleetConfig.from_args(args)
        check_exposure(_serve_http_host(), fleet)
        fleet = pinned_fleet(fleet)  # may ask the hub: after the checks that ask nobody
        for model in fleet.models:
            check_placement(model)
        _check_capacity(fleet)
    except UnplaceableError as exc:
        raise UnplaceableAppError(str(exc)) from None
    except ValueError as exc:
        raise AppConfigError(str(exc)) from None
    return application(fleet)


def pinned_fleet(fleet: FleetConfig) -> FleetConfig:
    """Each hub model pinned to the snapshot directory of its commit (deploy/hub.py)."""
    models = [pinned(model) for model in fleet.models]
    ingress = models[0] if fleet.single else fleet.ingress
    return FleetConfig(ingress, models, fleet.single)


def _check_capacity(fleet: FleetConfig) -> None:
    import ray

    if ray.is_initialized():  # else only the app is built here (serve build), for elsewhere
        wait_for_capacity(fleet)


def application(config: AppConfig | FleetConfig) -> Application:
    """The deployments for a validated config: the ingress and each model's replicas (what
    build_app returns, without its checks against the cluster)."""
    fleet = _fleet(config)
    replicas = [
        replica_deployment(model, fleet.deployment_name(i)) for i, model in enumerate(fleet.models)
    ]
    prefills = {
        model.model_name: replica_deployment(
            model, f"{fleet.deployment_name(i)}-prefill", "prefill"
        )
        for i, model in enumerate(fleet.models)
        if model.disaggregation is not None
    }
    ingress = fleet.ingress
    logger.info("raylm app: %s", [model.summary() for model in fleet.models])
    return OpenAIIngress.options(  # type: ignore[attr-defined]
        num_replicas=ingress.ingress_replicas,
        ray_actor_options={"num_cpus": ingress.ingress_num_cpus},
        # A redeployed ingress lets its streams run to their deadline: its requests cannot move.
        graceful_shutdown_timeout_s=max(m.request_timeout_s for m in fleet.models),
        # The ingress only forwards and streams: it must never be the bottleneck on concurrency.
        max_ongoing_requests=max(1024, sum(m.max_ongoing_requests * 4 for m in fleet.models)),
    ).bind(fleet, replicas, prefills)


def _fleet(config: AppConfig | FleetConfig) -> FleetConfig:
    return config if isinstance(config, FleetConfig) else FleetConfig(config, [config])


def replica_deployment(config: AppConfig, name: str, role: str = "decode") -> Any:
    """One model's LLMReplica deployment, bound to its engine settings; a disaggregated model has
    two, its decode replicas (named as a colocated model's) and its prefill replicas."""
    # Here, not at the top: the replica's module imports the engine, torch and the model code,
    # seconds that only building the app pays; the ingress's replicas import deploy.ingress alone.
    from cluster.disagg_replica import DisaggPhase
    from cluster.replica import LLMReplica

    disagg = config.disaggregation
    replica_options = _replica_options(config)
    # mypy keeps a decorated class's own type (python/mypy#3135); @serve.deployment made these
    # Deployments, which have options().
    slo = config.autoscaling.slo if config.autoscaling is not None else None
    if disagg is None:
        return LLMReplica.options(name=name, **replica_options).bind(  # type: ignore[attr-defined]
            config.engine, slo, config.model_name
        )
    replica_options["num_replicas"] = (
        disagg.prefill_replicas if role == "prefill" else disagg.decode_replicas
    )
    phase = DisaggPhase(role, disagg.transfer_timeout_s, disagg.kv_transport)
    return LLMReplica.options(name=name, **replica_options).bind(  # type: ignore[attr-defined]
        config.phase_engine(role), slo, config.model_name, phase
    )


def _replica_options(config: AppConfig) -> dict[str, Any]:
    """Serve's deployment options of a model's replicas: scaling, resources, queue bounds,
    health checks and the request router."""
    replica_options: dict[str, Any] = {
        **config.scaling_options(),
        "ray_actor_options": config.replica_actor_options(),
        "placement_group_bundles": config.placement_group_bundles(),
        "placement_group_strategy": config.placement_group_strategy(),
        "max_ongoing_requests": config.max_ongoing_requests,
        "max_queued_requests": config.queue_limit(),
        # The ingress's handle raises BackPressureError carrying this status (and Retry-After).
        "backpressure_config": config.backpressure_config(),
        # Loading weights (and a first GGUF conversion) takes longer than Serve's defaults expect.
        "health_check_timeout_s": 120,
        # A failed or stalled engine fails LLMReplica.check_health; its requests already left it.
        "health_check_period_s": config.health_check_period_s,
        "graceful_shutdown_timeout_s": config.graceful_shutdown_timeout_s,
    }
    router_config = config.request_router_config()
    if router_config is not None:
        replica_options["request_router_config"] = router_config
    return replica_options
