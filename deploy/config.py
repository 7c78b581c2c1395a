"""The app's arguments (deploy.yaml `args:`): serving, routing and resources, over the engine's
tree.

The tree is AppConfig > EngineConfig > SchedulerConfig, each setting declared once with `setting`
(settings/__init__.py), like every config of raylm. deploy.yaml may name any setting flat
(`max_num_seqs: 32`) or in optional `engine:` / `scheduler:` sections; `nest` places the flat keys
in the tree by the dataclasses' fields.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from typing import Any

from cluster.placement import STRATEGIES, default_strategy
from cluster.tracing import TracingConfig
from deploy.api_keys import UNLIMITED_KEY, ApiKeyProfile, keys_from_env
from deploy.autoscaling_args import AutoscalingArgs
from deploy.browser_guard import MAX_ALLOWED, check_hosts, check_origins
from deploy.cache_scope import SCOPES
from deploy.disagg_config import DisaggregationArgs
from deploy.hub import check_hub_settings
from deploy.schemas import MAX_MESSAGES
from engine.config import EngineConfig
from frontend.images import ImageLimits
from frontend.reasoning import PARSERS
from router.autoscaling import MAX_REPLICAS
from router.config import MAX_LOAD, RoutingConfig
from router.stats import ROUTING_STATS_PERIOD_S
from scheduler.sampling_params import POOLINGS
from settings import build, check_settings, nest, setting, shown

ROUTERS = {
    "fleet": "cluster.serve_router.FleetRouter",  # load + prefix affinity (router/)
    "power_of_two": None,  # Serve's built-in PowerOfTwoChoicesRequestRouter
}
# A bundle lives on one node; the replica's also sets its torch threads.
MAX_BUNDLE_CPUS = 1024


@dataclass(slots=True)
class AppConfig:
    """Everything `build_app` accepts. Unknown keys are errors (Serve would drop them silently)."""

    # Model, parallelism, cache and scheduler settings.
    engine: EngineConfig = field(default_factory=EngineConfig)
    # Bounds on the images of a vision model's requests (frontend/images.py).
    images: ImageLimits = field(default_factory=ImageLimits)
    served_model_name: str | None = setting(
        None, "the name clients pass as `model` and `/v1/models` lists (unset: `model`)"
    )
    # A hub model (`model: org/name`): deploy/hub.py pins it at build time.
    revision: str | None = setting(
        None,
        "hub models: the branch, tag or commit of `model` (unset: the default branch); the app is "
        "pinned to its commit when built, so every replica serves the same files",
    )
    download_dir: str | None = setting(
        None,
        "hub models: the Hugging Face cache to download into and read from, on every node "
        "(unset: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)",
    )
    # Data parallelism: a fixed count or autoscaling, not both.
    num_replicas: int | None = setting(
        None, "data-parallel replicas, one engine each (unset: 1)", ge=1, le=MAX_REPLICAS
    )
    autoscaling: AutoscalingArgs | None = setting(
        None,
        "instead of `num_replicas`: "
        "`{min_replicas, max_replicas, initial_replicas, policy, target_ongoing_requests, "
        "upscale_delay_s, downscale_delay_s, look_back_period_s, metrics_interval_s, "
        "slo: {ttft_p90_s, itl_p90_s}, targets: {...}}` (docs/operations.md#autoscaling)",
    )
    disaggregation: DisaggregationArgs | None = setting(
        None,
        "instead of `num_replicas`: prefill and decode replicas apart, `{prefill_replicas, "
        "decode_replicas, transfer_timeout_s, kv_transport, prefill: {...}, decode: {...}}` "
        "(docs/disaggregation.md)",
    )
    # Routing across replicas and admission.
    router: str = setting(
        "fleet",
        "`fleet` (load + prefix affinity) or Serve's `power_of_two`",
        choices=tuple(ROUTERS),
    )
    # Serve hands this mapping to the router as request_router_kwargs; it is checked here.
    router_kwargs: dict[str, Any] | None = setting(
        None, "`fleet` router settings (router/config.py `RoutingConfig`)"
    )
    max_ongoing_requests: int = setting(
        256, "requests in flight at once per replica", ge=1, le=MAX_LOAD
    )
    max_queued_requests: int | None = setting(
        None,
        "queued per ingress beyond "
        "that; past it: `overload_status` (unset: max_ongoing_requests "
        "x replicas; -1: unbounded)",
        ge=-1,
        le=MAX_LOAD * MAX_REPLICAS,
    )
    overload_status: int = setting(503, "HTTP status when the queues are full", choices=(429, 503))
    overload_retry_after_s: float = setting(1.0, "sent as Retry-After", gt=0, le=3600)
    request_timeout_s: float = setting(
        600.0,
        "deadline of one request; "
        "past it the generation is aborted and its blocks freed (a request's "
        "`request_timeout_s` may shorten it)",
        gt=0,
        le=86400,
    )
    max_migrations: int = setting(
        3,
        "times one choice may resume on another replica after its replica failed",
        ge=0,
        le=16,
    )
    health_check_period_s: float = setting(
        5.0,
        "how often Serve probes "
        "each replica; after 3 failed probes (a failed or stalled engine) it is "
        "replaced",
        ge=0.1,
        le=600,
    )
    graceful_shutdown_timeout_s: float = setting(
        30.0,
        "on scale-down or "
        "redeploy, how long a replica lets in-flight requests finish "
        "before handing the rest to other replicas",
        ge=0,
        le=3600,
    )
    # Request limits at the ingress.
    max_request_body_bytes: int | None = setting(
        None,
        "larger bodies get 413 before they are parsed",
        ge=1024,
        le=1 << 32,
        derived="max_model_len x 32 characters a token x 6 bytes a character, at least 2 MiB",
    )
    request_body_timeout_s: float = setting(
        30.0, "longest the body of one request may take to arrive; past it: 408", gt=0, le=3600
    )
    max_messages: int = setting(
        MAX_MESSAGES, "messages of one chat request (OpenAI's limit)", ge=1, le=1 << 20
    )
    max_sequences_per_request: int = setting(128, "prompts x n of one request", ge=1, le=4096)
    max_logprob_entries: int = setting(
        1 << 18,
        "log-probabilities one request may ask for: choices x max_tokens x (top logprobs + 1); "
        "past it: 400 before generation (max_tokens unset counts the context left)",
        ge=1,
        le=1 << 40,
    )
    max_requests_per_tenant: int | None = setting(
        None,
        "requests of one tenant in flight at once on each ingress replica; past it: 429 with "
        "Retry-After (`overload_retry_after_s`)",
        ge=1,
        le=1 << 20,
    )
    max_stop_string_chars: int = setting(1024, "longest stop string accepted", ge=1, le=1 << 20)
    unknown_fields: str = setting(
        "reject",
        "a request field the server does not implement (unknown, or OpenAI's but not "
        "implemented): `reject` answers 400 naming it; `ignore` drops it and lists it in the "
        "`x-raylm-ignored-fields` response header",
        choices=("reject", "ignore"),
    )
    session_from_user: bool = setting(
        False,
        "a chat or completion request's `user` names its session (router/sessions.py) when it "
        "names none (`session_id`, `x-session-id`); off by default: one user may hold many "
        "conversations, which one session would pile onto one replica",
    )
    # The Batch API (deploy/batch_routes.py, docs/batch.md).
    batch_dir: str | None = setting(
        None,
        "where `/v1/files` and `/v1/batches` keep uploads, outputs and batch state (one folder "
        "per key, files 0600); share it between ingress replicas (unset: raylm-batch under the "
        "ingress host's temp dir)",
        path=True,
    )
    batch_max_file_bytes: int = setting(
        100 << 20, "largest file `/v1/files` accepts; past it: 413", ge=1024, le=1 << 40
    )
    batch_max_lines: int = setting(50_000, "lines of one batch input file", ge=1, le=1 << 24)
    batch_max_line_bytes: int = setting(
        2 << 20, "largest line (one request body) of a batch input file", ge=1024, le=1 << 32
    )
    batch_quota_bytes: int = setting(
        10 << 30,
        "bytes of files (uploads and batch outputs) one key may keep; past it: 400 "
        "`storage_quota_exceeded`",
        ge=1024,
        le=1 << 50,
    )
    batch_max_files: int = setting(1000, "files one key may keep", ge=1, le=1 << 20)
    batch_lines_in_flight: int = setting(
        4,
        "lines of one batch in flight at once; they run at the least urgent priority, so "
        "interactive requests go first",
        ge=1,
        le=1024,
    )
    # Reasoning models and embeddings.
    reasoning_parser: str | None = setting(
        None,
        "splits a reasoning model's thinking block out of its reply: `reasoning_content` in chat, "
        "reasoning items in the Responses API; tools and response formats constrain the answer "
        "after the block (unset: no split)",
        choices=tuple(PARSERS),
    )
    embedding_pooling: str = setting(
        "last",
        "how `/v1/embeddings` pools the model's final hidden states: the last prompt token's, or "
        "the mean over the prompt; either is normalised to unit length",
        choices=POOLINGS,
    )
    max_embedding_tokens: int = setting(
        300_000,
        "tokens of one `/v1/embeddings` request summed over its `input` items (OpenAI's bound); "
        "past it: 400 naming `input` before any input is computed",
        ge=1,
        le=1 << 40,
    )
    # OpenTelemetry (cluster/tracing.py, docs/tracing.md).
    tracing: TracingConfig | None = setting(
        None,
        "OpenTelemetry spans of each request (ingress, router, replica, engine phases), sent over "
        "OTLP/HTTP: `{otlp_endpoint, service_name, sample_ratio, export_delay_s}` "
        "(docs/tracing.md; unset: off, at no cost)",
    )
    # Resources and placement (one bundle for the replica, one per TP worker when TP > 1).
    replica_num_cpus: float = setting(1.0, "CPUs of the replica's bundle", ge=0, le=MAX_BUNDLE_CPUS)
    worker_num_cpus: float = setting(
        1.0, "CPUs of each TP worker's bundle (TP > 1)", ge=0, le=MAX_BUNDLE_CPUS
    )
    placement_strategy: str | None = setting(
        None,
        "placement of a replica's bundles; anything but STRICT_PACK at TP > 1 lets ranks land on "
        "different nodes, with NCCL over the network (a warning says so)",
        choices=STRATEGIES,
        derived="STRICT_PACK with more than one rank (tensor x pipeline), else PACK",
    )
    placement_timeout_s: float = setting(
        900.0,
        "when no node of the cluster can hold a replica's bundles, how long the app waits at "
        "deploy for one to join (an autoscaler's) before it fails naming the bundles and the "
        "largest node; 0 fails at once",
        ge=0,
        le=86400,
    )
    omp_spin_count: int | None = setting(
        None,
        "GOMP_SPINCOUNT of the replica's processes (TP workers "
        "inherit it): how long torch's OpenMP threads spin for work before they sleep. Long spins "
        "are fastest "
        "on cores of their own; when other processes take a core, the engine's threads share one "
        "and each "
        "spin is lost time (unset: libgomp's 300,000)",
        ge=0,
        le=10**12,
    )
    ingress_num_cpus: float = setting(0.5, "CPUs of each ingress replica", ge=0, le=MAX_BUNDLE_CPUS)
    ingress_replicas: int = setting(1, "OpenAI ingress replicas", ge=1, le=MAX_REPLICAS)
    # HTTP and tenants.
    api_key: str | None = setting(None, "required as `Authorization: Bearer <key>` when set")
    api_keys: dict[str, ApiKeyProfile] | None = setting(
        None,
        "key -> `{tenant, max_priority, admin, loras}`: the `fair` policy's tenant and the most "
        "urgent `priority` that key may ask for come from the key, never from the request; "
        "`admin: true` lets it load and unload LoRA adapters (allow_runtime_lora); `loras` "
        "limits the adapters it may name and see",
    )
    allow_unauthenticated: bool = setting(
        False,
        "serve without keys although Serve "
        "listens beyond loopback (behind your own authenticating proxy)",
    )
    # Off by default: a load reads files on every replica's host.
    allow_runtime_lora: bool = setting(
        False,
        "`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` change the adapters of every "
        "replica at run time (with keys configured, only a key with `admin: true`, or `api_key`, "
        "may call them); needs `router: fleet` and LoRA on (`lora_root`, `lora_modules` or "
        "`max_loras`)",
    )
    # Off by default: an update reads files on every replica's host, and sleep stops serving.
    allow_weight_updates: bool = setting(
        False,
        "`POST /v1/update_weights`, `/v1/sleep` and `/v1/wake_up` change every replica's weights "
        "or free its memory at run time (docs/rl.md; with keys configured, only a key with "
        "`admin: true`, or `api_key`, may call them); needs `router: fleet`",
    )
    api_keys_env: str | None = setting(
        None,
        "name of an environment variable holding `api_keys` as JSON (keeps the "
        "keys out of deploy.yaml and the Ray dashboard)",
    )
    prefix_cache_scope: str | None = setting(
        None,
        "whose cached prompt blocks a request may reuse: `tenant` (its key's tenant's only: no "
        "tenant hits, times or counts in `cached_tokens` another's) or `shared` (every caller's); "
        "a request's `cache_salt` and `prompt_cache_key` narrow it further",
        choices=SCOPES,
        derived="tenant when api_key, api_keys or api_keys_env is set, else shared",
    )
    # Browser safety (deploy/browser_guard.py).
    allowed_hosts: list[str] | None = setting(
        None,
        f"host names (no port) a keyless server answers besides loopback's; at most "
        f"{MAX_ALLOWED} (unset: loopback only, against DNS rebinding)",
    )
    allowed_origins: list[str] | None = setting(
        None,
        f"browser origins (`https://app.example`) allowed to call the server, with CORS; at most "
        f"{MAX_ALLOWED} (unset: requests carrying an Origin get 403)",
    )
    allowed_media_domains: list[str] | None = setting(
        None,
        f"hosts (no port) whose `http(s)` image URLs a vision model's requests may name, at most "
        f"{MAX_ALLOWED}; fetched with `media_fetch_timeout_s` and `max_image_bytes`, redirects "
        "within the host only (unset: only `data:` URLs, as fetching is a server-side request "
        "forgery risk)",
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if self.num_replicas is not None and self.autoscaling is not None:
            raise ValueError("num_replicas: set num_replicas or autoscaling, not both")
        check_hub_settings(self.engine.model, self.revision, self.download_dir)
        self._check_access()
        self._check_engine()
        if self.disaggregation is not None:
            self._check_disaggregation(self.disaggregation)
        if self.router == "fleet":
            RoutingConfig.from_router_kwargs(self.router_kwargs)
        elif self.router_kwargs:
            raise ValueError(
                f"router_kwargs: {self.router} takes none, got {shown(sorted(self.router_kwargs))}"
            )

    def _check_access(self) -> None:
        """Keys (api_keys_env's merged in), hosts, origins and media domains."""
        if self.api_key == "":
            raise ValueError("api_key: must be non-empty when set")
        if self.api_keys_env is not None:
            self.api_keys = {**(self.api_keys or {}), **keys_from_env(self.api_keys_env)}
        if self.api_keys is not None and any(not key for key in self.api_keys):
            raise ValueError("api_keys: keys must be non-empty")
        if self.allowed_hosts is not None:
            self.allowed_hosts = check_hosts(self.allowed_hosts)
        if self.allowed_origins is not None:
            self.allowed_origins = check_origins(self.allowed_origins)
        if self.allowed_media_domains is not None:
            self.allowed_media_domains = check_hosts(
                self.allowed_media_domains, "allowed_media_domains"
            )

    def _check_engine(self) -> None:
        """What a served engine needs beyond its own checks: Ray ranks, its bundle's threads,
        and for run-time adapters a router that reaches every replica and LoRA slots."""
        if self.engine.distributed_executor_backend == "mp":
            raise ValueError(
                "distributed_executor_backend: 'mp' is for the offline engine; a served replica "
                "runs its ranks as Ray actors in its placement group (leave it unset or 'ray')"
            )
        if self.engine.cpu_threads is None and self.engine.world_size == 1:
            # A CPU replica's torch threads default to the cores its bundle reserves, not to
            # whatever Ray's OMP_NUM_THREADS says (a fraction rounds down, at least one).
            self.engine = replace(self.engine, cpu_threads=max(1, int(self.replica_num_cpus)))
        self._check_runtime_lora()

    def _check_runtime_lora(self) -> None:
        if self.allow_runtime_lora and self.router != "fleet":
            raise ValueError(
                "allow_runtime_lora: needs router: fleet, which can reach every replica"
            )
        if self.allow_runtime_lora and not self.engine.num_lora_slots:
            raise ValueError(
                "allow_runtime_lora: LoRA is off (set lora_root, where adapters may be loaded "
                "from, or max_loras)"
            )

    def _check_disaggregation(self, disagg: DisaggregationArgs) -> None:
        for name in ("num_replicas", "autoscaling"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: set {name} or disaggregation, not both")
        if self.router != "fleet":
            raise ValueError("disaggregation: needs router: fleet (prefill, then decode)")
        disagg.check(self.engine)

    def phase_engine(self, phase: str) -> EngineConfig:
        """The engine of the `prefill` or `decode` replicas (the model's without
        disaggregation)."""
        if self.disaggregation is None:
            return self.engine
        return self.disaggregation.engine(self.engine, phase)

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> AppConfig:
        """Validate deploy.yaml args, flat or in sections; the ValueError names the offending
        field by its path (`engine.scheduler.max_num_seqs: ...`)."""
        try:
            tree = nest(cls, args or {})
            engine = tree.setdefault("engine", {})
            if isinstance(engine, dict):
                # A replica's log is no terminal: no progress bar unless asked for.
                engine.setdefault("load_progress", False)
            return build(cls, tree)
        except ValueError as exc:
            raise ValueError(f"invalid raylm app args: {exc}") from None

    @property
    def model_name(self) -> str:
        """The name clients pass as `model` and /v1/models lists."""
        return self.served_model_name or self.engine.model

    @property
    def cache_scope(self) -> str:
        """prefix_cache_scope, or its default: `tenant` once keys are configured."""
        if self.prefix_cache_scope is not None:
            return self.prefix_cache_scope
        return "tenant" if self.key_profiles() else "shared"

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
        """The replica's bundle first (Serve places the replica actor there), then one per rank
        (tensor x pipeline)."""
        gpu = {"GPU": 1.0} if self.use_gpu else {}
        if self.engine.world_size == 1:
            # The single worker runs inside the replica process.
            return [{"CPU": self.replica_num_cpus, **gpu}]
        worker = {"CPU": self.worker_num_cpus, **gpu}
        return [{"CPU": self.replica_num_cpus}] + [
            dict(worker) for _ in range(self.engine.world_size)
        ]

    def placement_group_strategy(self) -> str:
        """placement_strategy, or its default for the number of ranks."""
        return self.placement_strategy or default_strategy(self.engine.world_size)

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
            "autoscaling_config": self.autoscaling.serve_config(self.model_name),
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
            "request_router_kwargs": dict(self.router_kwargs or {}),
            "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
        }

    def summary(self) -> dict[str, Any]:
        """What the app logs at start (no secrets)."""
        secret = ("api_key", "api_keys")
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name not in secret}


def _plain(value: Any) -> Any:
    return asdict(value) if is_dataclass(value) and not isinstance(value, type) else value
