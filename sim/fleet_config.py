"""The simulated fleet's configuration: replica count, each replica's scheduler, the router and
its stats delay, co-hosted replicas sharing cores, and the optional replica features."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from router.autoscaling import MAX_DELAY_S, MAX_REPLICAS
from router.config import RoutingConfig
from router.stats import ROUTING_STATS_PERIOD_S
from scheduler import SchedulerConfig
from settings import check_settings, setting
from sim.adapters import AdapterSlotsConfig
from sim.kv_copy import LinkConfig
from sim.speculation import SpecSimConfig

# A serving stack that takes longer than this per request is a misconfiguration, not a setting.
MAX_SERVING_OVERHEAD_S = 3600.0
# A host's cores: NR_CPUS, the most a Linux kernel can be built for.
MAX_HOST_CORES = 8192


@dataclass(frozen=True, slots=True)
class HostConfig:
    """Replicas that share one host's CPU cores: a step is stretched while co-hosted replicas are
    busy.

    Replica i runs on host i // replicas_per_host. A replica's engine runs `cores_per_replica`
    threads (the threads its profile was calibrated with); the host has `cores`, of which
    `background_cores` go to what runs beside the engines (Serve's proxy and controller, the router,
    the client). While `busy` replicas of a host run steps, each step progresses at 1 / stretch of
    the profile's speed, stretch = max(1, busy * cores_per_replica / (cores - background_cores)):
    the engines share the cores left, and none runs faster than its own threads allow. A replica
    that starts or stops running steps re-times the co-hosted steps in flight (processor sharing).
    Replicas that share a host take no k-step jumps: a co-host's start would change their times.
    cores == 0: no sharing (every replica has its profile's cores to itself).
    """

    replicas_per_host: int = setting(
        1, "replicas sharing one host's cores", ge=1, le=MAX_HOST_CORES
    )
    cores: float = setting(0.0, "the host's cores (0: no sharing)", ge=0, le=MAX_HOST_CORES)
    cores_per_replica: float = setting(
        1.0, "cores one replica's engine uses at most", gt=0, le=MAX_HOST_CORES
    )
    background_cores: float = setting(
        0.0, "cores taken by what runs beside the engines", ge=0, le=MAX_HOST_CORES
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if self.cores and not self.background_cores < self.cores:
            raise ValueError(
                f"background_cores: must be in [0, cores), got {self.background_cores}"
            )

    @property
    def shared(self) -> bool:
        return self.cores > 0

    def stretch(self, busy: int) -> float:
        """Step-time factor while `busy` replicas of the host run steps."""
        if not self.shared:
            return 1.0
        return max(1.0, busy * self.cores_per_replica / (self.cores - self.background_cores))


# What a simulated replica's engine would measure (KV blocks) and the context length, where the
# scheduler config leaves them unset.
SIM_NUM_GPU_BLOCKS = 1024
SIM_MAX_MODEL_LEN = 4096


@dataclass(slots=True)
class SimConfig:
    """The simulated fleet: replica count, each replica's scheduler, router and its stats delay."""

    num_replicas: int = setting(2, "replicas of the fleet", ge=1, le=MAX_REPLICAS)
    # Pool sizes and context length an engine would measure; left None they take these values.
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    stats_period_s: float = setting(
        ROUTING_STATS_PERIOD_S, "how often replicas report to the router", gt=0, le=MAX_DELAY_S
    )
    # How late a report reaches the router: Serve polls each replica once a period, so the router
    # reads a report half a period old on average.
    stats_delay_s: float = setting(
        ROUTING_STATS_PERIOD_S / 2, "how late a report reaches the router", ge=0, le=MAX_DELAY_S
    )
    # Run a replica's steps back to back while no other event intervenes, and jump over its
    # pure-decode stretches (False: every step through the event queue, the reference).
    coalesce: bool = True
    host: HostConfig = field(default_factory=HostConfig)  # co-hosted replicas sharing cores
    # Each record keeps its inter-token gaps (False: only its ITL p90 and the fleet tally, for runs
    # of millions of requests, where the gaps would take ~9 KB a request).
    keep_itl: bool = True
    # What a request spends in the serving stack outside the engine (HTTP proxy, ingress, the
    # handle's routing call, the token's way back), charged before it reaches the router: its
    # TTFT and end-to-end time grow by this much. bench/serve_bench.py measures it.
    serving_overhead_s: float = setting(
        0.0, "seconds spent outside the engine", ge=0, le=MAX_SERVING_OVERHEAD_S
    )
    # Every request's max_tokens, when above its output length (0: its output length, so that it
    # ends by length). Set it and requests end by EOS, unknown in advance as a served request's are:
    # what a length predictor is measured on.
    max_tokens: int = 0
    # Each replica's LoRA adapter slots and load time (None: requests' adapters are ignored, by the
    # router and the replicas alike, as before adapters).
    adapters: AdapterSlotsConfig | None = None
    # The link to each replica's CPU tier of the prefix cache, which scheduler.num_cpu_tier_blocks
    # turns on (sim/tiers.py): its saves and loads take blocks' bytes over this bandwidth.
    tier_link: LinkConfig = field(default_factory=LinkConfig)
    # Speculative decoding on every replica (sim/speculation.py; None: off).
    spec: SpecSimConfig | None = None

    def __post_init__(self) -> None:
        s = self.scheduler
        self.scheduler = dataclasses.replace(
            s,
            num_gpu_blocks=s.num_gpu_blocks if s.num_gpu_blocks is not None else SIM_NUM_GPU_BLOCKS,
            num_cpu_blocks=s.num_cpu_blocks if s.num_cpu_blocks is not None else 0,
            max_model_len=s.max_model_len if s.max_model_len is not None else SIM_MAX_MODEL_LEN,
        )
        check_settings(self)
        if self.scheduler.cpu_tier_blocks and self.adapters is not None:
            raise ValueError("num_cpu_tier_blocks: not with adapters in this simulator")
        if self.spec is not None and (self.adapters is not None or self.scheduler.cpu_tier_blocks):
            raise ValueError("spec: not with adapters or a CPU tier in this simulator")
