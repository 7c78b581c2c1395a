"""The engine's pipeline-parallel settings checked against the features they meet.

What runs with pipeline stages (docs/pipeline.md): prefix caching, chunked prefill, preemption
(recompute and swap), structured output, pooling, prompt logprobs, length features, expert
parallelism. The stages keep one step in flight each (micro_batches below,
scheduler/features_pipeline.py); async scheduling is accepted and adds nothing to that (a
request's next token is scheduled once its previous one is back, as under tensor parallelism).
What is refused below has a reason written next to it. Importing this module loads no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.pipeline_split import check_layer_split

if TYPE_CHECKING:
    from engine.config import EngineConfig


def check_pipeline(config: EngineConfig) -> None:
    """pipeline_layer_split's shape, and a ValueError naming the setting that cannot run with
    pipeline_parallel_size > 1."""
    from engine.config import MAX_WORLD_SIZE  # engine.config imports this module

    check_layer_split(config.pipeline_layer_split, config.pipeline_parallel_size)
    if config.pipeline_parallel_size == 1:
        return
    if config.world_size > MAX_WORLD_SIZE:
        raise ValueError(
            f"pipeline_parallel_size: {config.pipeline_parallel_size} stages of "
            f"tensor_parallel_size={config.tensor_parallel_size} ranks make "
            f"{config.world_size} ranks, more than {MAX_WORLD_SIZE}"
        )
    reason = _refusal(config)
    if reason is not None:
        raise ValueError(
            f"{reason[0]}: not supported with pipeline_parallel_size="
            f"{config.pipeline_parallel_size} yet: {reason[1]}"
        )


def micro_batches(config: EngineConfig) -> int:
    """Steps the engine keeps in flight for its pipeline: one per stage (1: no stages), so every
    stage has a micro-batch to run (scheduler/features_pipeline.py)."""
    return config.pipeline_parallel_size


def _refusal(config: EngineConfig) -> tuple[str, str] | None:
    sched = config.scheduler
    if config.speculative is not None:
        return (
            "speculative",
            "the proposer and the draft model run on the sampling rank, and verify rows would "
            "have to cross every stage; not built yet",
        )
    if config.num_lora_slots:
        return (
            "max_loras",
            "adapter slots are filled per decoder layer and every stage would load its own "
            "layers' share; not built yet",
        )
    if config.kv_cpu_tier_gb or config.kv_disk_tier_gb or sched.num_cpu_tier_blocks:
        return (
            "kv_cpu_tier_gb",
            "a tier block holds every layer of a rank's pool and is sized from one stage's "
            "layers; not built yet",
        )
    return None
