"""The app's arguments (deploy.yaml `args:`): serving, routing and resources, over the engine's
tree.

The tree is AppConfig > EngineConfig > SchedulerConfig, each setting declared once. deploy.yaml
may name any setting flat (`max_num_seqs: 32`) or in optional `engine:` / `scheduler:` sections;
the flat keys map onto the tree by a mapping generated from the dataclasses' fields.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, InstanceOf, ValidationError, model_validator

from engine.config import SCHEDULER_KEYS, EngineConfig
from scheduler.request import MAX_PRIORITY, MAX_TENANT_CHARS
from scheduler.settings import declared_settings

ROUTERS = {
    "power_of_two": None,  # Serve's built-in PowerOfTwoChoicesRequestRouter
    "fleet": "cluster.serve_router.FleetRouter",  # load + prefix affinity (router/)
}
ENGINE_KEYS = tuple(f.name for f in declared_settings(EngineConfig))


class AutoscalingArgs(BaseModel):
    """Replica autoscaling on ongoing requests per replica (Serve's autoscaling_config subset)."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=1, ge=1)
    initial_replicas: int | None = Field(default=None, ge=0)
    target_ongoing_requests: float = Field(default=16.0, gt=0)
    upscale_delay_s: float = Field(default=30.0, ge=0)
    downscale_delay_s: float = Field(default=600.0, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingArgs:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})"
            )
        return self


class ApiKeyProfile(BaseModel):
    """Who a key belongs to: its tenant (the fair policy's unit) and its priority ceiling."""

    model_config = ConfigDict(extra="forbid")

    tenant: str = Field(min_length=1, max_length=MAX_TENANT_CHARS)
    # Lower is more urgent: a request asking for more urgency than this gets this.
    max_priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)


UNLIMITED_KEY = ApiKeyProfile(tenant="default", max_priority=-MAX_PRIORITY)


class AppConfig(BaseModel):
    """Everything `build_app` accepts. Unknown keys are errors (Serve would drop them silently)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), arbitrary_types_allowed=True)

    engine: InstanceOf[EngineConfig] = Field(
        default_factory=EngineConfig, description="model, parallelism, cache and scheduler settings"
    )
    served_model_name: str | None = Field(
        default=None,
        description="the name clients pass as `model` and `/v1/models` lists (unset: `model`)",
    )
    # Data parallelism: a fixed count or autoscaling, not both.
    num_replicas: int | None = Field(
        default=None, ge=1, description="data-parallel replicas, one engine each (unset: 1)"
    )
    autoscaling: AutoscalingArgs | None = Field(
        default=None,
        description="instead of `num_replicas`: "
        "`{min_replicas, max_replicas, initial_replicas, "
        "target_ongoing_requests, upscale_delay_s, downscale_delay_s}`",
    )
    # Routing across replicas and admission.
    router: Literal["fleet", "power_of_two"] = Field(
        default="fleet", description="`fleet` (load + prefix affinity) or Serve's `power_of_two`"
    )
    router_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="`fleet` router settings (router/config.py `RoutingConfig`)",
    )
    max_ongoing_requests: int = Field(
        default=256, ge=1, description="requests in flight at once per replica"
    )
    max_queued_requests: int | None = Field(
        default=None,
        ge=-1,
        description="queued per ingress beyond "
        "that; past it: `overload_status` (unset: max_ongoing_requests "
        "x replicas; -1: unbounded)",
    )
    overload_status: Literal[429, 503] = Field(
        default=503, description="HTTP status when the queues are full"
    )
    overload_retry_after_s: float = Field(
        default=1.0, gt=0, le=3600, description="sent as Retry-After"
    )
    request_timeout_s: float = Field(
        default=600.0,
        gt=0,
        le=86400,
        description="deadline of one request; "
        "past it the generation is aborted and its blocks freed (a request's "
        "`request_timeout_s` may shorten it)",
    )
    max_migrations: int = Field(
        default=3,
        ge=0,
        le=16,
        description="times one choice may resume on another replica after its replica failed",
    )
    health_check_period_s: float = Field(
        default=5.0,
        ge=0.1,
        le=600,
        description="how often Serve probes "
        "each replica; after 3 failed probes (a failed or stalled engine) it is "
        "replaced",
    )
    graceful_shutdown_timeout_s: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        description="on scale-down or "
        "redeploy, how long a replica lets in-flight requests finish "
        "before handing the rest to other replicas",
    )
    # Request limits at the ingress.
    max_request_body_bytes: int = Field(
        default=16 << 20, ge=1024, description="larger bodies get 413 before they are parsed"
    )
    max_sequences_per_request: int = Field(
        default=128, ge=1, le=4096, description="prompts x n of one request"
    )
    max_stop_string_chars: int = Field(
        default=1024, ge=1, description="longest stop string accepted"
    )
    grammar_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="longest a structured-output "
        "schema, regex or grammar may take to check; slower ones get 400",
    )
    # Resources and placement (one bundle for the replica, one per TP worker when TP > 1).
    replica_num_cpus: float = Field(default=1.0, ge=0, description="CPUs of the replica's bundle")
    worker_num_cpus: float = Field(
        default=1.0, ge=0, description="CPUs of each TP worker's bundle (TP > 1)"
    )
    placement_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        default="PACK", description="placement of a replica's bundles"
    )
    omp_spin_count: int | None = Field(
        default=None,
        ge=0,
        le=10**12,
        description="GOMP_SPINCOUNT of the replica's processes (TP workers "
        "inherit it): how long torch's OpenMP threads spin for work before they sleep. Long spins "
        "are fastest "
        "on cores of their own; when other processes take a core, the engine's threads share one "
        "and each "
        "spin is lost time (unset: libgomp's 300,000)",
    )
    ingress_num_cpus: float = Field(default=0.5, ge=0, description="CPUs of each ingress replica")
    ingress_replicas: int = Field(default=1, ge=1, description="OpenAI ingress replicas")
    # HTTP and tenants.
    api_key: str | None = Field(
        default=None, description="required as `Authorization: Bearer <key>` when set"
    )
    api_keys: dict[str, ApiKeyProfile] | None = Field(
        default=None,
        description="key -> `{tenant, max_priority}`: the `fair` policy's tenant and the most "
        "urgent `priority` that key may ask for come from the key, never from the request",
    )
    allow_unauthenticated: bool = Field(
        default=False,
        description="serve without keys although Serve "
        "listens beyond loopback (behind your own authenticating proxy)",
    )
    api_keys_env: str | None = Field(
        default=None,
        description="name of an environment variable holding `api_keys` as JSON (keeps the "
        "keys out of deploy.yaml and the Ray dashboard)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> AppConfig:
        if self.num_replicas is not None and self.autoscaling is not None:
            raise ValueError("num_replicas: set num_replicas or autoscaling, not both")
        if self.api_key == "":
            raise ValueError("api_key: must be non-empty when set")
        if self.api_keys_env is not None:
            self.api_keys = {**(self.api_keys or {}), **_keys_from_env(self.api_keys_env)}
        if self.api_keys is not None and any(not key for key in self.api_keys):
            raise ValueError("api_keys: keys must be non-empty")
        if self.engine.cpu_threads is None and self.engine.tensor_parallel_size == 1:
            # A CPU replica's torch threads default to the cores its bundle reserves, not to
            # whatever Ray's OMP_NUM_THREADS says (a fraction rounds down, at least one).
            self.engine = replace(self.engine, cpu_threads=max(1, int(self.replica_num_cpus)))
        if self.router == "fleet":
            from router.config import RoutingConfig  # pure policy code, no Ray

            try:
                RoutingConfig(**self.router_kwargs)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"router_kwargs: {exc}") from None
        elif self.router_kwargs:
            raise ValueError(
                f"router_kwargs: {self.router} takes none, got {sorted(self.router_kwargs)}"
            )
        return self

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> AppConfig:
        """Validate deploy.yaml args; the ValueError names every offending field by its path."""
        app, engine = _split_args(dict(args or {}))
        try:
            engine_config = EngineConfig.from_kwargs(**engine)
        except ValueError as exc:
            raise ValueError(f"invalid raylm app args: engine.{exc}") from None
        try:
            return cls.model_validate({**app, "engine": engine_config})
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or e['msg'].split(':', 1)[0]}: "
                f"{e['msg'].removeprefix('Value error, ')} (got {e.get('input')!r})"
                for e in exc.errors()
            )
            raise ValueError(f"invalid raylm app args: {problems}") from None

    @property
    def model_name(self) -> str:
        """The name clients pass as `model` and /v1/models lists."""
        return self.served_model_name or self.engine.model

    def key_profiles(self) -> dict[str, ApiKeyProfile]:
        """Every accepted key and whom it belongs to (empty: no authentication)."""
        profiles = dict(self.api_keys or {})
        if self.api_key is not None:
            profiles.setdefault(self.api_key, UNLIMITED_KEY)
        return profiles

    @property
    def use_gpu(self) -> bool:
        return self.engine.device.startswith("cuda")

    def placement_group_bundles(self) -> list[dict[str, float]]:
        """The replica's bundle first (Serve places the replica actor there), then one per TP
        worker."""
        gpu = {"GPU": 1.0} if self.use_gpu else {}
        if self.engine.tensor_parallel_size == 1:
            # The single worker runs inside the replica process.
            return [{"CPU": self.replica_num_cpus, **gpu}]
        worker = {"CPU": self.worker_num_cpus, **gpu}
        return [{"CPU": self.replica_num_cpus}] + [
            dict(worker) for _ in range(self.engine.tensor_parallel_size)
        ]

    def replica_actor_options(self) -> dict[str, Any]:
        first = self.placement_group_bundles()[0]
        options: dict[str, Any] = {"num_cpus": first["CPU"], "num_gpus": first.get("GPU", 0.0)}
        if self.omp_spin_count is not None:
            # libgomp reads it once, when torch loads: it must be in the process's environment from
            # the start.
            options["runtime_env"] = {"env_vars": {"GOMP_SPINCOUNT": str(self.omp_spin_count)}}
        return options

    def scaling_options(self) -> dict[str, Any]:
        if self.autoscaling is None:
            return {"num_replicas": self.num_replicas or 1}
        return {
            "num_replicas": "auto",
            "autoscaling_config": self.autoscaling.model_dump(exclude_none=True),
        }

    def queue_limit(self) -> int:
        """Requests an ingress queues for the replicas before it answers overload_status."""
        if self.max_queued_requests is not None:
            return self.max_queued_requests
        replicas = self.autoscaling.max_replicas if self.autoscaling else (self.num_replicas or 1)
        return self.max_ongoing_requests * replicas

    def backpressure_config(self) -> dict[str, Any]:
        return {"status_code": self.overload_status, "retry_after_s": self.overload_retry_after_s}

    def request_router_config(self) -> dict[str, Any] | None:
        router_class = ROUTERS[self.router]
        if router_class is None:
            return None
        return {
            "request_router_class": router_class,
            "request_router_kwargs": dict(self.router_kwargs),
            "request_routing_stats_period_s": 1.0,
        }

    def summary(self) -> dict[str, Any]:
        """What the app logs at start (no secrets)."""
        from dataclasses import asdict

        return {
            **self.model_dump(exclude={"api_key", "api_keys", "engine"}),
            "engine": asdict(self.engine),
        }


def _keys_from_env(name: str) -> dict[str, ApiKeyProfile]:
    raw = os.environ.get(name)
    if not raw:
        raise ValueError(f"api_keys_env: environment variable {name} is not set")
    try:
        data = json.loads(raw)
        return {str(k): ApiKeyProfile.model_validate(v) for k, v in dict(data).items()}
    except (ValueError, TypeError) as exc:
        # The message names the variable, never its content: it holds secrets.
        raise ValueError(
            f"api_keys_env: {name} must hold a JSON object key -> {{tenant, max_priority}} "
            f"({type(exc).__name__})"
        ) from None


def _split_args(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Flat and sectioned args -> (AppConfig fields, EngineConfig.from_kwargs arguments)."""
    engine = _section(args, "engine")
    scheduler = _section(args, "scheduler")
    scheduler.update(_section(engine, "scheduler"))
    for key in list(args):
        if key in ENGINE_KEYS:
            engine[key] = args.pop(key)
        elif key in SCHEDULER_KEYS:
            scheduler[key] = args.pop(key)
    # A replica's log is no terminal: no progress bar unless asked for.
    engine.setdefault("load_progress", False)
    return args, {**engine, "scheduler": scheduler}


def _section(args: dict[str, Any], name: str) -> dict[str, Any]:
    section = args.pop(name, None) or {}
    if not isinstance(section, dict):
        raise ValueError(f"invalid raylm app args: {name}: must be a mapping, got {section!r}")
    return dict(section)
