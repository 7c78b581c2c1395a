"""A replica's KV events on their way to the fleet routers.

`attach_kv_events` gives the engine's device pool and lower tiers one KVEventLog
(scheduler/kv_events.py); LLMReplica attaches it before the engine's first step, and its
`record_routing_stats` takes `log.report()` on the engine's thread, between steps, and sends it
inside its RoutingStats (router/stats.py), the channel Serve already carries to every router of
the deployment. Serve may hand a router only the latest of several reports, so each report carries
every batch the log still holds, and a snapshot now and then; the router applies what is new to it
and repairs from a snapshot what it missed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.kv_events import KVEventLog

if TYPE_CHECKING:
    from engine.core import EngineCore


def attach_kv_events(engine: EngineCore) -> KVEventLog:
    """A KV event log fed by engine's device pool and lower tiers (call before its first step,
    or on the engine's thread)."""
    scheduler = engine.scheduler
    pool, connector = scheduler.kv.pool, scheduler.connector

    def snapshot() -> tuple[list[int], list[int], list[int]]:
        # The connector is read each time: a disaggregated replica may swap it after start.
        tiers = scheduler.connector
        if tiers is None:
            return list(pool.cached), [], []
        disk = list(tiers.disk.slots) if tiers.disk is not None else []
        return list(pool.cached), list(tiers.cpu.slots), disk

    log = KVEventLog(snapshot)
    pool.events = log
    if connector is not None:
        connector.cpu.events = log
        if connector.disk is not None:
            connector.disk.events = log
    return log
