"""RunnerConfig: what a worker needs to build its model, its cache and its features (plain values:
it travels to Ray workers). Derived by engine.config.EngineConfig.runner_config."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.speculative import SpeculativeConfig
from workers.kv_fp8 import cache_dtype
from workers.kv_tiers import KVTierConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class RunnerConfig:
    """What a worker needs to build its model and cache (plain values: travels to Ray workers).

    Derived by engine.config.EngineConfig.runner_config, where each setting is declared.
    """

    model_dir: (
        str  # an HF directory (GGUF files are converted by workers.model_files.resolve_model)
    )
    dtype: str
    device: str  # "cpu" or "cuda" / "cuda:N"
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    seed: int
    attention_backend: str
    kv_cache_memory_gb: float
    gpu_memory_utilization: float
    load_progress: bool
    cpu_threads: int | None = None
    process_niceness: int | None = None
    enforce_eager: bool = False
    # Every CPU kernel on the path in a fixed reduction order (workers/layers/invariant.py).
    batch_invariant: bool = False
    grammar_timeout_s: float = 10.0
    grammar_mask_deadline_s: float = 1.0
    # The engine schedules a step before the previous one's tokens are back (TP = 1 only): the
    # runner appends what it samples itself, and the scheduler sends no sampled token back.
    async_scheduling: bool = False
    # MoE layers hold whole experts per rank (workers/layers/moe.py).
    expert_parallel: bool = False
    # Speculative decoding: the runner proposes after sampling and verifies what is scheduled.
    speculative: SpeculativeConfig | None = None
    # method `draft`: the draft's HF directory (and GGUF file, when its blocks stay quantized).
    draft_model_dir: str | None = None
    draft_gguf_file: str | None = None
    # A GGUF file whose Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K weights are multiplied as stored (CPU);
    # None: model_dir's float weights.
    gguf_file: str | None = None
    # `fp8`: quantize the float checkpoint's linears to FP8 at load; other values: the
    # checkpoint's own format (workers/quant_config.py).
    quantization: str = "none"
    # LoRA: device slots (0: off), their rank, and the adapters each rank keeps read on the CPU.
    max_loras: int = 0
    max_lora_rank: int = 16
    max_cpu_loras: int = 0
    # The prefix cache's lower tiers (workers/kv_tiers.py); None: off.
    kv_tiers: KVTierConfig | None = None
    # `fp8`: K/V stored as E4M3 codes with per-layer scales (workers/kv_fp8.py); `auto`: dtype.
    kv_cache_dtype: str = "auto"
    # Floats of each prompt's last hidden state sent to the length probe (0: off;
    # workers/length_features.py).
    length_feature_dim: int = 0
    # Vision models: bytes of encoder outputs kept by image digest (workers/features/vision.py).
    encoder_cache_bytes: int = 512 << 20
    # Pipeline stages (workers/pipeline.py): how many, and the decoder layers of each (None:
    # balanced by count). The worker's rank says which stage it is.
    pipeline_parallel_size: int = 1
    pipeline_layer_split: list[int] | None = None
    # A hybrid model with prefix caching: recurrent-state checkpoints kept beside the running
    # requests' slots (workers/linear_state.py); 0: none.
    num_state_checkpoints: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.batch_invariant and not self.device.startswith("cpu"):
            raise ValueError(
                f"batch_invariant: runs on CPU only, this engine runs on {self.device} (the "
                "Triton kernels and cuBLAS split their reductions by batch shape)"
            )
        cache_dtype(self.kv_cache_dtype, DTYPES[self.dtype])  # raises on an unknown name
        if self.kv_cache_dtype == "fp8" and not self.device.startswith("cuda"):
            raise ValueError(
                f"kv_cache_dtype: 'fp8' needs a CUDA GPU, this engine runs on {self.device} "
                "(the CPU paged-decode kernel reads float caches only); use 'auto'"
            )
