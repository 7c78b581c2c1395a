"""How a waiting request joins the running batch: admitted with its longest cached prefix (or
sent to load its KV from a lower tier first), brought back from a swap, or, after a tier load
landed, sent to the runner in full. These are the Scheduler's own steps, kept in a module of their
own."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.kv_loading import start_loading
from scheduler.multimodal import fit_images
from scheduler.request import Request, RequestStatus
from scheduler.step import Step, to_prompt_end

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler


def admit_waiting(sched: Scheduler, req: Request, step: Step, reserve: int) -> bool:
    """Admit a WAITING or PREEMPTED request, reusing its longest cached prefix."""
    kv = sched.kv
    cached = kv.find_cached_blocks(req)
    if sched.connector is not None and kv.reuses_prefix(req):
        end = (req.num_tokens - 1) // kv.block_size  # find_cached_blocks hashed this far
        num_load = sched.connector.lookup(req.block_hashes[len(cached) : end])
        if num_load:
            return start_loading(sched, req, cached, num_load, reserve)
    num_hit = len(cached) * kv.block_size
    n = min(req.num_tokens - num_hit, sched.prefill_cap, step.budget, to_prompt_end(req, num_hit))
    n = min(n, sched.bulk.cap(req, num_hit))
    if req.image_spans:  # never cut inside an image; n may be 0: it waits for a later step
        n = fit_images(req.image_spans, num_hit, n, step.encoder_budget)
        if n <= 0:
            return False
    # Anti-thrash: admit only when the whole sequence so far fits, not just this chunk.
    if not kv.can_admit(req, cached, reserve):
        return False
    if sched.admission is not None and not sched.admission.fits(req, sched.running, reserve):
        return False
    new_blocks = kv.allocate_slots(req, n, cached)
    if new_blocks is None:
        return False
    sched.waiting.pop()
    if req.num_cached_tokens is None:  # first admission: count its prefix-cache lookup
        req.num_cached_tokens = num_hit
        kv.record_lookup(req.num_tokens, num_hit)
    req.num_computed_tokens = num_hit
    step.send(req, resumed=True)
    start_running(sched, req, step, n, new_blocks)
    return True


def send_landed(sched: Scheduler, req: Request, step: Step) -> list[int]:
    """A landed request's first step: sent in full (or resumed), with its whole table."""
    sched.landed.discard(req.request_id)
    step.send(req, resumed=True)
    return list(sched.kv.blocks_of(req.request_id))


def resume_swapped(sched: Scheduler, req: Request, step: Step, reserve: int) -> bool:
    """Bring a SWAPPED request back from the CPU pool with its progress intact."""
    computed = req.num_computed_tokens
    n = min(req.num_tokens - computed, sched.prefill_cap, step.budget, to_prompt_end(req, computed))
    n = min(n, sched.bulk.cap(req, computed))
    if req.image_spans:
        n = fit_images(req.image_spans, computed, n, step.encoder_budget)
        if n <= 0:
            return False
    if not sched.kv.can_swap_in(req, n, reserve):
        return False
    sched.waiting.pop()
    blocks, copies = sched.kv.swap_in(req, n)
    step.swap_in.extend(copies)
    step.send(req, resumed=True)
    start_running(sched, req, step, n, blocks)
    return True


def start_running(
    sched: Scheduler, req: Request, step: Step, n: int, new_blocks: list[int]
) -> None:
    """req joins the running batch with the step's first n of its tokens."""
    req.status = RequestStatus.RUNNING
    sched.running.append(req)
    step.admitted.add(req.request_id)
    start = step.take(req, n, new_blocks)
    sched.bulk.charge(req, start, n)
    if sched.waiting.charges_tokens:
        sched.charge_input(req, start, n)
