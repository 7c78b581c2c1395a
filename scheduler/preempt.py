"""Preemption: a running request gives its KV blocks up (swapped to the CPU pool, or freed to be
recomputed) and goes back to the head of the waiting queue. Which one is VictimPolicy's choice
(scheduler/preemption.py); these are the Scheduler's steps that carry it out."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from scheduler.config import SchedulerConfig
from scheduler.request import Request, RequestStatus
from scheduler.step import Step

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def preempt(sched: Scheduler, victim: Request, step: Step) -> None:
    """Take victim out of the running batch (and out of this step, if it was scheduled)."""
    rid = victim.request_id
    step.give_back(victim)
    for hook in sched.hooks.on_preempt:
        hook(victim)
    sched.running.remove(victim)
    sched.loras.release(victim.spec.lora_name)
    sched.state_slots.release(rid)  # its recurrent state is dropped: it recomputes
    sched.landed.discard(rid)
    _swap_or_free(sched, victim, step)
    victim.num_preemptions += 1
    sched.num_preemptions += 1
    step.preempted.add(rid)
    sched.waiting.prepend(victim)
    logger.debug("preempted %s (%s)", rid, victim.status.name)


def allocate_or_preempt(sched: Scheduler, req: Request, n: int, step: Step) -> list[int] | None:
    """Blocks for running req's next n tokens, preempting the victim policy's choices until they
    fit; None when req itself was taken."""
    new_blocks = sched.kv.allocate_slots(req, n)
    while new_blocks is None:
        victim = sched.victims.choose(sched.running)
        preempt(sched, victim, step)
        step.running_pass_preempted = True
        if victim is req:
            return None
        new_blocks = sched.kv.allocate_slots(req, n)
    return new_blocks


def _swap_or_free(sched: Scheduler, victim: Request, step: Step) -> None:
    """The victim's KV: swapped to the CPU pool when the config swaps it and the pool has room,
    else freed (it recomputes)."""
    kv = sched.kv
    if swaps(sched.config, victim) and kv.can_swap_out(victim):
        step.swap_out.extend(kv.swap_out(victim))
        victim.status = RequestStatus.SWAPPED
    else:  # recompute (also the fallback when the CPU pool is full)
        kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED


def swaps(cfg: SchedulerConfig, victim: Request) -> bool:
    """Whether preempting victim swaps it out rather than recomputing it. A request the runner
    has never seen (its KV landed from a lower tier this step or the last) could not be resumed
    from a swap: it is recomputed."""
    return victim.known_to_runner and (
        cfg.preemption_mode == "swap"
        or (
            cfg.preemption_mode == "auto"
            and victim.num_computed_tokens >= cfg.swap_min_computed_tokens
        )
    )


def displace_for(sched: Scheduler, req: Request, step: Step, reserve: int) -> bool:
    """Priority policy: preempt a less urgent running request so a more urgent one fits."""
    candidates = [
        r for r in sched.running if r.priority > req.priority and r.request_id not in step.admitted
    ]
    if not candidates:
        return False
    # Only displace when freeing every candidate could make room at all.
    kv = sched.kv
    needed = kv.num_blocks_needed(req.num_tokens)
    reclaimable = kv.num_reclaimable_blocks([r.request_id for r in candidates])
    if needed > kv.num_free_blocks + reclaimable - reserve:
        return False
    preempt(sched, sched.victims.choose(candidates), step)
    return True
