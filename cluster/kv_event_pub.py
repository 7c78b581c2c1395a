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
Each request's last output therefore carries the log's newest batches too (`TailingEngine`: taken on
the engine's thread right after the step that finished the request, so the output never waits),
and the ingress hands them to the routers of its process (`deliver_kv_tail`) before it passes the
output on: the router applies them before that client's next request.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import TYPE_CHECKING, Any, Protocol

from scheduler.kv_events import KVEventLog, KVEventTail, attach_kv_log
from scheduler.outputs import RequestOutput

if TYPE_CHECKING:
    from engine.core import EngineCore

logger = logging.getLogger(__name__)


def attach_kv_events(engine: EngineCore) -> KVEventLog:
    """A KV event log fed by engine's device pool and lower tiers (call before its first step,
    or on the engine's thread)."""
    return attach_kv_log(engine.scheduler)


# The finishes whose outputs carry the KV events: a request that ended by itself. An abort or an
# error ends before its blocks matter to the router, and the next report brings them anyway.
TAILED_FINISHES = ("stop", "length")


class TailingEngine:
    """The engine as the replica's loop drives it, whose step attaches the log's newest batches
    (`KVEventLog.tail`) to the outputs of the requests it finished. Taken on the engine's thread
    right after the step, the tail holds what those requests' last step stored, and the output
    goes out with the step's others: it never waits for the engine (an earlier design asked the
    engine thread for the tail after the output arrived, waiting up to 1 s for the step in
    progress). One tail a step, shared by the step's finished outputs."""

    def __init__(self, engine: Any, log: KVEventLog, replica: str) -> None:
        self.engine = engine
        self.log = log
        self.replica = replica

    def step(self) -> list[RequestOutput]:
        outputs = self.engine.step()
        if not any(o.finished and o.finish_reason in TAILED_FINISHES for o in outputs):
            return outputs
        tail = self.log.tail(self.replica)
        return [
            dataclasses.replace(o, kv_events=tail)
            if o.finished and o.finish_reason in TAILED_FINISHES
            else o
            for o in outputs
        ]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


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
