"""Scheduler configuration: declared once, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("fcfs", "priority", "fair")
PREEMPTION_MODES = ("recompute", "swap", "auto")
PREEMPTION_VICTIMS = ("lifo", "least_progress")


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {message}")


@dataclass(slots=True)
class SchedulerConfig:
    """Knobs of the continuous-batching scheduler and its KV block pool."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    block_size: int = 16
    num_gpu_blocks: int = 1024
    num_cpu_blocks: int = 0
    max_model_len: int = 4096
    # Per-request cap on prefill tokens in one step (0: no cap beyond the budget).
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    policy: str = "fcfs"
    preemption_mode: str = "recompute"
    preemption_victim: str = "lifo"
    # Fraction of GPU blocks that new admissions may not take (kept for running requests).
    watermark: float = 0.0
    # preemption_mode="auto": swap a victim holding at least this many computed tokens,
    # recompute a cheaper one. Recompute cost grows with tokens (and attention quadratically),
    # a swap costs one block copy per block each way; 256 tokens is where a re-prefill of a
    # small model starts to cost more than two PCIe copies of its KV blocks.
    swap_min_computed_tokens: int = 256
    # policy="fair": weights of input (prefill) and output (decode) tokens in the VTC counters.
    fair_input_weight: float = 1.0
    fair_output_weight: float = 2.0

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "max_model_len"):
            _require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _require(self.num_gpu_blocks >= 1, "num_gpu_blocks", f"must be >= 1, got {self.num_gpu_blocks}")
        _require(self.num_cpu_blocks >= 0, "num_cpu_blocks", f"must be >= 0, got {self.num_cpu_blocks}")
        _require(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold",
                 f"must be >= 0, got {self.long_prefill_token_threshold}")
        _require(self.policy in POLICIES, "policy", f"must be one of {POLICIES}, got {self.policy!r}")
        _require(self.preemption_mode in PREEMPTION_MODES, "preemption_mode",
                 f"must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        _require(self.preemption_victim in PREEMPTION_VICTIMS, "preemption_victim",
                 f"must be one of {PREEMPTION_VICTIMS}, got {self.preemption_victim!r}")
        _require(0.0 <= self.watermark < 1.0, "watermark", f"must be in [0, 1), got {self.watermark}")
        _require(self.swap_min_computed_tokens >= 0, "swap_min_computed_tokens",
                 f"must be >= 0, got {self.swap_min_computed_tokens}")
        _require(self.fair_input_weight >= 0 and self.fair_output_weight >= 0, "fair_input_weight",
                 "fair token weights must be >= 0")
        if self.preemption_mode == "swap":
            _require(self.num_cpu_blocks > 0, "num_cpu_blocks", "preemption_mode='swap' needs a CPU pool (> 0)")
        needed = -(-self.max_model_len // self.block_size)
        _require(self.num_gpu_blocks >= needed, "num_gpu_blocks",
                 f"{self.num_gpu_blocks} blocks of {self.block_size} tokens cannot hold one "
                 f"max_model_len={self.max_model_len} request (needs {needed})")

    @property
    def num_watermark_blocks(self) -> int:
        return int(self.watermark * self.num_gpu_blocks)
