"""A replica's KV events on their way to the fleet routers.

`attach_kv_events` gives the engine's device pool and lower tiers one KVEventLog
(scheduler/kv_events.py); LLMReplica attaches it before the engine's first step, and its
`record_routing_stats` takes `log.report()` on the engine's thread, between steps, and sends it
inside its RoutingStats (router/stats.py), the channel Serve already carries to every router of
the deployment. Serve may hand a router only the latest of several reports, so each report carries
every batch the log still holds, and a snapshot now and then; the router applies what is new to it
and repairs from a snapshot what it missed.

A report reaches the routers a period or more after the replica's pool changed, so a client that
sends its next request as soon as the last one ends is routed on holdings that are a request old.
Each request's last output therefore carries the log's newest batches too (`with_kv_tail`, on the
replica), and the ingress hands them to the routers of its process (`deliver_kv_tail`) before it
passes the output on: the router applies them before that client's next request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import weakref
from typing import TYPE_CHECKING, Protocol

from scheduler.kv_events import KVEventLog, KVEventTail
from scheduler.outputs import RequestOutput

if TYPE_CHECKING:
    from cluster.engine_loop import EngineLoop
    from engine.core import EngineCore

logger = logging.getLogger(__name__)

# The longest a request's last output waits for the engine's thread to take the tail (the rest of
# the step in progress); past it the output goes without, and the next report brings the events.
TAIL_TIMEOUT_S = 1.0


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


async def with_kv_tail(
    output: RequestOutput, engine_loop: EngineLoop, log: KVEventLog, replica: str
) -> RequestOutput:
    """A request's last output with the log's newest batches, taken on the engine's thread between
    steps (the log's open batch holds what the request's last step stored)."""
    try:
        tail = await asyncio.wait_for(engine_loop.call(lambda _: log.tail(replica)), TAIL_TIMEOUT_S)
    except asyncio.TimeoutError:
        logger.warning(
            "engine busy for %.1f s: a last output without its KV events", TAIL_TIMEOUT_S
        )
        return output
    return dataclasses.replace(output, kv_events=tail)


class KVTailSink(Protocol):
    def post_kv_tail(self, tail: KVEventTail) -> None: ...


# Held weakly: Serve owns the routers. This module must stay importable by reference (see
# cluster/outcomes.py): every router of a process subscribes to the same set.
_SINKS: weakref.WeakSet[KVTailSink] = weakref.WeakSet()


def subscribe_kv_tails(sink: KVTailSink) -> None:
    """Send the KV events that outputs carry into this process to sink (a router of it)."""
    _SINKS.add(sink)


def deliver_kv_tail(output: RequestOutput) -> None:
    """Hand the KV events a request's last output carried to every router of this process (the
    one whose fleet holds the replica applies them); call before passing the output on."""
    if output.kv_events is not None:
        for sink in list(_SINKS):
            sink.post_kv_tail(output.kv_events)
