"""Scheduler configuration: each knob declared once (default, range, doc), validated at
construction."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.sampling_params import MAX_TOKENS
from scheduler.state_slots import MAX_STATE_SLOTS
from settings import check_settings, setting

POLICIES = ("fcfs", "priority", "fair", "srpt", "fair_srpt")
PREEMPTION_MODES = ("recompute", "swap", "auto")
PREEMPTION_VICTIMS = ("lifo", "least_progress", "most_remaining")
ADMISSIONS = ("greedy", "foresight")
LENGTH_PROBES = ("auto", "on", "off")
FORESIGHT_ESTIMATES = ("median", "upper")
# Tokens of one step: past what any device holds the activations of.
MAX_STEP_TOKENS = 1 << 24
# Running requests of one replica: a hybrid model's engine gives each a recurrent-state slot.
MAX_NUM_SEQS = MAX_STATE_SLOTS
MAX_BLOCK_SIZE = 1 << 16
# Device block ids are int32 in the block tables the kernels read.
MAX_GPU_BLOCKS = 2**31 - 1
MAX_HOST_BLOCKS = 1 << 40
# A tenant counter's weight: the counters only compare; past this one kind of token is all that
# counts anyway.
MAX_FAIR_WEIGHT = 1_000_000


@dataclass(slots=True)
class SchedulerConfig:
    """Knobs of the continuous-batching scheduler and its KV block pool.

    The pool sizes and the context length may be left None: an engine fills them in from measured
    memory and the model; a Scheduler needs them set.
    """

    max_num_batched_tokens: int = setting(
        2048, "token budget of one step (prefill chunks + decodes)", ge=1, le=MAX_STEP_TOKENS
    )
    max_num_seqs: int = setting(
        128, "requests in one replica's running batch", ge=1, le=MAX_NUM_SEQS
    )
    block_size: int = setting(
        16,
        "tokens per KV block (also the prefix-hash block of the router)",
        ge=1,
        le=MAX_BLOCK_SIZE,
    )
    num_gpu_blocks: int | None = setting(
        None,
        "device KV pool in blocks; pins the size instead of measuring it",
        ge=1,
        le=MAX_GPU_BLOCKS,
        derived="measured from memory",
    )
    num_cpu_blocks: int | None = setting(
        None,
        "CPU pool for swap preemption in blocks",
        ge=0,
        le=MAX_HOST_BLOCKS,
        derived="from swap_space_gb",
    )
    num_cpu_tier_blocks: int | None = setting(
        None,
        "CPU tier of the prefix cache in blocks: cached prefix blocks the device pool evicts are "
        "kept there (LRU) and loaded back on a later hit instead of recomputed; 0: off",
        ge=0,
        le=MAX_HOST_BLOCKS,
        derived="from kv_cpu_tier_gb",
    )
    num_disk_tier_blocks: int | None = setting(
        None,
        "disk tier of the prefix cache in blocks, below the CPU tier (LRU, one file a block); "
        "0: off",
        ge=0,
        le=MAX_HOST_BLOCKS,
        derived="from kv_disk_tier_gb",
    )
    max_model_len: int | None = setting(
        None,
        "context length, at most the model's positions; prompt + max_tokens beyond it is rejected",
        ge=1,
        le=MAX_TOKENS,
        derived="the model's, capped at 8192",
    )
    long_prefill_token_threshold: int = setting(
        0, "cap on one request's prefill tokens per step (0: none)", ge=0, le=MAX_STEP_TOKENS
    )
    bulk_tokens_per_step: int | None = setting(
        None,
        "embedding prompt tokens and prompt_logprobs rows (each row counts 2) a step takes while "
        "a streaming request runs; with none running, the whole budget (scheduler/bulk_budget.py)",
        ge=1,
        le=MAX_STEP_TOKENS,
        derived="max_num_batched_tokens / 256, at least 8",
    )
    max_num_encoder_tokens: int | None = setting(
        None,
        "image tokens the vision tower encodes in one step, beside the token budget: a prompt "
        "with many images is spread over steps instead of stalling the decodes "
        "(scheduler/multimodal.py)",
        ge=1,
        le=1 << 20,
        derived="max_num_batched_tokens",
    )
    enable_prefix_caching: bool = setting(True, "reuse KV blocks of shared prompt prefixes")
    policy: str = setting(
        "fcfs",
        "queue order: first come, priority (lower first), fair (VTC per tenant), srpt (shortest "
        "predicted remaining output first, aged), fair_srpt (VTC across tenants, srpt within each)",
        choices=POLICIES,
    )
    preemption_mode: str = setting(
        "recompute", "how a preempted request gives back its blocks", choices=PREEMPTION_MODES
    )
    preemption_victim: str = setting(
        "lifo", "which running request is preempted first", choices=PREEMPTION_VICTIMS
    )
    watermark: float = setting(
        0.0, "share of device blocks new admissions may not take", ge=0.0, lt=1.0
    )
    # Recompute cost grows with tokens (attention quadratically); a swap costs one block copy per
    # block each way: 256 tokens is where re-prefilling a small model costs more than two copies.
    swap_min_computed_tokens: int = setting(
        256,
        "preemption_mode auto: swap a victim with at least this many computed tokens, else "
        "recompute",
        ge=0,
        le=MAX_TOKENS,
    )
    admission: str = setting(
        "greedy",
        "greedy: admit while the request's tokens so far fit; foresight: also only while the "
        "running batch's predicted peak KV fits the pool (scheduler/admission.py)",
        choices=ADMISSIONS,
    )
    foresight_estimate: str = setting(
        "median",
        "admission foresight: each request's remaining length taken at the predictor's median "
        "or its upper quantile (fewer preemptions still, but fewer admissions: lower goodput)",
        choices=FORESIGHT_ESTIMATES,
    )
    srpt_aging_factor: float = setting(
        2.0,
        "policy srpt, fair_srpt: no request waits more than this times its FCFS wait, counted in "
        "admissions (of its tenant under fair_srpt)",
        ge=1,
        le=1_000_000,
    )
    length_probe: str = setting(
        "auto",
        "the hidden-state length probe: the runner hands the scheduler each prompt's final hidden "
        "state at its last token (projected to length_feature_dim floats) and the length "
        "predictor learns from it online, falling back to its feature groups while cold "
        "(scheduler/length_live.py). auto: on when policy srpt/fair_srpt or admission foresight "
        "is; on: always (e.g. for the router's predicted_tokens load); off: never",
        choices=LENGTH_PROBES,
    )
    length_feature_dim: int = setting(
        64,
        "length probe: floats of each prompt's projected hidden state (the probe's inputs; "
        "each finished request costs O(dim^2) to learn)",
        ge=4,
        le=512,
    )
    length_predictor_state_path: str | None = setting(
        None,
        "a file where the length predictor's state is saved (atomically, every 256 finished "
        "requests and at shutdown) and loaded at start; a corrupt or mismatched file is ignored "
        "with a warning. None: not persisted",
        path=True,
    )
    fair_input_weight: float = setting(
        1.0,
        "policy fair: weight of a prefill token in the tenant counters",
        ge=0,
        le=MAX_FAIR_WEIGHT,
    )
    fair_output_weight: float = setting(
        2.0,
        "policy fair: weight of a decoded token in the tenant counters",
        ge=0,
        le=MAX_FAIR_WEIGHT,
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if self.preemption_mode == "swap" and self.num_cpu_blocks == 0:
            raise ValueError("num_cpu_blocks: preemption_mode='swap' needs a CPU pool (> 0)")
        if self.num_disk_tier_blocks and not self.num_cpu_tier_blocks:
            raise ValueError(
                "num_disk_tier_blocks: the disk tier is fed by the CPU tier; set "
                "num_cpu_tier_blocks (kv_cpu_tier_gb) too"
            )
        if self.num_cpu_tier_blocks and not self.enable_prefix_caching:
            raise ValueError(
                "num_cpu_tier_blocks: the KV tiers keep prefix-cache blocks; they need "
                "enable_prefix_caching"
            )
        if self.num_gpu_blocks is not None and self.max_model_len is not None:
            needed = -(-self.max_model_len // self.block_size)
            if self.num_gpu_blocks < needed:
                raise ValueError(
                    f"num_gpu_blocks: {self.num_gpu_blocks} blocks of {self.block_size} tokens "
                    f"cannot hold one max_model_len={self.max_model_len} request (needs {needed})"
                )

    def require_sizes(self) -> tuple[int, int]:
        """(num_gpu_blocks, max_model_len): a Scheduler needs them set (an engine measures them)."""
        num_gpu_blocks, max_model_len = self.num_gpu_blocks, self.max_model_len
        if num_gpu_blocks is None or max_model_len is None:
            name = "num_gpu_blocks" if num_gpu_blocks is None else "max_model_len"
            raise ValueError(
                f"{name}: must be set for a Scheduler (an engine sizes it from memory)"
            )
        return num_gpu_blocks, max_model_len

    @property
    def uses_length_probe(self) -> bool:
        """Whether the runner extracts the length probe's features (only when asked: it costs a
        projection per prompt and a few hundred bytes per step)."""
        if self.length_probe == "auto":
            return self.policy in ("srpt", "fair_srpt") or self.admission == "foresight"
        return self.length_probe == "on"

    @property
    def num_watermark_blocks(self) -> int:
        return int(self.watermark * (self.num_gpu_blocks or 0))

    @property
    def cpu_blocks(self) -> int:
        return self.num_cpu_blocks or 0

    @property
    def cpu_tier_blocks(self) -> int:
        return self.num_cpu_tier_blocks or 0

    @property
    def disk_tier_blocks(self) -> int:
        return self.num_disk_tier_blocks or 0
