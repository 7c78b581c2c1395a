"""How each request ended, as its caller saw it, handed to the fleet routers of the same process.

The ingress reports outcomes with `report_outcome`; every cluster.serve_router.FleetRouter of its
process subscribes, and the one that routed the request attributes it to a replica's circuit.
"""

from __future__ import annotations

import weakref
from typing import Protocol


class OutcomeSink(Protocol):
    def post_outcome(self, internal_request_id: str, ok: bool) -> None: ...


# Held weakly: Serve owns the routers. This module must stay importable by reference: Serve ships
# the router class by value, with its own copy of its module's globals.
_SINKS: weakref.WeakSet[OutcomeSink] = weakref.WeakSet()


def subscribe(sink: OutcomeSink) -> None:
    """Send the outcomes reported in this process to sink (a router of this process)."""
    _SINKS.add(sink)


def report_outcome(internal_request_id: str, ok: bool) -> None:
    """How a request ended, as its caller saw it: finished (ok) or failed by its replica.

    Every subscribed router hears it; the one that routed the request attributes it to a replica.
    """
    for sink in list(_SINKS):
        sink.post_outcome(internal_request_id, ok)
