"""EngineConfig: everything an EngineCore needs, declared once and validated at construction."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from scheduler.config import SchedulerConfig
from workers.layers.attention import BACKENDS
from workers.loader import DEFAULT_CACHE_DIR
from workers.runner import DTYPES

DEVICES = ("auto", "cpu", "cuda")
# SchedulerConfig fields an EngineConfig passes through (the block counts are measured instead).
_SCHEDULER_DEFAULTS = {f.name: f.default for f in fields(SchedulerConfig)
                       if f.name not in ("num_gpu_blocks", "num_cpu_blocks", "max_model_len")}
_SCHEDULER_KNOBS = tuple(_SCHEDULER_DEFAULTS)


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


@dataclass(slots=True)
class EngineConfig:
    """Model, device, KV-cache sizing and scheduler knobs of one engine (one data-parallel replica)."""

    model: str = "default"  # "default", an HF directory or a .gguf file
    dtype: str = "float32"
    device: str = "auto"  # "auto": cuda when available, else cpu
    tensor_parallel_size: int = 1
    seed: int = 0
    kv_cache_memory_gb: float = 2.0  # KV pool on the CPU device
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory for weights, activations and KV
    num_gpu_blocks: int | None = None  # set: skip sizing and use exactly this many device blocks
    num_cpu_blocks: int | None = None  # set: swap pool size in blocks (else from swap_space_gb)
    swap_space_gb: float = 0.0
    cache_dir: str = DEFAULT_CACHE_DIR  # converted GGUF weights live here
    max_model_len: int | None = None  # None: the model's max positions, capped at 8192
    enforce_eager: bool = True  # no graph capture yet; kept so configs stay stable
    attention_backend: str = "auto"
    load_progress: bool = True
    placement_group: Any = None  # the replica's Ray placement group (multi-worker executors)
    use_compiled_graph: bool = True  # TP > 1: broadcast steps over a Ray Compiled Graph, else actor calls
    scheduler: dict[str, Any] = field(default_factory=dict)  # SchedulerConfig knobs

    def __post_init__(self) -> None:
        _require(isinstance(self.model, str) and bool(self.model), "model", "must be a non-empty string")
        _require(self.dtype in DTYPES, "dtype", f"must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        _require(self.device in DEVICES or self.device.startswith("cuda:"), "device",
                 f"must be one of {DEVICES} (or cuda:N), got {self.device!r}")
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size",
                 f"must be >= 1, got {self.tensor_parallel_size}")
        _require(self.kv_cache_memory_gb > 0, "kv_cache_memory_gb", f"must be > 0, got {self.kv_cache_memory_gb}")
        _require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
                 f"must be in (0, 1], got {self.gpu_memory_utilization}")
        _require(self.num_gpu_blocks is None or self.num_gpu_blocks >= 1, "num_gpu_blocks",
                 f"must be >= 1, got {self.num_gpu_blocks}")
        _require(self.num_cpu_blocks is None or self.num_cpu_blocks >= 0, "num_cpu_blocks",
                 f"must be >= 0, got {self.num_cpu_blocks}")
        _require(self.swap_space_gb >= 0, "swap_space_gb", f"must be >= 0, got {self.swap_space_gb}")
        _require(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
                 f"must be >= 1, got {self.max_model_len}")
        _require(self.attention_backend in BACKENDS, "attention_backend",
                 f"must be one of {BACKENDS}, got {self.attention_backend!r}")
        unknown = sorted(set(self.scheduler) - set(_SCHEDULER_KNOBS))
        _require(not unknown, "scheduler", f"unknown knobs {unknown}; known: {list(_SCHEDULER_KNOBS)}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Engine fields and SchedulerConfig knobs mixed in one call (as LLM(...) takes them)."""
        own = {f.name for f in fields(cls)}
        unknown = sorted(k for k in kwargs if k not in own and k not in _SCHEDULER_KNOBS)
        if unknown:
            raise ValueError(f"{unknown[0]}: not an engine or scheduler setting")
        engine = {k: v for k, v in kwargs.items() if k in own}
        knobs = {**engine.pop("scheduler", {}), **{k: v for k, v in kwargs.items() if k in _SCHEDULER_KNOBS}}
        return cls(**engine, scheduler=knobs)

    def resolved_device(self) -> str:
        """"auto" resolved against what this process can see."""
        if self.device != "auto":
            return self.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    def scheduler_config(self, num_gpu_blocks: int, num_cpu_blocks: int, max_model_len: int) -> SchedulerConfig:
        """The SchedulerConfig for the measured block counts."""
        return SchedulerConfig(**self.scheduler, num_gpu_blocks=num_gpu_blocks,
                               num_cpu_blocks=num_cpu_blocks, max_model_len=max_model_len)

    @property
    def block_size(self) -> int:
        return self.scheduler.get("block_size", _SCHEDULER_DEFAULTS["block_size"])

    @property
    def max_num_batched_tokens(self) -> int:
        return self.scheduler.get("max_num_batched_tokens", _SCHEDULER_DEFAULTS["max_num_batched_tokens"])

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.get("max_num_seqs", _SCHEDULER_DEFAULTS["max_num_seqs"])
