"""EngineConfig: model, device, parallelism and KV-cache sizing of one engine, with its
SchedulerConfig.

Each setting is declared once (default, range, doc) in the tree AppConfig > EngineConfig >
SchedulerConfig; what a worker needs (RunnerConfig) is derived here, never declared again.
Importing this module loads no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from engine.pipeline_config import check_pipeline
from scheduler.config import SchedulerConfig
from scheduler.speculative import SpeculativeConfig
from scheduler.state_slots import MAX_STATE_SLOTS
from settings import build, check_settings, nest, setting, shown
from workers.options import (
    ATTENTION_BACKENDS,
    DEFAULT_CACHE_DIR,
    DTYPE_NAMES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    STEP_TRANSPORTS,
)
from workers.pipeline_split import MAX_PIPELINE_STAGES
from workers.process import MAX_NICE, MIN_NICE

if TYPE_CHECKING:
    from workers.kv_tiers import KVTierConfig
    from workers.runner import RunnerConfig

# RunnerConfig's fields that are this config's (or its scheduler's) settings under the same name,
# passed as they are; runner_config resolves the others.
RUNNER_FROM_ENGINE = (
    "dtype",
    "seed",
    "attention_backend",
    "kv_cache_memory_gb",
    "gpu_memory_utilization",
    "load_progress",
    "cpu_threads",
    "process_niceness",
    "enforce_eager",
    "batch_invariant",
    "grammar_timeout_s",
    "grammar_mask_deadline_s",
    "expert_parallel",
    "speculative",
    "quantization",
    "max_lora_rank",
    "kv_cache_dtype",
    "pipeline_parallel_size",
    "pipeline_layer_split",
)
RUNNER_FROM_SCHEDULER = ("block_size", "max_num_batched_tokens", "max_num_seqs")

# A chunk is held until this many tokens at most: beyond it a stream is no stream.
MAX_STREAM_INTERVAL = 256
# Fewer chunks per step than this would hold chunks past MAX_STREAM_INTERVAL at any batch.
MIN_STREAM_CHUNKS_PER_STEP = 0.01
# LoRA bounds: device slots, rank, adapters kept read on the CPU and adapters declared up front.
MAX_LORAS = 256
MAX_LORA_RANK = 256
MAX_CPU_LORAS = 4096
DEFAULT_MAX_LORAS = 4
# Ranks of one engine at most (tensor x pipeline): a bound, not a promise that so many start.
MAX_WORLD_SIZE = 1024
# Host memory of one engine, in GiB (64 TiB): past any machine, so a larger figure is a typo, not
# a pool of 1e300 GiB whose block count overflows everything sized by it.
MAX_HOST_GB = 1 << 16
# Engine timeouts: a week. Longer is no timeout at all, and sockets refuse a timeout past ~9.2e9 s
# (OverflowError at the first step, not at start).
MAX_ENGINE_TIMEOUT_S = 7 * 86400
# Threads of one process: NR_CPUS, the most CPUs a Linux kernel can be built for.
MAX_CPU_THREADS = 8192
EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(slots=True)
class EngineConfig:
    """Model, device, parallelism and cache sizing of one engine (one data-parallel replica)."""

    model: str = setting(
        "default",
        "`default` (the embedded SmolLM2 GGUF), an HF directory, a `.gguf` file, or a Hugging "
        "Face hub id `org/name` (served: `revision`, `download_dir`; docs/operations.md#models-"
        "from-the-hugging-face-hub)",
    )
    dtype: str = setting("float32", "weights and activations", choices=DTYPE_NAMES)
    device: str = setting(
        "auto", "`auto` (cuda when the process sees a GPU, else cpu), `cpu`, `cuda` or `cuda:N`"
    )
    tensor_parallel_size: int = setting(
        1,
        "tensor-parallel ranks (GPUs, or CPU worker processes) per replica",
        ge=1,
        le=MAX_WORLD_SIZE,
    )
    distributed_executor_backend: str | None = setting(
        None,
        "what runs the ranks when there are several: `mp`, one spawned process per rank on this "
        "machine (torch.distributed, no Ray); `ray`, one Ray actor per rank, on any node of the "
        "cluster. Unset: `mp` when every rank fits this machine (its GPUs; on CPU always), else "
        "`ray`. A served replica's ranks are always Ray actors in its placement group "
        "(`mp` is refused there). docs/executors.md",
        choices=EXECUTOR_BACKENDS,
    )
    pipeline_parallel_size: int = setting(
        1,
        "pipeline stages per replica: the decoder layers split into this many stages, each "
        "a tensor-parallel group (world size tensor_parallel_size x pipeline_parallel_size). "
        "Each stage's KV pool holds only its layers (docs/pipeline.md)",
        ge=1,
        le=MAX_PIPELINE_STAGES,
    )
    pipeline_layer_split: list[int] | None = setting(
        None,
        "decoder layers of each pipeline stage, in order (pipeline_parallel_size counts summing "
        "to the model's num_hidden_layers). Unset: the split that evens out what a decode step "
        "costs the stages (weights read, the LM head counted on the last stage; "
        "docs/pipeline.md#the-default-split)",
    )
    expert_parallel: bool = setting(
        False,
        "mixture-of-experts models: each tensor-parallel rank holds whole experts (about "
        "num_experts / tensor_parallel_size of them) instead of a slice of every expert; "
        "dense models ignore it",
    )
    seed: int = setting(0, "seed of the engine's default sampling generator", ge=0, lt=2**63)
    kv_cache_memory_gb: float = setting(
        2.0, "KV pool of a CPU engine, in GiB", gt=0, le=MAX_HOST_GB
    )
    gpu_memory_utilization: float = setting(
        0.9, "share of GPU memory for weights, activations and KV", gt=0, le=1
    )
    swap_space_gb: float = setting(
        0.0,
        "CPU pool for swap preemption, in GiB (unless num_cpu_blocks pins it)",
        ge=0,
        le=MAX_HOST_GB,
    )
    encoder_cache_gb: float = setting(
        0.5,
        "vision models: the encoder outputs each rank keeps by image digest (LRU), in GiB, so a "
        "conversation's next turn does not encode its images again; 0: none kept",
        ge=0,
        le=1024,
    )
    kv_cpu_tier_gb: float = setting(
        0.0,
        "CPU tier of the prefix cache, in GiB per rank: cached prefix blocks the device pool "
        "evicts are kept in host memory and loaded back on a later hit instead of recomputed "
        "(docs/kv-tiers.md; unless num_cpu_tier_blocks pins it). 0: off",
        ge=0,
        le=1 << 16,
    )
    kv_disk_tier_gb: float = setting(
        0.0,
        "disk tier of the prefix cache below the CPU tier, in GiB per rank, under "
        "kv_disk_tier_dir (unless num_disk_tier_blocks pins it). 0: off",
        ge=0,
        le=1 << 20,
    )
    kv_disk_tier_dir: str = setting(
        DEFAULT_CACHE_DIR + "/kv-tier",
        "where the disk tier writes its block files: a local directory; each engine writes in a "
        "subdirectory of its own and removes it at shutdown",
        path=True,
    )
    quantization: str = setting(
        "auto",
        "GGUF weights: `gguf` keeps Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K blocks as stored and "
        "multiplies them "
        "with raylm's CPU kernels (one copy, a quarter to an eighth of the bytes; CPU only); "
        "`none` de-quantises to `dtype` once; `auto` is `gguf` for a .gguf model on CPU, else "
        "`none`. `fp8` quantizes a float checkpoint's linears to FP8 E4M3 at load (a scale per "
        "output channel, activations scaled per token; `torch._scaled_mm` on CUDA 8.9+, a "
        "de-quantizing reference on CPU). A GPTQ, AWQ or compressed-tensors FP8 checkpoint "
        "always loads in its own format (docs/quantization.md)",
        choices=QUANTIZATIONS,
    )
    cache_dir: str = setting(DEFAULT_CACHE_DIR, "where converted GGUF weights are cached")
    attention_backend: str = setting(
        "auto",
        "paged attention kernel: `auto` is the Triton decode kernel on CUDA (captured by CUDA "
        "graphs), torch elsewhere; `flash_attn` runs only when named (a source build)",
        choices=ATTENTION_BACKENDS,
    )
    kv_cache_dtype: str = setting(
        "auto",
        "what the paged KV cache stores: `auto` is `dtype`; `fp8` stores K and V as float8 E4M3 "
        "codes with a fixed scale per layer (1.0), half of bf16's bytes, so "
        "gpu_memory_utilization gives twice the blocks. CUDA with compute capability 8.9+ and "
        "the triton or torch attention backend only (docs/quantization.md#fp8-kv-cache)",
        choices=KV_CACHE_DTYPES,
    )
    cpu_threads: int | None = setting(
        None,
        "torch intra-op threads of a CPU engine (unset: a served replica's "
        "`replica_num_cpus`, rounded down; offline, what the process has)",
        ge=1,
        le=MAX_CPU_THREADS,
    )
    process_niceness: int | None = setting(
        None,
        "nice value of the engine's processes, every thread (the replica, its TP workers; served, "
        "the ingress and its node's Serve proxy too). Ray starts workers at nice 15, behind "
        "every other process of the node (the "
        "HTTP "
        "client, other jobs); going below 15 needs CAP_SYS_NICE, else a warning. Unset: left as "
        "started",
        ge=MIN_NICE,
        le=MAX_NICE,
    )
    enforce_eager: bool = setting(
        False, "CUDA: run decode steps eagerly instead of replaying captured CUDA graphs"
    )
    batch_invariant: bool = setting(
        False,
        "a request's tokens and logprobs are bit-identical alone or in any batch, chunked or "
        "not, after a prefix hit or a preemption (CPU only; docs/batch_invariance.md)",
    )
    async_scheduling: bool | None = setting(
        None,
        "schedule each step while the previous one runs, before its tokens are back (the tokens "
        "are the same either way). Unset: off until it is measured on a GPU (on CPU it is not "
        "reliably faster, bench/async_scheduling.py). tensor_parallel_size > 1 or "
        "pipeline_parallel_size > 1 always runs synchronously",
    )
    step_transport: str = setting(
        "socket",
        "TP > 1: how each step reaches the workers: a TCP connection per rank "
        "(fastest), a Ray Compiled Graph, or plain actor calls",
        choices=STEP_TRANSPORTS,
    )
    step_timeout_s: float = setting(
        300.0,
        "TP > 1: a step whose workers do not answer within this fails the engine",
        gt=0,
        le=MAX_ENGINE_TIMEOUT_S,
    )
    engine_stall_timeout_s: float = setting(
        120.0,
        "a replica with work whose step has not finished for this long fails its health check "
        "(Serve replaces it; its requests resume elsewhere)",
        gt=0,
        le=MAX_ENGINE_TIMEOUT_S,
    )
    stream_interval: int = setting(
        1,
        "served: tokens per streamed chunk of a request. The first tokens and the finish go at "
        "once; "
        "larger values cut the serving stack's per-chunk CPU (Ray and Serve handle each chunk "
        "twice) at the "
        "cost of smoothness",
        ge=1,
        le=MAX_STREAM_INTERVAL,
    )
    stream_chunks_per_step: float | None = setting(
        None,
        "served: chunks a replica sends per engine step across all its streams, on average at "
        "most: with more streams than that, each stream's chunk grows past stream_interval to "
        "ceil(streams / this) tokens (cluster/stream_chunks.py). Each chunk costs the replica, "
        "the ingress and the Serve proxy CPU the step needs; text arrives in larger pieces, the "
        "time per token is the step's. Unset: stream_interval alone",
        ge=MIN_STREAM_CHUNKS_PER_STEP,
        le=MAX_STREAM_INTERVAL,
    )
    grammar_timeout_s: float = setting(
        10.0,
        "longest a structured-output schema, regex or grammar may take to check and compile "
        "(its first mask included); slower ones get 400",
        gt=0,
        le=600,
    )
    grammar_mask_deadline_s: float = setting(
        1.0,
        "longest a step waits for a constrained request's token mask; a later mask fails that "
        "request alone",
        gt=0,
        le=60,
    )
    load_progress: bool = setting(True, "show a progress bar while loading weights")
    speculative: SpeculativeConfig | None = setting(
        None,
        "speculative decoding: `{method, num_tokens, ngram_min, ngram_max, draft_model, "
        "max_batch_size, min_acceptance_rate}` (docs/speculative.md). Unset: one token per step",
    )
    max_loras: int | None = setting(
        None,
        "LoRA adapters held on the device at once (slots); requests for other adapters wait for "
        "a slot. 0: LoRA off. Unset: 4 when lora_modules or lora_root is set, else 0 "
        "(docs/lora.md)",
        ge=0,
        le=MAX_LORAS,
    )
    max_lora_rank: int = setting(
        16, "largest LoRA rank an adapter may have", ge=1, le=MAX_LORA_RANK
    )
    max_cpu_loras: int | None = setting(
        None,
        "LoRA adapters loaded at once: every rank keeps each one's checked tensors in CPU memory "
        "(a slot is refilled without reading the disk; the files may vanish). Unset: 2 x max_loras",
        ge=1,
        le=MAX_CPU_LORAS,
    )
    lora_modules: dict[str, str] | None = setting(
        None, "LoRA adapters loaded at start: `{name: PEFT adapter directory}`"
    )
    lora_root: str | None = setting(
        None,
        "directory under which adapters may be loaded at run time (EngineCore.add_lora); "
        "unset: only the lora_modules paths",
    )
    num_state_checkpoints: int | None = setting(
        None,
        "hybrid models (Qwen3-Next, Granite-4 hybrid) with prefix caching: recurrent-state "
        "checkpoints kept at block boundaries (the last of each prompt chunk), each the size of "
        "one request's state; a prefix hit rounds down to a checkpointed block. 0: no hybrid "
        "prefix hits. Unset: max_num_seqs (docs/hybrid.md)",
        ge=0,
        le=MAX_STATE_SLOTS,
    )
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        check_settings(self)
        self._check_loras()
        if not self.model:
            raise ValueError("model: must be a non-empty string")
        if not (self.device in ("auto", "cpu", "cuda") or _is_cuda_index(self.device)):
            raise ValueError(f"device: must be auto, cpu, cuda or cuda:N, got {shown(self.device)}")
        sched = self.scheduler
        if (
            sched.preemption_mode == "swap"
            and sched.num_cpu_blocks is None
            and self.swap_space_gb == 0
        ):
            raise ValueError(
                "scheduler.preemption_mode: 'swap' needs a CPU pool: set swap_space_gb or "
                "num_cpu_blocks"
            )
        self._check_kv_cache_dtype()
        check_pipeline(self)

    def _check_kv_cache_dtype(self) -> None:
        """An FP8 cache where nothing can read it fails here; `device: auto` resolving to a CPU
        fails in RunnerConfig, and a GPU older than compute capability 8.9 in the worker."""
        if self.kv_cache_dtype != "fp8":
            return
        if self.device == "cpu":
            raise ValueError(
                "kv_cache_dtype: 'fp8' needs a CUDA GPU, device is 'cpu' (the CPU paged-decode "
                "kernel reads float caches only); use 'auto'"
            )
        if self.attention_backend == "flash_attn":
            raise ValueError(
                "kv_cache_dtype: 'fp8' is read by the triton and torch attention backends, not "
                "flash_attn; use attention_backend auto, triton or torch"
            )

    def _check_loras(self) -> None:
        from scheduler.request import check_lora_name

        modules = self.lora_modules or {}
        if len(modules) > MAX_CPU_LORAS:
            raise ValueError(f"lora_modules: at most {MAX_CPU_LORAS} adapters")
        for name, path in modules.items():
            check_lora_name(name, "lora_modules")
            if not isinstance(path, str) or not path:
                raise ValueError(f"lora_modules: {name!r} needs a directory path")
        if modules and self.max_loras == 0:
            raise ValueError("max_loras: is 0 (LoRA off) but lora_modules names adapters")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.num_lora_slots:
            raise ValueError(
                f"max_cpu_loras: must be at least max_loras={self.num_lora_slots}, got "
                f"{self.max_cpu_loras}"
            )

    @property
    def num_lora_slots(self) -> int:
        """max_loras resolved: LoRA is on when it is set above 0, or when adapters are named."""
        if self.max_loras is not None:
            return self.max_loras
        return DEFAULT_MAX_LORAS if self.lora_modules or self.lora_root is not None else 0

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras or 2 * self.num_lora_slots

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Engine settings and SchedulerConfig knobs mixed in one flat call, as LLM(...) takes
        them (a `scheduler` mapping or SchedulerConfig too: the flat knobs win)."""
        return build(cls, nest(cls, kwargs))

    def resolved_device(self) -> str:
        """ "auto" resolved against what this process can see."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def world_size(self) -> int:
        """Ranks of one engine, rank = stage * tensor_parallel_size + tp_rank: the one place that
        counts them (executors size their groups from it)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def uses_async_scheduling(self) -> bool:
        """Whether steps overlap: async_scheduling resolved against the device and the TP size.

        Under tensor (or pipeline) parallelism one rank samples, and the other ranks learn each
        token from the next step, so a step cannot be sent before the previous one's tokens are
        back."""
        if self.world_size > 1:
            return False
        # Unset stays off: the overlapped path has been proven exact on CPU but has not yet run
        # on a GPU, and the default path must be the measured one.
        return bool(self.async_scheduling)

    def sized_scheduler(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        max_model_len: int,
        tiers: KVTierConfig | None = None,
    ) -> SchedulerConfig:
        """The SchedulerConfig with the measured pool sizes and context length filled in."""
        return replace(
            self.scheduler,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            max_model_len=max_model_len,
            num_cpu_tier_blocks=tiers.num_cpu_blocks if tiers is not None else 0,
            num_disk_tier_blocks=tiers.num_disk_blocks if tiers is not None else 0,
        )

    def runner_config(
        self,
        model_dir: str,
        max_model_len: int,
        tiers: KVTierConfig | None = None,
        draft_model_dir: str | None = None,
    ) -> RunnerConfig:
        """What every worker rank needs to build its model and cache. model_dir is the directory
        `model` resolves to: a GGUF `model` also names the file whose blocks the ranks keep.
        draft_model_dir: the draft model's directory, checked by workers.draft.check_draft_model."""
        from workers.runner import RunnerConfig

        sched = self.scheduler
        draft = None if self.speculative is None else self.speculative.draft_model
        return RunnerConfig(
            **{name: getattr(self, name) for name in RUNNER_FROM_ENGINE},
            **{name: getattr(sched, name) for name in RUNNER_FROM_SCHEDULER},
            model_dir=model_dir,
            device=self.resolved_device(),
            max_model_len=max_model_len,
            encoder_cache_bytes=int(self.encoder_cache_gb * (1 << 30)),
            async_scheduling=self.uses_async_scheduling(),
            gguf_file=self.quantized_gguf(),
            max_loras=self.num_lora_slots,
            max_cpu_loras=self.num_cpu_loras,
            kv_tiers=tiers,
            length_feature_dim=sched.length_feature_dim if sched.uses_length_probe else 0,
            draft_model_dir=draft_model_dir,
            draft_gguf_file=None if draft is None else self.quantized_gguf(draft),
        )

    def quantized_gguf(self, model: str | None = None) -> str | None:
        """The GGUF file whose blocks the workers keep quantized, per `quantization`, of `model`
        (default: the engine's model; a draft model follows the same rule); None when the weights
        load as floats."""
        if self.quantization not in ("auto", "gguf"):
            return None
        from workers.model_files import gguf_path

        path = gguf_path(self.model if model is None else model)
        if path is None:
            return None
        if self.resolved_device() != "cpu":
            if self.quantization == "gguf":
                raise ValueError(
                    f"quantization: 'gguf' runs on CPU only, the device is {self.resolved_device()}"
                )
            return None
        return str(path)

    @property
    def block_size(self) -> int:
        return self.scheduler.block_size


def _is_cuda_index(device: str) -> bool:
    return device.startswith("cuda:") and device[5:].isdigit()
