"""The Scheduler's half of KV that arrives from elsewhere (the prefix cache's lower tiers, another
engine): a request whose blocks must be loaded waits in LOADING_KV with its whole sequence's
blocks reserved; the step that carried the loads lands it, running, its loaded blocks computed.

These are the Scheduler's own steps, kept in a module of their own; `connector` is its
KVConnector (scheduler/kv_connector.py), `loading` and `landed` its bookkeeping.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.kv_connector import KVConnector, KVTransfers
from scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler


def start_loading(
    sched: Scheduler, req: Request, cached: list[int], num_load: int, reserve: int
) -> bool:
    """Reserve blocks for req's whole sequence and load num_load blocks after its device hit;
    False (nothing changed) when they cannot be found."""
    kv, connector = sched.kv, sched.connector
    assert connector is not None
    if not kv.can_admit(req, cached, reserve):
        return False
    blocks = kv.allocate_slots(req, req.num_tokens - len(cached) * kv.block_size, cached)
    if blocks is None:
        return False
    sched.waiting.pop()
    first = len(cached)
    hashes = req.block_hashes[first : first + num_load]
    connector.load(req.request_id, first, hashes, blocks[first : first + num_load])
    req.status = RequestStatus.LOADING_KV
    sched.loading[req.request_id] = req
    return True


def land_loads(sched: Scheduler, transfers: KVTransfers, failed_blocks: list[int]) -> list[Request]:
    """The step that carried these loads ran: their requests are admitted (running, last) with
    their loaded blocks computed and findable by others; from the first block that failed its
    check on, they are recomputed. A running request can be preempted, so blocks reserved this way
    can always be taken back. Returns the requests that landed."""
    connector = sched.connector
    assert connector is not None
    failed = set(failed_blocks)
    landed = []
    for rid in transfers.loading_req_ids:
        req = sched.loading.pop(rid, None)
        plan = connector.land(rid, failed)
        if req is None or plan is None:  # aborted while loading
            continue
        _admit_loaded(sched, req, (plan.first + len(plan.blocks)) * sched.kv.block_size)
        landed.append(req)
    return landed


def _admit_loaded(sched: Scheduler, req: Request, num_hit: int) -> None:
    """req runs (last) with its first num_hit tokens computed: the loaded blocks registered for
    prefix hits, counted as its cache lookup at its first admission."""
    kv = sched.kv
    kv.register_computed_blocks(req, num_hit)
    req.num_computed_tokens = num_hit
    if req.num_cached_tokens is None:  # first admission: count its prefix-cache lookup
        req.num_cached_tokens = num_hit
        kv.record_lookup(req.num_tokens, num_hit)
    req.status = RequestStatus.RUNNING
    sched.running.append(req)
    sched.landed.add(req.request_id)


def tier_stats(connector: KVConnector | None) -> dict[str, int]:
    """The lower tiers' SchedulerStats fields (none when they are off)."""
    if connector is None:
        return {}
    disk, counts = connector.disk, connector.stats
    return dict(
        num_cpu_tier_blocks=len(connector.cpu),
        num_disk_tier_blocks=len(disk) if disk is not None else 0,
        num_tier_saved_blocks=counts.num_saved_blocks,
        num_tier_loaded_blocks=counts.num_loaded_blocks,
        num_tier_failed_loads=counts.num_failed_loads,
    )
