"""The app's arguments (deploy.yaml `args:`), declared and validated once."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from scheduler.config import SchedulerConfig

DEFAULT_MODEL = "default"  # the embedded SmolLM2-135M-Instruct (workers.loader)
ROUTERS = {
    "power_of_two": None,  # Serve's built-in PowerOfTwoChoicesRequestRouter
    "fleet": "cluster.router.FleetRouter",  # load + prefix affinity (cluster/routing.py)
}


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
    def _bounds(self) -> "AutoscalingArgs":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        return self


class AppConfig(BaseModel):
    """Everything `build_app` accepts. Unknown keys are errors (Serve would drop them silently)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # Model and parallelism.
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    device: Literal["cpu", "cuda"] = "cpu"
    tensor_parallel_size: int = Field(default=1, ge=1)
    max_model_len: int | None = Field(default=None, ge=16)  # None: the model's, capped at 8192
    seed: int = 0
    attention_backend: Literal["auto", "torch", "flash_attn", "triton"] = "auto"
    # KV-cache sizing: measured from memory unless num_gpu_blocks pins the count.
    kv_cache_memory_gb: float = Field(default=2.0, gt=0)  # the KV pool of a CPU replica
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    swap_space_gb: float = Field(default=0.0, ge=0)  # CPU pool for swap preemption
    # torch intra-op threads of a CPU replica (None: what Ray sets, OMP_NUM_THREADS = the actor's CPUs).
    cpu_threads: int | None = Field(default=None, ge=1)

    # Data parallelism: a fixed count or autoscaling, not both.
    num_replicas: int | None = Field(default=None, ge=1)
    autoscaling: AutoscalingArgs | None = None

    # Scheduler knobs (scheduler.config.SchedulerConfig); block counts None: sized by the engine.
    max_num_seqs: int = Field(default=64, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    block_size: int = Field(default=16, ge=1)
    num_gpu_blocks: int | None = Field(default=None, ge=1)
    num_cpu_blocks: int | None = Field(default=None, ge=0)
    long_prefill_token_threshold: int = Field(default=0, ge=0)
    enable_prefix_caching: bool = True
    policy: Literal["fcfs", "priority", "fair"] = "fcfs"
    preemption_mode: Literal["recompute", "swap", "auto"] = "recompute"
    preemption_victim: Literal["lifo", "least_progress"] = "lifo"
    watermark: float = Field(default=0.0, ge=0.0, lt=1.0)

    # Routing across replicas and admission.
    router: Literal["fleet", "power_of_two"] = "fleet"
    router_kwargs: dict[str, Any] = Field(default_factory=dict)
    max_ongoing_requests: int = Field(default=256, ge=1)  # per replica, in flight at once
    max_queued_requests: int = Field(default=-1, ge=-1)  # per caller; beyond it: overload_status
    overload_status: Literal[429, 503] = 503
    overload_retry_after_s: float | None = Field(default=None, gt=0)  # sent as Retry-After

    # Resources and placement (one bundle for the replica, one per TP worker when TP > 1).
    replica_num_cpus: float = Field(default=1.0, ge=0)
    worker_num_cpus: float = Field(default=1.0, ge=0)
    placement_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    ingress_num_cpus: float = Field(default=0.5, ge=0)
    ingress_replicas: int = Field(default=1, ge=1)

    # HTTP.
    api_key: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "AppConfig":
        if self.num_replicas is not None and self.autoscaling is not None:
            raise ValueError("num_replicas: set num_replicas or autoscaling, not both")
        if self.api_key == "":
            raise ValueError("api_key: must be non-empty when set")
        if self.router == "fleet":
            from cluster.routing import RoutingConfig  # pure policy code, no Ray
            try:
                RoutingConfig(**self.router_kwargs)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"router_kwargs: {exc}") from None
        elif self.router_kwargs:
            raise ValueError(f"router_kwargs: {self.router} takes none, got {sorted(self.router_kwargs)}")
        # SchedulerConfig checks the knobs' relations (swap needs a CPU pool, ...).
        cpu_blocks = self.num_cpu_blocks if self.num_cpu_blocks is not None else int(self.swap_space_gb > 0)
        self.scheduler_config(num_gpu_blocks=self.num_gpu_blocks or 1 << 30, num_cpu_blocks=cpu_blocks,
                              max_model_len=self.max_model_len or self.block_size)
        return self

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> "AppConfig":
        """Validate deploy.yaml args; the ValueError names every offending field."""
        try:
            return cls.model_validate(args or {})
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or e['msg'].split(':', 1)[0]}: "
                f"{e['msg'].removeprefix('Value error, ')} (got {e.get('input')!r})"
                for e in exc.errors())
            raise ValueError(f"invalid raylm app args: {problems}") from None

    @property
    def model_name(self) -> str:
        """The name clients pass as `model` and /v1/models lists."""
        return self.served_model_name or self.model

    @property
    def use_gpu(self) -> bool:
        return self.device == "cuda"

    def scheduler_knobs(self) -> dict[str, Any]:
        """The SchedulerConfig fields set here (the engine measures block counts and model length)."""
        return {"max_num_batched_tokens": self.max_num_batched_tokens, "max_num_seqs": self.max_num_seqs,
                "block_size": self.block_size, "long_prefill_token_threshold": self.long_prefill_token_threshold,
                "enable_prefix_caching": self.enable_prefix_caching, "policy": self.policy,
                "preemption_mode": self.preemption_mode, "preemption_victim": self.preemption_victim,
                "watermark": self.watermark}

    def scheduler_config(self, num_gpu_blocks: int, num_cpu_blocks: int, max_model_len: int) -> SchedulerConfig:
        try:
            return SchedulerConfig(**self.scheduler_knobs(), num_gpu_blocks=num_gpu_blocks,
                                   num_cpu_blocks=num_cpu_blocks, max_model_len=max_model_len)
        except ValueError as exc:
            raise ValueError(str(exc)) from None

    def engine_kwargs(self, placement_group: Any = None) -> dict[str, Any]:
        """cluster.config.EngineConfig arguments for one replica."""
        return {"model": self.model, "dtype": self.dtype, "device": self.device,
                "tensor_parallel_size": self.tensor_parallel_size, "seed": self.seed,
                "kv_cache_memory_gb": self.kv_cache_memory_gb,
                "gpu_memory_utilization": self.gpu_memory_utilization, "num_gpu_blocks": self.num_gpu_blocks,
                "num_cpu_blocks": self.num_cpu_blocks, "swap_space_gb": self.swap_space_gb,
                "max_model_len": self.max_model_len, "attention_backend": self.attention_backend,
                "load_progress": False, "placement_group": placement_group,
                "scheduler": self.scheduler_knobs()}

    def placement_group_bundles(self) -> list[dict[str, float]]:
        """The replica's bundle first (Serve places the replica actor there), then one per TP worker."""
        gpu = {"GPU": 1.0} if self.use_gpu else {}
        if self.tensor_parallel_size == 1:
            # The single worker runs inside the replica process.
            return [{"CPU": self.replica_num_cpus, **gpu}]
        worker = {"CPU": self.worker_num_cpus, **gpu}
        return [{"CPU": self.replica_num_cpus}] + [dict(worker) for _ in range(self.tensor_parallel_size)]

    def replica_actor_options(self) -> dict[str, Any]:
        first = self.placement_group_bundles()[0]
        return {"num_cpus": first["CPU"], "num_gpus": first.get("GPU", 0.0)}

    def scaling_options(self) -> dict[str, Any]:
        if self.autoscaling is None:
            return {"num_replicas": self.num_replicas or 1}
        return {"num_replicas": "auto", "autoscaling_config": self.autoscaling.model_dump(exclude_none=True)}

    def backpressure_config(self) -> dict[str, Any]:
        return {"status_code": self.overload_status, "retry_after_s": self.overload_retry_after_s}

    def request_router_config(self) -> dict[str, Any] | None:
        router_class = ROUTERS[self.router]
        if router_class is None:
            return None
        return {"request_router_class": router_class, "request_router_kwargs": dict(self.router_kwargs),
                "request_routing_stats_period_s": 1.0}
