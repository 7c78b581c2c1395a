"""What a Scheduler reports (its SchedulerStats snapshot) and keeps of a step's expert rows and
length features."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.kv_loading import tier_stats
from scheduler.length_live import LivePredictor
from scheduler.outputs import SchedulerStats

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler


def collect_stats(sched: Scheduler, extra: dict[str, int]) -> SchedulerStats:
    """Queue lengths and KV-cache figures now; `extra`: fields the step features fill."""
    kv = sched.kv
    return SchedulerStats(
        num_waiting=len(sched.waiting),
        num_running=len(sched.running),
        num_swapped=len(kv.req_cpu_blocks),  # exactly the requests swapped out to the CPU pool
        kv_cache_usage=kv.usage,
        prefix_cache_hit_rate=kv.prefix_cache_hit_rate,
        num_preemptions=sched.num_preemptions,
        num_free_blocks=kv.num_free_blocks,
        num_prompt_tokens_queried=kv.num_queried_tokens,
        num_prompt_tokens_hit=kv.num_hit_tokens,
        num_gpu_blocks=kv.pool.num_blocks,
        loaded_loras=sched.loras.loaded(),
        lora_identities=tuple(sched.loras.identities.values()),
        num_waiting_prompt_tokens=sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting),
        **tier_stats(sched.connector),
        **extra,
    )


def count_expert_tokens(totals: list[int], rows: list[int]) -> None:
    """Add a step's (token, expert) rows per tensor-parallel rank to the running totals."""
    if len(totals) != len(rows):
        totals[:] = [0] * len(rows)
    for rank, n in enumerate(rows):
        totals[rank] += n


def take_length_features(sched: Scheduler, features: dict[str, list[float]]) -> None:
    """Prompts' hidden-state features, kept on their requests for the length probe (before
    their tokens are appended: a request that finishes at once learns from its feature)."""
    model = sched.length_model()
    if not isinstance(model, LivePredictor):  # a study swapped in another model
        return
    for rid, vector in features.items():
        req = sched.requests.get(rid)
        if req is not None:
            model.take_feature(req, vector)
